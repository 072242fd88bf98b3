"""shardstream show --grid: a picture of the first batch after decoding and the user's transform,
drawn from a real packed dataset and read back pixel by pixel."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
from conftest import write_dataset
from PIL import Image

from shardstream.cli.main import main
from shardstream.tools.grid import CAPTION, to_pil
from shardstream.write.pack import pack

RED, GREEN = (255, 0, 0), (0, 200, 0)


@pytest.fixture
def colours(tmp_path):
    """6 images of 16x16 in two classes; the first of each class a solid colour, the rest noise."""
    rng = np.random.default_rng(0)
    for c, colour in (("a", RED), ("b", GREEN)):
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(3):
            pixels = np.full((16, 16, 3), colour, np.uint8) if i == 0 else rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "src" / c / f"{i:04d}.png")
    pack(str(tmp_path / "src"), str(tmp_path / "ds"), label_from_dir=True, max_count=4)
    return tmp_path / "ds"


def tile_centre(img: Image.Image, index: int, n: int, tile: int = 128) -> tuple[int, int, int]:
    columns = math.ceil(math.sqrt(n))
    x0, y0 = (index % columns) * tile, (index // columns) * (tile + CAPTION)
    return img.getpixel((x0 + tile // 2, y0 + tile // 2))


def write_module(tmp_path, monkeypatch, body: str) -> str:
    name = f"grid_transform_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.chdir(tmp_path)
    return name


def test_grid_draws_the_first_batch_with_keys_and_labels(colours, tmp_path, capsys):
    out = tmp_path / "batch.png"
    assert main(["show", str(colours), "--grid", str(out), "--batch-size", "6"]) == 0
    said = capsys.readouterr().out
    assert "6 samples from 'png', 3 x 2 tiles of 128x156 pixels (first key a/0000)" in said
    img = Image.open(out)
    assert img.size == (3 * 128, 2 * (128 + CAPTION))
    assert tile_centre(img, 0, 6) == RED and tile_centre(img, 3, 6) == GREEN  # a/0000, then b/0000 fourth
    # A smaller batch, smaller tiles: the layout follows.
    assert main(["show", str(colours), "--grid", str(out), "--batch-size", "2", "--tile", "32"]) == 0
    capsys.readouterr()
    assert Image.open(out).size == (2 * 32, 32 + CAPTION)


def test_grid_applies_the_transform_float_and_normalised(colours, tmp_path, monkeypatch, capsys):
    # The transform returns (float CHW in [0, 1] with the channels reversed, label): red draws blue.
    name = write_module(
        tmp_path,
        monkeypatch,
        "def swap(sample):\n    return sample['png'].flip(0).float() / 255, sample['cls']\n"
        "def normalise(sample):\n    return {'image': (sample['png'].float() / 255 - 0.5) / 0.25, 'cls': sample['cls']}\n"
        "def hwc(sample):\n    return {'image': sample['png'].permute(1, 2, 0).numpy(), 'cls': sample['cls']}\n",
    )
    out = tmp_path / "t.png"
    assert main(["show", str(colours), "--grid", str(out), "--batch-size", "6", "--transform", f"{name}:swap"]) == 0
    assert "from '[0]'" in capsys.readouterr().out
    img = Image.open(out)
    assert tile_centre(img, 0, 6) == (0, 0, 255) and tile_centre(img, 3, 6) == (0, 200, 0)
    # Normalised values ((x - mean) / std, red = (2, -2, -2)) are rescaled per tile: red again.
    assert main(["show", str(colours), "--grid", str(out), "--batch-size", "6", "--transform", f"{name}:normalise"]) == 0
    capsys.readouterr()
    assert tile_centre(Image.open(out), 0, 6) == RED
    # HWC arrays (collated into [N, H, W, C]).
    assert main(["show", str(colours), "--grid", str(out), "--batch-size", "6", "--transform", f"{name}:hwc"]) == 0
    capsys.readouterr()
    assert tile_centre(Image.open(out), 0, 6) == RED
    for spec, why in ((f"{name}:nope", "has no 'nope'"), ("no_such_module_here:f", "cannot import"), ("justaname", "expected module:function")):
        assert main(["show", str(colours), "--grid", str(out), "--transform", spec]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err, err


def test_grid_draws_grayscale_and_refuses_a_batch_without_images(tmp_path, capsys):
    samples = [{"__key__": f"g{i}", "npy": np.full((8, 12), 50 * i, np.uint8), "cls": i} for i in range(4)]
    write_dataset(tmp_path / "gray", samples=samples)
    out = tmp_path / "g.png"
    assert main(["show", str(tmp_path / "gray"), "--grid", str(out), "--batch-size", "4"]) == 0
    capsys.readouterr()
    img = Image.open(out)
    assert img.size == (2 * 128, 2 * (128 + CAPTION))
    assert [tile_centre(img, i, 4) for i in range(4)] == [(50 * i,) * 3 for i in range(4)]
    write_dataset(tmp_path / "plain", n=10)
    assert main(["show", str(tmp_path / "plain"), "--grid", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no image field to draw" in err and "txt: list of 10 str" in err, err


def test_tiles_convert_every_layout_and_range():
    chw = np.zeros((3, 4, 5), np.uint8)
    chw[0] = 255
    assert to_pil(chw, True).size == (5, 4) and to_pil(chw, True).getpixel((0, 0)) == RED
    hwc = np.moveaxis(chw, 0, -1).copy()
    assert to_pil(hwc, False).getpixel((0, 0)) == RED
    assert to_pil(np.full((4, 4, 1), 0.5, np.float32), False).getpixel((0, 0)) == (128, 128, 128)  # [0, 1] times 255
    ramp = np.linspace(-3, 5, 16, dtype=np.float32).reshape(4, 4)  # normalised: lowest..highest -> 0..255
    tile = to_pil(ramp, False)
    assert tile.getpixel((0, 0)) == (0, 0, 0) and tile.getpixel((3, 3)) == (255, 255, 255)
    assert to_pil(np.full((4, 4), 1000, np.int32), False).getpixel((0, 0)) == (128, 128, 128)  # flat, out of range
    assert to_pil(np.ones((4, 4), bool), False).getpixel((0, 0)) == (255, 255, 255)
