"""Look inside a dataset: find samples (by position or key) and describe their fields.

Key lookup uses the manifest's offsets: it reads only the first header block(s) of each sample
(one small ranged read per sample, batched) to learn its key, never whole shards.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from shardstream.errors import ShardstreamError
from shardstream.format.compression import shard_compression
from shardstream.format.extensions import kind_of, split_compression
from shardstream.format.manifest import Manifest
from shardstream.format.tar import BLOCK
from shardstream.pipeline.read import read_range
from shardstream.plan.epoch import Range
from shardstream.storage import fs as storage
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig

PROBE_BYTES = 3 * BLOCK  # a pax or long-name header, then the member's own header


def iter_dataset_samples(
    manifest: Manifest, storage_options: Mapping[str, Any] | None = None, *, config: StorageConfig = DEFAULT_STORAGE
) -> Iterator[dict[str, Any]]:
    """Every sample in manifest order, undecoded."""
    for i, shard in enumerate(manifest.shards):
        if shard.samples:
            for chunk in read_range(manifest, Range(i, 0, shard.samples), storage_options=storage_options, config=config):
                yield from chunk


def _first_name(data: bytes) -> str | None:
    """Name of the first regular member in ``data`` (header-only parse, data may be cut)."""
    import tarfile

    pos = 0
    long_name = None
    while pos + BLOCK <= len(data):
        try:
            info = tarfile.TarInfo.frombuf(data[pos : pos + BLOCK], "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            return None
        size = info.size
        body = data[pos + BLOCK : pos + BLOCK + size]
        if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE):
            return long_name or info.name
        if info.type == tarfile.GNUTYPE_LONGNAME:
            if len(body) < size:
                return None
            long_name = body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif info.type == tarfile.XHDTYPE:
            if len(body) < size:
                return None
            for line in body.split(b"\n"):
                _, _, record = line.partition(b" ")
                k, _, v = record.partition(b"=")
                if k == b"path":
                    long_name = v.decode("utf-8", "surrogateescape")
        pos += BLOCK + size + (-size % BLOCK)
    return None


def find_key(
    manifest: Manifest, key: str, storage_options: Mapping[str, Any] | None = None, *, config: StorageConfig = DEFAULT_STORAGE
) -> dict[str, Any] | None:
    """The sample with ``key``, reading only each sample's first header block(s) until found
    (every read under ``config``'s retry policy and deadline)."""
    from shardstream.format.tar import split_name

    for i, shard in enumerate(manifest.shards):
        url = manifest.shard_url(i)
        if shard_compression(url):  # no ranged reads into a compressed stream: read it through
            for chunk in read_range(manifest, Range(i, 0, shard.samples), storage_options=storage_options, config=config) if shard.samples else ():
                for sample in chunk:
                    if sample["__key__"] == key:
                        return sample
            continue
        offsets = manifest.offsets(i, storage_options, config=config).tolist() if shard.samples else [0]
        starts = offsets[:-1]
        ends = [min(a + PROBE_BYTES, b) for a, b in zip(offsets[:-1], offsets[1:])]
        for batch_start in range(0, len(starts), 1000):
            s, e = starts[batch_start : batch_start + 1000], ends[batch_start : batch_start + 1000]
            try:
                heads = storage.storage_call(url, _heads(s, e), storage_options, config)
            except FileNotFoundError as exc:
                raise ShardstreamError(f"{url}: shard not found (listed in the manifest)") from exc
            for j, head in enumerate(heads):
                name = _first_name(head) if isinstance(head, bytes) else None
                k = split_name(name)[0] if name else None
                if k == key or name is None:
                    index = batch_start + j
                    ((sample,),) = list(read_range(manifest, Range(i, index, index + 1), storage_options=storage_options, config=config))
                    if sample["__key__"] == key:
                        return sample
    return None


def _heads(starts: list[int], ends: list[int]) -> Any:
    """``fn(fs, path)`` reading bytes [starts[k], ends[k]) of one object, all in one call."""

    def read(fs: Any, path: str) -> list[Any]:
        return fs.cat_ranges([path] * len(starts), starts, ends)

    return read


def describe_field(ext: str, data: bytes, width: int = 60) -> str:
    """A short, safe preview of one field: text, JSON, array shape/dtype, image size, or hex.
    The kind comes from the shared extension table; a ``.gz`` field is previewed decompressed."""
    inner, compression = split_compression(ext)
    if compression == "gzip":
        try:
            import gzip

            return "gzip, " + describe_field(inner, gzip.decompress(data), width)
        except Exception as exc:  # noqa: BLE001 - a preview must never fail the listing
            return f"unreadable as .{ext}: {type(exc).__name__}: {_clip(str(exc), width)}"
    kind = kind_of(ext)
    try:
        if kind == "image":
            from PIL import Image

            with Image.open(io.BytesIO(data)) as img:
                return f"image {img.format} {img.size[0]}x{img.size[1]} {img.mode}"
        if kind == "npy":
            import numpy as np

            array = np.load(io.BytesIO(data), allow_pickle=False)  # public API; no pickled objects
            return f"array shape={tuple(array.shape)} dtype={array.dtype}"
        if kind == "npz":
            import numpy as np

            with np.load(io.BytesIO(data), allow_pickle=False) as archive:
                return "arrays " + _clip(", ".join(archive.files), width)
        if kind == "json":
            text = json.dumps(json.loads(data), ensure_ascii=False)
            return "json " + _clip(text, width)
        if kind == "int":
            return f"int {int(data)}"
        if kind == "text":
            return "text " + _clip(repr(data.decode("utf-8"))[1:-1], width)
    except Exception as exc:  # noqa: BLE001 - a preview must never fail the listing
        return f"unreadable as .{ext}: {type(exc).__name__}: {_clip(str(exc), width)}"
    try:
        text = data.decode("utf-8")
        if text.isprintable():
            return "text " + _clip(text, width)
    except UnicodeDecodeError:
        pass
    return "bytes " + data[:16].hex(" ") + (" ..." if len(data) > 16 else "")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def extract_sample(sample: Mapping[str, Any], dest: str) -> list[str]:
    """Write a sample's fields as files under ``dest``; refuses any path that would leave it."""
    root = os.path.realpath(dest)
    written = []
    for ext, data in sample.items():
        if ext.startswith("__"):
            continue
        path = os.path.realpath(os.path.join(root, f"{sample['__key__']}.{ext}"))
        if os.path.commonpath([root, path]) != root:
            raise ShardstreamError(f"refusing to write {path!r}: outside {root!r}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        written.append(path)
    return written
