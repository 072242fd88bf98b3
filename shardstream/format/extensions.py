"""The one table of field extensions: which kind of value each extension holds. Encoding
(``write/encode.py``), the default decoders (``pipeline/decode.py``) and the preview of
``shardstream show`` (``benchmarks/preview.py``) all read it, so they cannot drift apart.

A field's kind is decided by the last part of its extension (``seg.png`` is an image), after a
compression suffix is taken off (``json.gz`` is JSON, gzip-compressed), as webdataset does.
Member naming (which tar members are samples, how names split into key and extension) is
``format/tar.py``'s ``split_name`` and ``is_meta_name``, documented in docs/from-webdataset.md.
"""

from __future__ import annotations

TEXT = ("txt", "text", "transcript", "html", "htm", "csv", "xml")
INT = ("cls", "cls2", "class", "count", "index", "inx", "id")
JSON = ("json", "jsn")
# Image extensions and the PIL format that writes them.
IMAGE_FORMATS = {
    "jpg": "JPEG",
    "jpeg": "JPEG",
    "png": "PNG",
    "webp": "WEBP",
    "bmp": "BMP",
    "gif": "GIF",
    "ppm": "PPM",
    "pgm": "PPM",
    "pbm": "PPM",
    "pnm": "PPM",
    "tif": "TIFF",
    "tiff": "TIFF",
}
IMAGE = tuple(IMAGE_FORMATS)
NPY = ("npy",)
NPZ = ("npz",)
TORCH = ("pth", "pt")
TENBIN = ("ten", "tb")
MSGPACK = ("mp", "msgpack", "msg")
PICKLE = ("pyd", "pickle", "pkl")  # decoded only on request: unpickling runs code from the data
COMPRESSION = {"gz": "gzip"}  # field suffixes decompressed before the inner extension is decoded

KINDS: dict[str, str] = {}
for _kind, _exts in (
    ("text", TEXT),
    ("int", INT),
    ("json", JSON),
    ("image", IMAGE),
    ("npy", NPY),
    ("npz", NPZ),
    ("torch", TORCH),
    ("tenbin", TENBIN),
    ("msgpack", MSGPACK),
    ("pickle", PICKLE),
):
    for _ext in _exts:
        KINDS[_ext] = _kind


def split_compression(ext: str) -> tuple[str, str | None]:
    """``("json", "gzip")`` for ``json.gz``; ``(ext, None)`` for an uncompressed extension."""
    head, dot, last = ext.rpartition(".")
    if dot and last in COMPRESSION:
        return head, COMPRESSION[last]
    return ext, None


def kind_of(ext: str) -> str | None:
    """The kind of value a field holds ("text", "int", "json", "image", "npy", "npz", "torch",
    "tenbin", "msgpack", "pickle"), by the last part of its extension; None when unknown."""
    return KINDS.get(split_compression(ext)[0].rsplit(".", 1)[-1])


def extensions_of(kind: str) -> tuple[str, ...]:
    return tuple(ext for ext, k in KINDS.items() if k == kind)
