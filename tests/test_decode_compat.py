"""Decoders against webdataset's: pixel equality with its pil/rgb8/torchrgb image handlers on
every image kind, the new defaults (npz, gif, pbm, ten, msgpack, pickle on request, .gz
fields, big-endian and string .npy), and the ``webdataset_decoders`` preset giving webdataset's
types exactly, through real shards read by both loaders."""

from __future__ import annotations

import gzip
import io
import json
import pickle

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from webdataset.autodecode import ImageHandler

from shardstream import ShardStream
from shardstream.format.extensions import IMAGE, kind_of
from shardstream.pipeline.decode import Decoder, ImageDecoder, default_decoders, keep_bytes, webdataset_decoders
from shardstream.plan.topology import World
from shardstream.write.encode import encode_value


def _image(mode: str, size=(37, 23)) -> Image.Image:
    rng = np.random.default_rng(sum(map(ord, mode)))
    w, h = size
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65535, (h, w), dtype=np.uint16))
    gray = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8))
    rgb = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    made = {
        "RGB": lambda: rgb,
        "RGBA": lambda: Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8)),
        "L": lambda: gray,
        "LA": lambda: Image.merge("LA", (gray, gray.transpose(Image.Transpose.FLIP_LEFT_RIGHT))),
        "P": lambda: rgb.quantize(64),
        "1": lambda: gray.convert("1"),
        "CMYK": lambda: Image.frombytes("CMYK", size, rng.integers(0, 256, w * h * 4, dtype=np.uint8).tobytes()),
    }
    return made[mode]()


def _save(img: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **options)
    return buf.getvalue()


IMAGES = {
    "png-rgba": lambda: _save(_image("RGBA"), "PNG"),
    "png-la": lambda: _save(_image("LA"), "PNG"),
    "png-palette": lambda: _save(_image("P"), "PNG"),
    "png-16bit": lambda: _save(_image("I;16"), "PNG"),
    "jpeg-rgb": lambda: _save(_image("RGB"), "JPEG", quality=90),
    "jpeg-cmyk": lambda: _save(_image("CMYK"), "JPEG", quality=90),
    "jpeg-progressive": lambda: _save(_image("RGB"), "JPEG", quality=85, progressive=True),
    "jpeg-gray": lambda: _save(_image("L"), "JPEG"),
    "webp": lambda: _save(_image("RGB"), "WEBP", lossless=True),
    "tiff": lambda: _save(_image("RGB"), "TIFF"),
    "bmp": lambda: _save(_image("RGB"), "BMP"),
    "ppm": lambda: _save(_image("RGB"), "PPM"),
    "pgm": lambda: _save(_image("L"), "PPM"),
    "pbm": lambda: _save(_image("1"), "PPM"),
    "gif": lambda: _save(_image("P"), "GIF"),
}


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_image_pixels_equal_webdatasets_pil_rgb8_and_torchrgb(kind):
    data = IMAGES[kind]()
    rgb8 = ImageHandler("rgb8")("x.png", data)
    assert np.array_equal(ImageDecoder("numpy")(data), rgb8)
    assert np.array_equal(np.asarray(ImageDecoder("pil")(data)), np.asarray(ImageHandler("pil")("x.png", data)))
    ours = ImageDecoder("tensor")(data)
    assert ours.dtype == torch.uint8 and ours.shape == (3, *rgb8.shape[:2])
    assert torch.equal(ours.float() / 255.0, ImageHandler("torchrgb")("x.png", data))


def test_cmyk_jpeg_equals_pils_conversion_not_libjpeg_turbos():
    data = IMAGES["jpeg-cmyk"]()
    reference = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(ImageDecoder("numpy")(data), reference)


def test_every_image_extension_has_a_default_decoder_and_encodes():
    decoders = default_decoders()
    for ext in IMAGE:
        assert kind_of(ext) == "image" and ext in decoders
    assert encode_value("gif", _image("P"))[:3] == b"GIF"
    assert encode_value("bmp", np.zeros((2, 2, 3), np.uint8))[:2] == b"BM"


def test_new_default_decoders():
    decode = Decoder(default_decoders())
    be = np.arange(6, dtype=">i4").reshape(2, 3)
    strings = np.array(["a", "bc"])
    npz = io.BytesIO()
    np.savez(npz, a=np.arange(3, dtype=np.float32), b=np.array(["x"]))
    from webdataset import tenbin

    msgpack = pytest.importorskip("msgpack")
    sample = {
        "__key__": "k",
        "__url__": "u",
        "be.npy": encode_value("npy", be),
        "str.npy": encode_value("npy", strings),
        "npz": npz.getvalue(),
        "ten": tenbin.encode_buffer([np.arange(4, dtype=np.int16)]),
        "mp": msgpack.packb({"a": [1, 2]}),
        "json.gz": gzip.compress(b'{"x": 1}'),
        "txt.gz": encode_value("txt.gz", "hello"),
        "bin.gz": gzip.compress(b"raw"),
        "pyd": pickle.dumps({"p": 1}),
    }
    out = decode(dict(sample))
    assert out["be.npy"].dtype == torch.int32 and torch.equal(out["be.npy"], torch.arange(6, dtype=torch.int32).reshape(2, 3))
    assert isinstance(out["str.npy"], np.ndarray) and out["str.npy"].tolist() == ["a", "bc"]
    assert torch.equal(out["npz"]["a"], torch.arange(3, dtype=torch.float32)) and out["npz"]["b"].tolist() == ["x"]
    assert torch.equal(out["ten"][0], torch.arange(4, dtype=torch.int16))
    assert out["mp"] == {"a": [1, 2]}
    assert out["json.gz"] == {"x": 1} and out["txt.gz"] == "hello" and out["bin.gz"] == b"raw"
    assert out["pyd"] == sample["pyd"]  # pickles stay bytes unless the user opts in: unpickling runs code
    assert Decoder(default_decoders(allow_pickle=True))(dict(sample))["pyd"] == {"p": 1}


def _tree_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_tree_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_tree_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Image.Image):
        return isinstance(b, Image.Image) and a.mode == b.mode and np.array_equal(np.asarray(a), np.asarray(b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("spec", ["pil", "rgb8", "torchrgb"])
def test_webdataset_preset_gives_webdatasets_samples_exactly(tmp_path, spec):
    path = tmp_path / "mixed.tar"
    with wds.TarWriter(str(path)) as w:
        for i, (kind, make) in enumerate(sorted(IMAGES.items())):
            ext = {"jpeg": "jpg", "png": "png", "webp": "webp", "tiff": "tiff"}.get(kind.split("-")[0], kind)
            w.write(
                {
                    "__key__": f"s{i:03d}",
                    ext: make(),
                    "cls": str(i).encode(),
                    "json": json.dumps({"i": i}).encode(),
                    "npy": encode_value("npy", np.arange(i + 1, dtype=">f8")),
                    "txt.gz": b"t",  # TarWriter gzips .gz fields itself
                    "pth": encode_value("pth", torch.arange(3)),
                    "html": b"<p>",
                    "count": b"3",
                    "xml.gz": b"<x/>",
                }
            )
    expected = list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False).decode(spec))
    stream = ShardStream.from_urls(
        str(path), batch_size=1, shuffle=False, decode=webdataset_decoders(spec), world=World(0, 1), collate=lambda samples: samples
    )
    got = [s for batch in stream for s in batch]
    assert len(got) == len(expected) == len(IMAGES)
    for ours, theirs in zip(got, expected):
        assert _tree_equal({k: v for k, v in ours.items() if not k.startswith("__")}, {k: v for k, v in theirs.items() if not k.startswith("__")}), (
            ours["__key__"]
        )


def test_decode_false_hands_over_every_field_as_stored_like_webdataset(tmp_path):
    """Raw is raw: decode=False gives webdataset's undecoded samples byte for byte, .gz fields
    still compressed; gunzipping is decoding (the defaults, or a decoder for the inner extension)."""
    path = tmp_path / "raw.tar"
    with wds.TarWriter(str(path)) as w:
        for i in range(5):  # TarWriter gzips .gz fields itself: the tar holds compressed bytes
            w.write({"__key__": f"s{i}", "json.gz": json.dumps({"i": i}).encode(), "txt.gz": b"t" * i, "cls": str(i).encode()})
    theirs = list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))
    stream = ShardStream.from_urls(str(path), batch_size=1, shuffle=False, decode=False, world=World(0, 1), collate=lambda samples: samples)
    ours = [s for batch in stream for s in batch]
    assert len(ours) == len(theirs) == 5
    for a, b in zip(ours, theirs):
        fields = {k: v for k, v in a.items() if not k.startswith("__")}
        assert fields == {k: v for k, v in b.items() if not k.startswith("__")}
        assert fields["json.gz"][:2] == b"\x1f\x8b"  # still gzip
    stored = theirs[1]["json.gz"]
    assert Decoder({})({"json.gz": stored})["json.gz"] == stored
    assert Decoder(default_decoders())({"json.gz": stored})["json.gz"] == {"i": 1}
    assert Decoder({"json": json.loads})({"json.gz": stored})["json.gz"] == {"i": 1}  # a decoder asked for json
    assert Decoder({**default_decoders(), "gz": keep_bytes})({"json.gz": stored})["json.gz"] == stored
