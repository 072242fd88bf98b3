"""Decode sample fields by extension, under the user's error policy.

Defaults: jpg/jpeg/png/webp/bmp -> uint8 CHW tensor (or PIL image / HWC array on request),
npy -> tensor, json -> object, txt -> str, cls/index -> int, pth -> ``torch.load(weights_only=True)``.
User decoders (by extension) override these; other extensions stay bytes. A multi-part extension
such as ``seg.png`` is decoded by its last part.

Failures go to the user's ErrorPolicy (``policy.py``): raise, or skip and count.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from shardstream.errors import ConfigError, SampleError
from shardstream.policy import ErrorPolicy

logger = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff")
IMAGE_MODES = ("tensor", "numpy", "pil")
Decoders = Mapping[str, Callable[[bytes], Any]]


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def decode_jpeg_array(data: bytes, *, fast: bool = False, min_size: tuple[int, int] | None = None):
    """JPEG bytes -> HWC uint8 RGB array through libjpeg-turbo (simplejpeg); None if it cannot.

    ``min_size`` (width, height): decode at the smallest 1/2, 1/4, 1/8 scale that still covers it.
    """
    import simplejpeg

    options = {}
    if min_size is not None:
        options = {"min_width": min_size[0], "min_height": min_size[1]}
    try:
        return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=fast, fastupsample=fast, **options)
    except ValueError:
        return None  # CMYK, lossless or otherwise unusual: PIL handles those


def decode_image_pil(data: bytes, draft_size: tuple[int, int] | None = None):
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    if draft_size is not None and img.format == "JPEG":
        # Let libjpeg decode at 1/2, 1/4 or 1/8 scale while the result stays >= draft_size.
        img.draft("RGB", draft_size)
    return img.convert("RGB") if img.mode != "RGB" else img


class ImageDecoder:
    """Image bytes -> uint8 CHW tensor ("tensor"), HWC array ("numpy") or RGB PIL image ("pil").

    ``draft_size``: for JPEG, let libjpeg decode at a reduced scale that still covers this
    (width, height); much cheaper when the pipeline crops or resizes down anyway.
    A class rather than a closure so datasets pickle for spawned workers.
    """

    def __init__(self, image: str = "tensor", draft_size: tuple[int, int] | None = None):
        if image not in IMAGE_MODES:
            raise ConfigError(f"image must be one of {IMAGE_MODES}, got {image!r}")
        self.image = image
        self.draft_size = draft_size

    def __call__(self, data: bytes):
        import numpy as np

        array = None
        if self.image != "pil" and is_jpeg(data):
            array = decode_jpeg_array(data, min_size=self.draft_size)
        if array is None:
            img = decode_image_pil(data, self.draft_size)
            if self.image == "pil":
                return img
            array = np.array(img, copy=True)
        if self.image == "numpy":
            return array
        import torch

        return torch.from_numpy(array).permute(2, 0, 1)


def _decode_npy(data: bytes):
    import numpy as np
    import torch

    return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))


def _decode_pth(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _decode_text(data: bytes) -> str:
    return data.decode("utf-8")


def default_decoders(image: str = "tensor", draft_size: tuple[int, int] | None = None) -> dict[str, Callable[[bytes], Any]]:
    image_decoder = ImageDecoder(image, draft_size)
    decoders: dict[str, Callable[[bytes], Any]] = {ext: image_decoder for ext in IMAGE_EXTS}
    decoders.update({"npy": _decode_npy, "pth": _decode_pth, "pt": _decode_pth, "json": json.loads, "jsn": json.loads})
    decoders.update({ext: _decode_text for ext in ("txt", "text", "transcript", "html", "htm", "csv", "xml")})
    decoders.update({ext: int for ext in ("cls", "cls2", "class", "index", "inx", "id", "count")})
    return decoders


class Decoder:
    """Callable that decodes every field of a sample dict by extension."""

    def __init__(self, decoders: Decoders, required: Iterable[str] = ()):
        self.decoders = dict(decoders)
        self.required = tuple(required)
        self._cache: dict[str, Callable[[bytes], Any] | None] = {}
        self._plans: dict[tuple[str, ...], list[tuple[str, Callable[[bytes], Any]]]] = {}

    def _lookup(self, ext: str):
        try:
            return self._cache[ext]
        except KeyError:
            fn = self.decoders.get(ext) or self.decoders.get(ext.rsplit(".", 1)[-1])
            self._cache[ext] = fn
            return fn

    def _plan(self, names: tuple[str, ...]) -> list[tuple[str, Callable[[bytes], Any]]]:
        plan = [(ext, self._lookup(ext)) for ext in names if ext[:2] != "__"]
        return [(ext, fn) for ext, fn in plan if fn is not None]

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        names = tuple(sample)
        try:
            plan = self._plans[names]
        except KeyError:
            plan = self._plans[names] = self._plan(names)
        if self.required:
            for ext in self.required:
                if ext not in sample:
                    raise SampleError(sample.get("__url__", "?"), sample.get("__key__", "?"), f"missing required field {ext!r}")
        for ext, fn in plan:
            try:
                sample[ext] = fn(sample[ext])
            except Exception as exc:  # a decoder may raise anything on corrupt bytes
                raise SampleError(sample.get("__url__", "?"), sample.get("__key__", "?"),
                                  f"cannot decode field {ext!r}: {type(exc).__name__}: {exc}") from exc
        return sample


def decode_samples(chunks: Iterable[list[dict[str, Any]]], decoder: Callable[[dict], dict], policy: ErrorPolicy) -> Iterator[list[dict[str, Any]]]:
    """Decode lists of samples; failures go to ``policy`` (raise, or skip and count)."""
    for chunk in chunks:
        out = []
        for sample in chunk:
            try:
                out.append(decoder(sample))
            except SampleError as exc:
                policy.failed(exc)
                continue
            policy.ok()
        if out:
            yield out
