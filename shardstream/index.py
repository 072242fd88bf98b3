"""Index existing tar shards: sample count, byte size, sha256 and per-sample offsets, in one read.

Used by ``shardstream pack`` for tar sources, by ShardStream when it is given shard URLs without a
manifest, and by ``shardstream index`` (a manifest for shards written by others).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from . import storage
from .errors import StorageError
from .manifest import Manifest, ShardInfo
from .tarformat import iter_sample_batches

READ_SIZE = 8 << 20


def index_shard(url: str, storage_options: Mapping[str, Any] | None = None) -> ShardInfo:
    """Read one shard end to end and describe it. Raises StorageError or ShardFormatError."""
    return _index_shard(url, storage_options)[0]


def _index_shard(url: str, storage_options: Mapping[str, Any] | None) -> tuple[ShardInfo, dict[str, int]]:
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
    with f:
        for batch in iter_sample_batches(read, url=url, start=0, end=size, require_end_marker=True):
            for _key, offset, sample_end, fields in batch:
                offsets.append(offset)
                data_end = sample_end
                for ext in fields:
                    extensions[ext] = extensions.get(ext, 0) + 1
        while read(READ_SIZE):  # hash the end-of-archive blocks and anything after them
            pass
    offsets.append(data_end)
    info = ShardInfo(path=url, samples=len(offsets) - 1, bytes=size, sha256=digest.hexdigest(), offsets=tuple(offsets))
    return info, extensions


def index_shards(urls: list[str], storage_options: Mapping[str, Any] | None = None, *, threads: int = 8) -> Manifest:
    """Index many shards in parallel (I/O-bound: threads) into an in-memory manifest."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(urls)))) as pool:
        results = list(pool.map(lambda u: _index_shard(u, storage_options), urls))
    extensions: dict[str, int] = {}
    for _, counts in results:
        for ext, n in counts.items():
            extensions[ext] = extensions.get(ext, 0) + n
    return Manifest(shards=[info for info, _ in results], extensions=extensions)


def write_index(pattern: str, dest: str, *, storage_options: Mapping[str, Any] | None = None, threads: int = 8,
                overwrite: bool = False) -> tuple[Manifest, str]:
    """Index the shards matching ``pattern`` and write their manifest at ``dest`` (a directory or
    a .json path). Shards are not modified. Returns the manifest and its URL."""
    from dataclasses import replace

    from .errors import DestinationError, SourceError
    from .manifest import MANIFEST_NAME
    from .sources import expand_urls

    urls = expand_urls(pattern, storage_options)
    if not urls:
        raise SourceError(pattern, "no shards match")
    url = dest if dest.endswith(".json") else storage.join(dest, MANIFEST_NAME)
    fs, path = storage.get_fs(url, storage_options)
    if fs.exists(path) and not overwrite:
        raise DestinationError(f"{url} exists; pass --overwrite to replace it")
    manifest = index_shards(urls, storage_options, threads=threads)
    base = url.rsplit("/", 1)[0] + "/" if "/" in url else ""
    manifest.shards = [replace(s, path=s.path[len(base):] if base and s.path.startswith(base) else s.path)
                       for s in manifest.shards]
    if storage.is_local(fs):
        import os

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    storage.write_bytes_atomic(fs, path, manifest.dumps())
    return manifest, url
