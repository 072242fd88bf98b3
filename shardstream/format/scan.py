"""Whole-shard reads: sample count, byte size, sha256 and per-sample offsets, in one pass.

``scan_stream`` is the one "read, hash, find offsets" loop: ``shardstream index``/``pack`` of tar
sources and ``ShardStream`` given bare shard URLs (``scan_shards``), ``shardstream verify``
(``benchmarks/verify.py``, with a per-sample hook for deep checks) and the stream's ``verify_stream``
path (``pipeline/read.py``, through ``hashed`` and ``skip_exactly``) all use it or its parts.
Bytes come from ``storage.ranges.open_object``: the same retry, resume and deadline as every read.
(Here in format, not storage: it parses tars and makes manifest entries; storage imports no format.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shardstream.errors import ShardFormatError
from shardstream.format.compression import UNKNOWN_END, decompressing, shard_compression
from shardstream.format.manifest import Manifest, ShardInfo
from shardstream.format.members import MemberRecorder
from shardstream.format.tar import DEFAULT_READ_SIZE, iter_sample_batches
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.ranges import open_object

READ_SIZE = 8 << 20

ReadFn = Callable[[int], bytes]  # read(n): the next <= n bytes (not options.Read, the option value)
OnSample = Callable[[str, int, int, dict[str, bytes]], None]


def hashed(read: ReadFn, digest: Any, progress: Callable[[int], None] | None = None) -> ReadFn:
    """``read`` with every byte it returns fed to ``digest`` (and counted by ``progress``)."""

    def read_hashed(n: int) -> bytes:
        data = read(n)
        digest.update(data)
        if progress is not None:
            progress(len(data))
        return data

    return read_hashed


def skip_exactly(read: ReadFn, n: int, url: str, at: int) -> None:
    """Read and drop exactly n bytes from offset ``at`` (they still pass through any hash)."""
    while n > 0:
        chunk = read(min(n, DEFAULT_READ_SIZE))
        if not chunk:
            raise ShardFormatError(url, at, f"stream ended with {n} bytes of the object still to come (truncated shard)")
        n -= len(chunk)
        at += len(chunk)


@dataclass
class Scan:
    """What one pass over a whole shard found."""

    url: str
    size: int
    offsets: list[int] = field(default_factory=list)  # each sample's start, then the data end
    sha256: str = ""
    extensions: dict[str, int] = field(default_factory=dict)
    members: bytes | None = None  # the member sidecar (format/members.py), when asked for and the shard allows one

    @property
    def samples(self) -> int:
        return max(0, len(self.offsets) - 1)

    def info(self) -> ShardInfo:
        return ShardInfo(path=self.url, samples=self.samples, bytes=self.size, sha256=self.sha256, offsets=tuple(self.offsets), members=self.members)


def scan_stream(
    read: ReadFn,
    *,
    url: str,
    size: int,
    on_sample: OnSample | None = None,
    progress: Callable[[int], None] | None = None,
    members: bool = False,
) -> Scan:
    """Parse, hash and index bytes [0, size) of a shard given by ``read``. ``on_sample(key, start,
    end, fields)`` sees each sample. With ``members``, ``scan.members`` is the shard's member
    sidecar (``format.members.MemberRecorder``; None where the shard is not one to slice). Raises
    ShardFormatError (with ``scan.offsets`` so far kept on the exception as ``partial``) or what
    ``read`` raises."""
    digest = hashlib.sha256()
    read = hashed(read, digest, progress)
    scan = Scan(url=url, size=size)
    data_end = 0
    compression = shard_compression(url)  # offsets of a compressed shard are in its decompressed stream
    tar_read = decompressing(read, url, compression) if compression else read
    recorder = MemberRecorder(tar_read, url) if members else None
    try:
        for batch in iter_sample_batches(recorder or tar_read, url=url, start=0, end=UNKNOWN_END if compression else size, require_end_marker=True):
            for key, offset, sample_end, fields in batch:
                if recorder is not None:
                    recorder.sample(key, offset, sample_end, fields)
                scan.offsets.append(offset)
                data_end = sample_end
                for ext in fields:
                    scan.extensions[ext] = scan.extensions.get(ext, 0) + 1
                if on_sample is not None:
                    on_sample(key, offset, sample_end, fields)
    except ShardFormatError as exc:
        exc.partial = scan  # type: ignore[attr-defined]
        raise
    while read(READ_SIZE):  # hash the end-of-archive blocks and anything after them
        pass
    scan.offsets.append(data_end)
    scan.sha256 = digest.hexdigest()
    if recorder is not None:
        scan.members = recorder.encoded(scan.offsets, size, scan.sha256)
    return scan


def scan_url(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    config: StorageConfig = DEFAULT_STORAGE,
    on_sample: OnSample | None = None,
    progress: Callable[[int], None] | None = None,
    members: bool = False,
) -> Scan:
    """``scan_stream`` over a whole object. Raises StorageError or ShardFormatError."""
    size, read, close = open_object(url, storage_options, config=config)
    try:
        return scan_stream(read, url=url, size=size, on_sample=on_sample, progress=progress, members=members)
    finally:
        close()


def scan_shard(url: str, storage_options: Mapping[str, Any] | None = None, *, config: StorageConfig = DEFAULT_STORAGE) -> ShardInfo:
    """Read one shard end to end and describe it. Raises StorageError or ShardFormatError."""
    return scan_url(url, storage_options, config=config).info()


def scan_shards(
    urls: list[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    threads: int = 8,
    config: StorageConfig = DEFAULT_STORAGE,
    members: bool = False,
) -> Manifest:
    """Index many shards in parallel (I/O-bound: threads) into an in-memory manifest; with
    ``members``, each shard's member sidecar too (written with the manifest: ``shardstream index``)."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(urls)))) as pool:
        results = list(pool.map(lambda u: scan_url(u, storage_options, config=config, members=members), urls))
    extensions: dict[str, int] = {}
    for scan in results:
        for ext, n in scan.extensions.items():
            extensions[ext] = extensions.get(ext, 0) + n
    return Manifest(shards=[scan.info() for scan in results], extensions=extensions)
