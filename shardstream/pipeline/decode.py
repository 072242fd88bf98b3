"""Decode sample fields by extension, under the user's error policy.

Defaults (extensions from ``format/extensions.py``): images (jpg, png, webp, bmp, gif, ppm/pgm/pbm,
tiff) -> uint8 CHW RGB tensor (or PIL image / HWC array on request), npy -> tensor (numpy array
for strings and other dtypes torch lacks), npz -> {name: tensor}, json -> object, txt -> str,
cls/index -> int, pth -> ``torch.load(weights_only=True)``, ten -> [tensor], mp/msgpack ->
object when ``msgpack`` is installed; pyd/pickle only with ``allow_pickle=True`` (it runs code
from the data). A ``.gz`` field is gunzipped (the default decoder ``"gz": gunzip``), then decoded
by its inner extension (``json.gz``). User decoders (by extension) override these; other
extensions stay bytes. Without the defaults (``decode=False``) every field stays as stored,
``.gz`` ones too, as webdataset hands them over undecoded; a ``.gz`` field whose inner extension
has a user decoder is still gunzipped for it; ``{"gz": keep_bytes}`` keeps ``.gz`` fields as
stored. A multi-part extension such as ``seg.png`` is decoded by its last part.
``webdataset_decoders(spec)`` gives webdataset's own types (``.decode(spec)``) for users who want
identical samples.

Alternatives (``alias``, as webdataset's ``rename(image="jpg;png")``): ``{"image": ("jpg", "png",
"webp")}`` moves the first of those fields a sample has, once decoded, to ``image`` and drops the
others it has, so an ImageFolder of .jpg and .png files gives one field. The renames are planned
once per field set (as the decoders are); without an alias nothing is looked at.

Failures go to the user's ErrorPolicy (``policy.py``): raise, or skip and count.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from shardstream.errors import ConfigError, SampleError
from shardstream.format.extensions import COMPRESSION, IMAGE, INT, JSON, MSGPACK, NPY, NPZ, PICKLE, TENBIN, TEXT, TORCH, split_compression
from shardstream.policy import ErrorPolicy

logger = logging.getLogger(__name__)

IMAGE_EXTS = IMAGE
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
        if simplejpeg.decode_jpeg_header(data)[2] in ("CMYK", "YCCK"):
            return None  # libjpeg-turbo's CMYK->RGB differs from PIL's by one level: PIL decides
        return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=fast, fastupsample=fast, **options)
    except ValueError:
        return None  # lossless or otherwise unusual: PIL handles those


def decode_image_pil(data: bytes, draft_size: tuple[int, int] | None = None):
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    if draft_size is not None and img.format == "JPEG":
        # Let libjpeg decode at 1/2, 1/4 or 1/8 scale while the result stays >= draft_size.
        img.draft("RGB", draft_size)
    return img.convert("RGB") if img.mode != "RGB" else img


def image_size(size: int | Sequence[int] | None) -> tuple[int, int] | None:
    """``size`` as (width, height): an int is a square; None stays None. A ConfigError otherwise."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, (int, Sequence)) or isinstance(size, str):
        raise ConfigError(f"an image size is an int or (width, height), got {size!r}")
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair):
        raise ConfigError(f"an image size is a positive int or (width, height) of positive ints, got {size!r}")
    return (int(pair[0]), int(pair[1]))


def resize_center_crop(img, size: tuple[int, int]):
    """A PIL image scaled (aspect kept, bilinear) to just cover ``size`` (width, height), then
    cropped to it around the centre: every image comes out exactly ``size``."""
    from PIL import Image

    width, height = size
    if img.size == (width, height):
        return img
    scale = max(width / img.width, height / img.height)
    scaled = (max(width, round(img.width * scale)), max(height, round(img.height * scale)))
    img = img.resize(scaled, Image.Resampling.BILINEAR)
    left, top = (scaled[0] - width) // 2, (scaled[1] - height) // 2
    return img.crop((left, top, left + width, top + height))


class ImageDecoder:
    """Image bytes -> uint8 CHW tensor ("tensor"), HWC array ("numpy") or RGB PIL image ("pil").

    ``draft_size``: for JPEG, let libjpeg decode at a reduced scale that still covers this
    (width, height); much cheaper when the pipeline crops or resizes down anyway.
    ``size``: (width, height); every image is scaled to cover it (aspect kept) and centre-cropped
    to it, so images of any size batch into one tensor (JPEGs are then drafted at ``size`` too,
    unless ``draft_size`` says otherwise). A class rather than a closure so datasets pickle for
    spawned workers.
    """

    def __init__(self, image: str = "tensor", draft_size: tuple[int, int] | None = None, size: int | Sequence[int] | None = None):
        if image not in IMAGE_MODES:
            raise ConfigError(f"image must be one of {IMAGE_MODES}, got {image!r}")
        self.image = image
        self.size = image_size(size)
        self.draft_size = draft_size if draft_size is not None else self.size

    def __call__(self, data: bytes):
        import numpy as np

        array = None
        if self.image != "pil" and is_jpeg(data):
            array = decode_jpeg_array(data, min_size=self.draft_size)
        if array is not None and self.size is not None and (array.shape[1], array.shape[0]) != self.size:
            from PIL import Image

            array = np.array(resize_center_crop(Image.fromarray(array), self.size))
        if array is None:
            img = decode_image_pil(data, self.draft_size)
            if self.size is not None:
                img = resize_center_crop(img, self.size)
            if self.image == "pil":
                return img
            array = np.array(img, copy=True)
        if self.image == "numpy":
            return array
        import torch

        return torch.from_numpy(array).permute(2, 0, 1)


def _decode_npy(data: bytes):
    return _as_tensor(load_npy(data))


def _as_tensor(array):
    """A tensor for numeric arrays (big-endian ones converted to native order first); arrays of
    strings, datetimes and other dtypes torch has no type for stay numpy arrays."""
    import torch

    if array.dtype.kind not in "biufc":
        return array
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(array)


def _decode_npz(data: bytes) -> dict[str, Any]:
    import numpy as np

    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {name: _as_tensor(archive[name]) for name in archive.files}


def _decode_tenbin(data: bytes) -> list[Any]:
    from webdataset import tenbin  # webdataset's tensor container format, read by its own reader

    if not isinstance(data, bytes):  # a large member's own buffer: the arrays view it in place
        return [_as_tensor(a) for a in tenbin.decode_buffer(memoryview(data))]
    return [_as_tensor(a) for a in tenbin.decode_buffer(data)]


# Decoders that view a writable buffer in place rather than copying it: the tar parser hands
# them a large member's own buffer (a writable ``memoryview``) (``Decoder.viewing_exts``); every other decoder, and
# every undecoded field, gets ``bytes``.
VIEWING_DECODERS = frozenset({_decode_npy, _decode_tenbin})


def _decode_msgpack(data: bytes):
    import msgpack

    return msgpack.unpackb(data)


def _decode_pickle(data: bytes):
    import pickle

    return pickle.loads(data)  # only reached when the user passed allow_pickle=True


def load_npy(data: bytes):
    """``.npy`` bytes -> numpy array: the same values, dtype, shape and strides as ``np.load``,
    with at most one copy.

    ``np.load`` over a ``BytesIO`` copies the data twice (out of the stream, into a new array)
    and parses the header with ``ast`` every time. Here the header is parsed once per distinct
    header (cached) and the data is taken at the header's offset with ``np.frombuffer``.

    Ownership: the result is always writable and private to the caller. A writable buffer
    (a bytearray, or a writable memoryview of a read block that gives each member its own region
    and is never reused) is viewed in place: no copy. An immutable ``bytes`` is copied once,
    because a view of it could be shared: the same ``bytes`` object decoded twice (or kept by
    the caller) would otherwise see one sample's in-place change in another.
    """
    import numpy as np

    header = _npy_header(data)
    if header is None:  # a format version this fast path does not know: numpy's own reader
        return np.load(io.BytesIO(data), allow_pickle=False)
    offset, shape, fortran_order, dtype, count = header
    size = memoryview(data).nbytes - offset
    if size < count * dtype.itemsize:
        raise ValueError(f"EOF: .npy data holds {size} bytes, its header needs {count * dtype.itemsize}")
    array = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    if not array.flags.writeable:
        array = array.copy()  # one copy, into numpy's allocator (huge pages for large arrays)
    return array.reshape(shape[::-1]).transpose() if fortran_order else array.reshape(shape)


_NPY_HEADERS: dict[bytes, tuple] = {}
_NPY_HEADERS_MAX = 1024


def _npy_header(data: bytes):
    """(data offset, shape, fortran_order, dtype, count) of a version 1 or 2 ``.npy``; None for
    other versions. Parsed headers are cached by their bytes: a dataset has few distinct ones."""
    prefix = bytes(data[:12])
    if len(prefix) < 10 or prefix[:6] != b"\x93NUMPY":
        raise ValueError("not a .npy file (no magic string)")
    version = (prefix[6], prefix[7])
    if version == (1, 0):
        offset = 10 + int.from_bytes(prefix[8:10], "little")
    elif version == (2, 0) and len(prefix) == 12:
        offset = 12 + int.from_bytes(prefix[8:12], "little")
    else:
        return None
    raw = bytes(data[:offset])
    try:
        return _NPY_HEADERS[raw]
    except KeyError:
        pass
    import numpy as np
    from numpy.lib import format as npy_format

    stream = io.BytesIO(raw)
    npy_format.read_magic(stream)
    read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
    shape, fortran_order, dtype = read_header(stream)
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise ValueError("Object arrays cannot be loaded when allow_pickle=False")
    count = 1
    for n in shape:
        count *= n
    header = (offset, shape, fortran_order, dtype, count)
    if len(_NPY_HEADERS) < _NPY_HEADERS_MAX:
        _NPY_HEADERS[raw] = header
    return header


def _decode_pth(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _decode_text(data: bytes) -> str:
    return data.decode("utf-8")


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def default_decoders(
    image: str = "tensor",
    draft_size: tuple[int, int] | None = None,
    *,
    allow_pickle: bool = False,
    size: int | Sequence[int] | None = None,
) -> dict[str, Callable[[bytes], Any]]:
    """shardstream's decoders by extension (see the module docstring). ``allow_pickle`` adds
    pyd/pickle/pkl: only for data you trust, unpickling runs code. ``size``: images resized and
    centre-cropped to (width, height) (``ImageDecoder``)."""
    image_decoder = ImageDecoder(image, draft_size, size)
    decoders: dict[str, Callable[[bytes], Any]] = {ext: image_decoder for ext in IMAGE}
    decoders.update({ext: _decode_npy for ext in NPY})
    decoders.update({ext: _decode_npz for ext in NPZ})
    decoders.update({ext: _decode_pth for ext in TORCH})
    decoders.update({ext: json.loads for ext in JSON})
    decoders.update({ext: _decode_text for ext in TEXT})
    decoders.update({ext: int for ext in INT})
    decoders.update({ext: _decode_tenbin for ext in TENBIN})
    if _has_module("msgpack"):
        decoders.update({ext: _decode_msgpack for ext in MSGPACK})
    if allow_pickle:
        decoders.update({ext: _decode_pickle for ext in PICKLE})
    decoders.update({ext: gunzip for ext in COMPRESSION if COMPRESSION[ext] == "gzip"})
    return decoders


class WebDatasetImage:
    """An image decoded by webdataset's own handler for ``spec`` ("pil", "rgb8", "torchrgb", ...)."""

    def __init__(self, spec: str):
        from webdataset.autodecode import imagespecs

        if spec not in imagespecs:
            raise ConfigError(f"unknown webdataset image spec {spec!r}; one of {sorted(imagespecs)}")
        self.spec = spec
        self._handler: Any = None

    def __call__(self, data: bytes):
        if self._handler is None:
            from webdataset.autodecode import ImageHandler

            self._handler = ImageHandler(self.spec)
        return self._handler("x.png", data)  # the handler checks the extension only; the bytes decide the format

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "_handler": None}


def webdataset_decoders(image: str | None = "pil") -> dict[str, Callable[[bytes], Any]]:
    """Decoders that give exactly what ``webdataset.WebDataset(...).decode(image)`` gives: its
    basic handlers (txt -> str, cls -> int, json, npy/npz -> numpy, pth, ten, mp, pickle as in
    webdataset), ``.gz`` fields gunzipped first, and images by webdataset's ``ImageHandler(image)``
    for the extensions it handles (``None``: images stay bytes, as ``.decode()`` leaves them).
    Pass as ``ShardStream(..., decode=webdataset_decoders("rgb8"))``."""
    from webdataset import autodecode

    # ShardStream merges a decode= mapping over its defaults: every default extension webdataset
    # does not decode is mapped to keep_bytes, so it stays bytes as in webdataset.
    decoders: dict[str, Callable[[bytes], Any]] = {ext: keep_bytes for ext in default_decoders(allow_pickle=True) if ext not in COMPRESSION}
    decoders.update(autodecode.decoders)
    if image is not None:
        handler = WebDatasetImage(image)
        decoders.update({ext: handler for ext in autodecode.IMAGE_EXTENSIONS})
    return decoders


def keep_bytes(data: bytes) -> bytes:
    """A decoder that leaves the field as it is (to switch off a default decoder by extension)."""
    return data


def gunzip(data: bytes) -> bytes:
    """The default decoder of the ``gz`` compression suffix (``json.gz`` is gunzipped, then decoded as json)."""
    import gzip

    return gzip.decompress(data)


class _Gunzip:
    """Decompress (``gunzip`` or the user's ``gz`` decoder), then the inner extension's decoder
    (bytes when there is none)."""

    def __init__(self, inner: Callable[[bytes], Any] | None, decompress: Callable[[bytes], bytes] = gunzip):
        self.inner = inner
        self.decompress = decompress

    def __call__(self, data: bytes):
        raw = self.decompress(data)
        return raw if self.inner is None else self.inner(raw)


class Decoder:
    """Callable that decodes every field of a sample dict by extension."""

    def __init__(self, decoders: Decoders, required: Iterable[str] = (), alias: Mapping[str, Iterable[str]] | None = None):
        self.decoders = dict(decoders)
        self.required = tuple(required)
        self.alias = {name: tuple(alts) for name, alts in (alias or {}).items()}
        # (field, the alternatives that also satisfy it): a required alias name is met by any of its fields
        self._required = [(ext, self.alias.get(ext, ())) for ext in self.required]
        self._cache: dict[str, Callable[[bytes], Any] | None] = {}
        self._plans: dict[tuple[str, ...], list[tuple[str, Callable[[bytes], Any]]]] = {}
        self._renames: dict[tuple[str, ...], list[tuple[str, str, tuple[str, ...]]]] = {}

    def _lookup(self, ext: str):
        try:
            return self._cache[ext]
        except KeyError:
            fn = self.decoders.get(ext)
            inner, compression = split_compression(ext)
            if fn is None and compression is not None:  # json.gz: gunzip, then decode as json
                fn = self._decompressing(ext.rsplit(".", 1)[-1], self._lookup(inner))
            elif fn is None:
                fn = self.decoders.get(ext.rsplit(".", 1)[-1])
            self._cache[ext] = fn
            return fn

    def _decompressing(self, suffix: str, inner: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
        """A compressed field's decoder: decompress, then ``inner``. Decompressing is decoding: the
        suffix's own decoder (``"gz": gunzip`` among the defaults) turns it on; without it, only a
        field whose inner extension has a decoder is decompressed (for that decoder)."""
        decompress = self.decoders.get(suffix)
        if decompress is keep_bytes or (decompress is None and inner is None):
            return None  # kept as stored
        return _Gunzip(inner, decompress or gunzip)

    @property
    def passthrough(self) -> bool:
        """True when it returns every sample as it is (no decoders, no required fields, no alias: ``decode=False``)."""
        return not self.decoders and not self.required and not self.alias

    def viewing_exts(self) -> _ViewingExts:
        """The extensions whose decoder views a writable buffer in place (``in`` works on it)."""
        return _ViewingExts(self)

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
            for ext, alts in self._required:
                if ext not in sample and not any(a in sample for a in alts):
                    wanted = f"{ext!r}" + (f" (any of {';'.join(alts)})" if alts else "")
                    raise SampleError(sample.get("__url__", "?"), sample.get("__key__", "?"), f"missing required field {wanted}")
        for ext, fn in plan:
            try:
                sample[ext] = fn(sample[ext])
            except Exception as exc:  # a decoder may raise anything on corrupt bytes
                if not isinstance(sample[ext], (bytes, bytearray, memoryview)):
                    continue  # a Parquet row's str or number under a name that has a decoder: kept as it is
                raise SampleError(
                    sample.get("__url__", "?"), sample.get("__key__", "?"), f"cannot decode field {ext!r}: {type(exc).__name__}: {exc}"
                ) from exc
        if self.alias:
            try:
                renames = self._renames[names]
            except KeyError:
                renames = self._renames[names] = self._rename_plan(names)
            for name, ext, others in renames:
                value = sample.pop(ext)
                for other in others:
                    del sample[other]
                sample[name] = value
        return sample

    def _rename_plan(self, names: tuple[str, ...]) -> list[tuple[str, str, tuple[str, ...]]]:
        """(alias name, the field it takes, the other alternatives present, dropped) for a field set."""
        plan = []
        for name, alts in self.alias.items():
            found = [ext for ext in alts if ext in names]
            if found:
                plan.append((name, found[0], tuple(found[1:])))
        return plan


class _ViewingExts:
    """``ext in this``: is ``ext``'s decoder one of VIEWING_DECODERS (answers cached)."""

    def __init__(self, decoder: Decoder):
        self._decoder = decoder
        self._known: dict[str, bool] = {}

    def __contains__(self, ext: object) -> bool:
        if not isinstance(ext, str):
            return False
        known = self._known.get(ext)
        if known is None:
            known = self._known[ext] = self._decoder._lookup(ext) in VIEWING_DECODERS
        return known


def decode_samples(chunks: Iterable[list[dict[str, Any]]], decoder: Callable[[dict], dict], policy: ErrorPolicy) -> Iterator[list[dict[str, Any]]]:
    """Decode lists of samples; failures go to ``policy`` (raise, or skip and count).

    Each success resets the policy's run of consecutive failures; here that is done once per run
    of successes (before the next failure, or at the end of the list), which leaves the policy as
    a call per sample would. A decoder with nothing to do (``Decoder.passthrough``) passes the
    lists on as they are. The time spent decoding is counted (``decode_us``), a list at a time."""
    if getattr(decoder, "passthrough", False):
        for chunk in chunks:
            if chunk:
                policy.ok()
                yield chunk
        return
    counters = policy.counters
    for chunk in chunks:
        began = time.perf_counter()
        out: list[dict[str, Any]] = []
        append = out.append
        samples = iter(chunk)
        while True:
            before = len(out)
            try:
                for sample in samples:
                    append(decoder(sample))
            except SampleError as exc:
                if len(out) > before:
                    policy.ok()
                policy.failed(exc)
                continue
            if len(out) > before:
                policy.ok()
            break
        if counters is not None:
            counters.add("decode_us", int((time.perf_counter() - began) * 1e6))
        if out:
            yield out
