"""examples/train_ddp.py run as a user runs it (one gloo rank, 2 DataLoader workers, a real
checkpoint and restart): it prints the worker count it runs with, and one resume summary of the
kind it makes (exact with the same topology, elastic with another)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import free_port, scaled, write_image_folder

from shardstream.write.pack import pack

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"


def _train(data: Path | None, checkpoint: Path, workers: int, *more: str) -> str:
    env = dict(
        os.environ,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        GLOO_SOCKET_IFNAME="lo",
        CUDA_VISIBLE_DEVICES="",
    )
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            *([str(data)] if data else []),
            "--epochs",
            "1",
            "--batch-size",
            "4",
            "--workers",
            str(workers),
            "--checkpoint",
            str(checkpoint),
            "--checkpoint-every",
            "4",
            *more,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(300),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_train_ddp_prints_its_worker_count_and_one_summary_of_its_resume(tmp_path):
    write_image_folder(tmp_path / "images", classes=3, per_class=8, with_json=False)
    pack(str(tmp_path / "images"), str(tmp_path / "ds"), label_from_dir=True, max_count=6)  # 24 samples: 6 batches of 4
    checkpoint = tmp_path / "ckpt"

    first = _train(tmp_path / "ds", checkpoint, workers=2)  # saves after 4 of 6 batches
    assert "2 workers per rank" in first and "1 workers per rank" not in first
    assert "resum" not in first and "[rank 0] epoch 0: 6 batches" in first

    exact = _train(tmp_path / "ds", checkpoint, workers=2)  # the same topology: an exact resume
    assert "2 workers per rank" in exact and "1 workers per rank" not in exact
    assert exact.count("resuming epoch 0") == 1 and "resuming epoch 0 exactly after 4 of 6 batches" in exact
    assert "elastically" not in exact and "[rank 0] epoch 0: 2 batches" in exact

    elastic = _train(tmp_path / "ds", checkpoint, workers=1)  # another worker count: elastic
    assert "1 workers per rank" in elastic and "2 workers per rank" not in elastic
    assert elastic.count("resuming epoch 0") == 1 and "resuming epoch 0 elastically" in elastic and "exactly" not in elastic


def test_train_ddp_runs_a_mix_by_steps_and_resumes_it(tmp_path):
    """``--mix FILE --steps N --checkpoint DIR``: a weighted mix, 7 steps per epoch, a checkpoint every
    4 steps (the last after step 12: epoch 1, step 5); the restart resumes epoch 1 exactly and yields
    its remaining 2 steps (7 - 5). Read in the main process (elastic restarts on another world size,
    with workers: test_mix_ddp.py)."""
    for name, classes in (("a", 3), ("b", 2)):
        write_image_folder(tmp_path / name, classes=classes, per_class=6, size=8, with_json=False)
        pack(str(tmp_path / name), str(tmp_path / f"ds-{name}"), label_from_dir=True, max_count=5)
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"url": "ds-a", "weight": 0.6, "name": "a"}, {"url": "ds-b", "weight": 0.4, "name": "b"}]}))
    checkpoint = tmp_path / "ckpt"
    first = _train(None, checkpoint, 0, "--mix", str(mix), "--steps", "7", "--epochs", "2")
    assert "mix of 2 sources" in first and "[rank 0] epoch 0: 7 batches" in first and "[rank 0] epoch 1: 7 batches" in first
    state = json.loads(torch.load(checkpoint / "checkpoint.pt", weights_only=True)["loader"])
    assert state["run"] == {"steps": 7} and state["loader_epoch"] == 1 and state["segments"][-1]["batches"] == 5
    again = _train(None, checkpoint, 0, "--mix", str(mix), "--steps", "7", "--epochs", "2")
    assert again.count("resuming epoch") == 1 and "resuming epoch 1 exactly after" in again and "[rank 0] epoch 1: 2 batches" in again
    assert "epoch 0:" not in again.replace("data epoch", "")


MARK_TRANSFORM = """
import os

import shardstream


def only_b(sample):
    # named by the mix file for source b: it must see b's samples only, in every worker
    assert sample["__source__"] == "b", sample["__source__"]
    open(os.path.join(os.environ["MIX_MARKS"], str(shardstream.get_worker_info().id)), "a").write(sample["__key__"] + "\\n")
    return sample
"""


def test_train_ddp_trains_a_mix_of_unlike_sets_with_a_per_source_transform(tmp_path, monkeypatch):
    """``--mix`` over a .jpg image set, a .png caption set (with json and txt) and a third set whose
    mix entry names ``transform: module:function``: images read as one field whatever their
    format, the caption set's extra fields batched as the union, the transform run in 2 workers
    (each marking its own file) on its own source's samples only."""
    write_image_folder(tmp_path / "a", classes=3, per_class=6, size=8, fmt="jpg", with_json=False)
    write_image_folder(tmp_path / "c", classes=2, per_class=5, size=8, fmt="png", seed=1)
    for i, path in enumerate(sorted((tmp_path / "c").rglob("*.png"))):
        path.with_suffix(".txt").write_text(f"caption {i}")
    write_image_folder(tmp_path / "b", classes=2, per_class=4, size=8, fmt="jpg", seed=2, with_json=False)
    for name in "abc":
        pack(str(tmp_path / name), str(tmp_path / f"ds-{name}"), label_from_dir=True, max_count=5)
    (tmp_path / "mixfns").mkdir()
    (tmp_path / "mixfns" / "mixfns.py").write_text(MARK_TRANSFORM)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "mixfns"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MIX_MARKS", str(marks))
    mix = tmp_path / "mix.json"
    sources = [{"url": "ds-a", "name": "a"}, {"url": "ds-b", "name": "b", "transform": "mixfns:only_b"}, {"url": "ds-c", "name": "c"}]
    mix.write_text(json.dumps({"sources": sources}))
    out = _train(None, tmp_path / "ckpt", 2, "--mix", str(mix))
    assert "mix of 3 sources" in out and "[rank 0] epoch 0: 9 batches, 36 samples" in out  # 18 + 8 + 10 samples, each once
    seen = [key for f in marks.iterdir() for key in f.read_text().split()]
    assert len(list(marks.iterdir())) == 2 and sorted(seen) == sorted(f"class_{c}/{i:04d}" for c in range(2) for i in range(4))


def test_train_ddp_runs_120_short_epochs_on_2_ranks_with_new_workers_every_epoch(tmp_path):
    """The demo's command, run for 120 epochs: 2 gloo ranks under torchrun, 1 DataLoader worker
    each, started anew every epoch, beside gloo's native threads. Forking there once hung the demo
    (CPython gh-112275); every epoch boundary is a chance, so this finishes every time or fails
    (the loader's watchdog, then this test's bound) with every rank's stack."""
    write_image_folder(tmp_path / "images", classes=2, per_class=8, size=8, with_json=False)
    pack(str(tmp_path / "images"), str(tmp_path / "ds"), label_from_dir=True, max_count=4)  # 16 samples, 4 shards
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [
            str(torchrun),
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(EXAMPLE),
            str(tmp_path / "ds"),
            "--epochs",
            "120",
            "--batch-size",
            "4",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(280),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] epoch 119: 2 batches" in done.stdout, done.stdout[-2000:]


def test_train_ddp_trains_on_an_image_folder_of_mixed_sizes_and_formats_with_its_defaults(tmp_path):
    """A real ImageFolder: .jpg and .png files of unlike sizes and modes (RGB, grayscale, RGBA),
    packed as they are. The example's defaults (one ``image`` field for jpg/png/webp, resized and
    centre-cropped to 64x64) train on it; on main the batch was a list (``'list' object has no
    attribute 'float'``)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(40, 30), (17, 90), (64, 64), (120, 33), (31, 31), (75, 50)]
    for c in range(2):
        folder = tmp_path / "images" / f"class_{c}"
        folder.mkdir(parents=True)
        for i in range(8):
            w, h = sizes[(i + c) % len(sizes)]
            mode = ("RGB", "L", "RGBA")[i % 3]
            channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
            pixels = rng.integers(0, 255, (h, w, channels), dtype=np.uint8)
            img = Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)
            if i % 2:
                img.save(folder / f"{i:04d}.png")
            else:
                img.convert("RGB" if mode == "RGBA" else mode).save(folder / f"{i:04d}.jpg", quality=90)
    pack(str(tmp_path / "images"), str(tmp_path / "ds"), label_from_dir=True, max_count=5)
    out = _train(tmp_path / "ds", tmp_path / "ckpt", 2)
    assert "[rank 0] epoch 0: 4 batches, 16 samples" in out, out


def test_decode_size_gives_one_shape_for_every_image_and_format():
    """``Decode(size=...)`` through the dataset's decoders: jpg (simplejpeg's path) and png (PIL's)
    of unlike sizes all come out uint8 [3, h, w], the centre of the image kept."""
    import io

    import numpy as np
    from PIL import Image

    from shardstream.options import Decode
    from shardstream.pipeline.decode import ImageDecoder

    decode = ImageDecoder("tensor", size=Decode(size=(32, 24)).size)
    for fmt, (w, h) in [("JPEG", (300, 100)), ("PNG", (10, 50)), ("PNG", (32, 24)), ("JPEG", (64, 48))]:
        pixels = np.zeros((h, w, 3), dtype=np.uint8)
        pixels[h // 4 : h - h // 4, w // 4 : w - w // 4] = 200  # a bright centre
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, fmt)
        out = decode(buf.getvalue())
        assert out.dtype == torch.uint8 and tuple(out.shape) == (3, 24, 32), (fmt, w, h)
        assert int(out[:, 12, 16].min()) > 150  # the centre survives the crop
    assert ImageDecoder("pil", size=(8, 8))(buf.getvalue()).size == (8, 8)
    assert Decode(size=7).size == (7, 7)
    import pytest

    from shardstream.errors import ConfigError

    for bad in (0, (3,), "224", (2, -1), True):
        with pytest.raises(ConfigError):
            Decode(size=bad)
