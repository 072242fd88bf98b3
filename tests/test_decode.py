"""Image decoding paths: libjpeg-turbo for JPEG, PIL for the rest and for unusual JPEGs, and the
decode-time RandomResizedCrop."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from shardstream import RandomResizedCrop
from shardstream.pipeline.decode import ImageDecoder


def jpeg_bytes(width=320, height=240, mode="RGB", quality=95) -> bytes:
    yy, xx = np.mgrid[0:height, 0:width]
    arr = np.stack([xx * 255 // width, yy * 255 // height, (xx + yy) * 255 // (width + height)], -1).astype(np.uint8)
    img = Image.fromarray(arr)
    if mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def test_jpeg_decoder_matches_pil_closely():
    data = jpeg_bytes()
    ours = ImageDecoder("tensor")(data)
    reference = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()).permute(2, 0, 1)
    assert ours.shape == (3, 240, 320) and ours.dtype == torch.uint8
    assert (ours.int() - reference.int()).abs().float().mean() < 1.0


def test_cmyk_jpeg_and_png_fall_back_to_pil():
    cmyk = jpeg_bytes(mode="CMYK")
    assert ImageDecoder("numpy")(cmyk).shape == (240, 320, 3)
    buf = io.BytesIO()
    Image.fromarray(np.zeros((5, 7, 3), np.uint8)).save(buf, format="PNG")
    assert ImageDecoder("tensor")(buf.getvalue()).shape == (3, 5, 7)


def test_draft_size_decodes_at_reduced_scale():
    out = ImageDecoder("numpy", draft_size=(80, 60))(jpeg_bytes(320, 240))
    assert out.shape == (60, 80, 3)


def test_random_resized_crop_shape_and_reproducibility():
    data = jpeg_bytes(640, 480)
    crop = RandomResizedCrop(96, seed=1)
    crop.bind(epoch=0, rank=0, worker=0)
    first = [crop(data) for _ in range(4)]
    assert all(t.shape == (3, 96, 96) and t.dtype == torch.uint8 for t in first)
    crop.bind(epoch=0, rank=0, worker=0)
    assert all(torch.equal(a, b) for a, b in zip(first, [crop(data) for _ in range(4)]))
    crop.bind(epoch=1, rank=0, worker=0)
    assert not all(torch.equal(a, b) for a, b in zip(first, [crop(data) for _ in range(4)]))


def test_reduced_decode_matches_full_decode_of_the_same_crop():
    data = jpeg_bytes(1280, 960, quality=98)
    reduced = RandomResizedCrop(64, scale=(0.9, 1.0), seed=3, fast=False)
    full = RandomResizedCrop(64, scale=(0.9, 1.0), seed=3, fast=False, reduced_decode=False)
    for c in (reduced, full):
        c.bind(0, 0, 0)
    a, b = reduced(data), full(data)
    assert (a.int() - b.int()).abs().float().mean() < 4.0  # same crop, smooth image: nearly equal pixels


def test_random_resized_crop_on_png_uses_pil():
    buf = io.BytesIO()
    Image.fromarray(np.full((50, 60, 3), 200, np.uint8)).save(buf, format="PNG")
    out = RandomResizedCrop(32)(buf.getvalue())
    assert out.shape == (3, 32, 32) and int(out.float().mean()) == 200


def test_truncated_jpeg_raises():
    with pytest.raises(OSError, match="(?i)truncated|broken"):
        ImageDecoder("tensor")(jpeg_bytes()[:200])
