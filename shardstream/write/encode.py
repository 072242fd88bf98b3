"""Turn a sample's field values into bytes by extension, following the WebDataset conventions.

bytes as is; str for text extensions; int for cls/index; dict/list for json; numpy arrays for
npy; tensors for pth; PIL images or uint8 arrays for jpg/png/webp. Unknown extensions take bytes
or str only, so nothing is encoded by guess.
"""

from __future__ import annotations

import io
import json
from typing import Any

from shardstream.errors import SourceError
from shardstream.format.extensions import IMAGE_FORMATS, kind_of, split_compression

# The extension table lives in format/extensions.py (shared with the decoders and the preview).


def encode_value(ext: str, value: Any) -> bytes:
    """Encode one field; raises TypeError naming the extension when the value does not fit.

    A compressed extension (``json.gz``) encodes the value by its inner extension, then gzips
    it (mtime 0: the same input packs to the same bytes); bytes are stored as given."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    inner, compression = split_compression(ext)
    if compression == "gzip":
        import gzip

        return gzip.compress(encode_value(inner, value), mtime=0)
    kind = kind_of(ext)
    if isinstance(value, str):
        return value.encode("utf-8")
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode("ascii")
    if kind == "json":
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")
    if kind == "npy":
        import numpy as np

        buf = io.BytesIO()
        np.save(buf, np.asarray(value), allow_pickle=False)
        return buf.getvalue()
    if kind == "torch":
        import torch

        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue()
    if kind == "image":
        return _encode_image(value, IMAGE_FORMATS[inner.rsplit(".", 1)[-1]])
    raise TypeError(f"cannot encode {type(value).__name__} as .{ext}: give bytes or str for this extension")


def _encode_image(value: Any, fmt: str) -> bytes:
    import numpy as np
    from PIL import Image

    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8:
            raise TypeError(f"image arrays must be uint8, got {value.dtype}")
        value = Image.fromarray(value)
    if not isinstance(value, Image.Image):
        raise TypeError(f"cannot encode {type(value).__name__} as an image")
    buf = io.BytesIO()
    options = {"quality": 90} if fmt == "JPEG" else {}
    value.save(buf, format=fmt, **options)
    return buf.getvalue()


def encode_sample(sample: dict[str, Any], where: str = "sample") -> tuple[str, dict[str, bytes]]:
    """Validate a sample dict and return ``(key, {ext: bytes})``; metadata fields (``_x``) are dropped."""
    if not isinstance(sample, dict):
        raise SourceError(where, f"a sample must be a dict, got {type(sample).__name__}")
    key = sample.get("__key__")
    if not isinstance(key, str) or not key:
        raise SourceError(where, "sample has no '__key__' string")
    check_key(key, where)
    fields: dict[str, bytes] = {}
    for ext, value in sample.items():
        if ext.startswith("_"):
            continue
        if not ext or "/" in ext or ext != ext.lower():
            raise SourceError(where, f"field name {ext!r} must be a lower-case extension without '/'")
        try:
            fields[ext] = encode_value(ext, value)
        except (TypeError, ValueError, OSError) as exc:
            raise SourceError(f"{where} (key {key!r}, field {ext!r})", str(exc)) from exc
    if not fields:
        raise SourceError(where, f"sample {key!r} has no fields")
    return key, fields


def check_key(key: str, where: str) -> None:
    """Keys must round-trip through webdataset's name split: no dot in the last component."""
    last = key.rsplit("/", 1)[-1]
    if not last or "." in last or key.startswith("/") or ".." in key.split("/") or "\0" in key:
        raise SourceError(where, f"key {key!r} is not usable: the last path component must be non-empty and contain no '.'")
