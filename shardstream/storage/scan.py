"""Scan existing tar shards: sample count, byte size, sha256 and per-sample offsets, in one read.

Used by ``shardstream pack`` for tar sources, by ``ShardStream.from_urls`` (shard URLs without a
manifest), and by ``shardstream index`` (a manifest for shards written by others).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardstream.errors import StorageError
from shardstream.format.compression import UNKNOWN_END, decompressing, shard_compression
from shardstream.format.manifest import Manifest, ShardInfo
from shardstream.format.tar import iter_sample_batches
from shardstream.storage import fs as storage

READ_SIZE = 8 << 20


def scan_shard(url: str, storage_options: Mapping[str, Any] | None = None) -> ShardInfo:
    """Read one shard end to end and describe it. Raises StorageError or ShardFormatError."""
    return _scan_shard(url, storage_options)[0]


def _scan_shard(url: str, storage_options: Mapping[str, Any] | None) -> tuple[ShardInfo, dict[str, int]]:
    """The shard's ShardInfo and how many of its samples carry each extension."""
    fs, path = storage.get_fs(url, storage_options)
    try:
        size = fs.size(path)
        f = fs.open(path, "rb", block_size=READ_SIZE)
    except FileNotFoundError as exc:
        raise StorageError(f"{url}: not found") from exc
    except PermissionError as exc:
        raise StorageError(f"{url}: {storage.explain_denied(fs, path, exc)}") from exc
    digest = hashlib.sha256()

    def read(n: int) -> bytes:
        chunk = f.read(n)
        digest.update(chunk)
        return chunk

    offsets: list[int] = []
    data_end = 0
    extensions: dict[str, int] = {}
    compression = shard_compression(url)  # offsets of a compressed shard are in its decompressed stream
    tar_read = decompressing(read, url, compression) if compression else read
    with f:
        for batch in iter_sample_batches(tar_read, url=url, start=0, end=UNKNOWN_END if compression else size,
                                         require_end_marker=True):
            for _key, offset, sample_end, fields in batch:
                offsets.append(offset)
                data_end = sample_end
                for ext in fields:
                    extensions[ext] = extensions.get(ext, 0) + 1
        while read(READ_SIZE):  # hash the end-of-archive blocks and anything after them
            pass
    offsets.append(data_end)
    # Offsets stay in memory (a list of ints) until the manifest's writer puts them in a sidecar.
    info = ShardInfo(path=url, samples=len(offsets) - 1, bytes=size, sha256=digest.hexdigest(), offsets=offsets)
    return info, extensions


def scan_shards(urls: list[str], storage_options: Mapping[str, Any] | None = None, *, threads: int = 8) -> Manifest:
    """Index many shards in parallel (I/O-bound: threads) into an in-memory manifest."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(urls)))) as pool:
        results = list(pool.map(lambda u: _scan_shard(u, storage_options), urls))
    extensions: dict[str, int] = {}
    for _, counts in results:
        for ext, n in counts.items():
            extensions[ext] = extensions.get(ext, 0) + n
    return Manifest(shards=[info for info, _ in results], extensions=extensions)
