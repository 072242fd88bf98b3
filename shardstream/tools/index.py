"""A manifest for shards written by others (``shardstream index``): the shards are scanned, not
rewritten, and their paths stored relative to the manifest where they are under it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from shardstream.errors import DestinationError, SourceError
from shardstream.format.manifest import MANIFEST_NAME, Manifest
from shardstream.storage import fs as storage
from shardstream.storage.scan import scan_shards
from shardstream.storage.urls import expand_urls


def write_index(pattern: str, dest: str, *, storage_options: Mapping[str, Any] | None = None, threads: int = 8,
                overwrite: bool = False) -> tuple[Manifest, str]:
    """Index the shards matching ``pattern`` and write their manifest at ``dest`` (a directory or
    a .json path). Shards are not modified. Returns the manifest and its URL."""
    urls = expand_urls(pattern, storage_options)
    if not urls:
        raise SourceError(pattern, "no shards match")
    url = dest if dest.endswith(".json") else storage.join(dest, MANIFEST_NAME)
    fs, path = storage.get_fs(url, storage_options)
    if fs.exists(path) and not overwrite:
        raise DestinationError(f"{url} exists; pass --overwrite to replace it")
    manifest = scan_shards(urls, storage_options, threads=threads)
    base = url.rsplit("/", 1)[0] + "/" if "/" in url else ""
    manifest.shards = [replace(s, path=s.path[len(base):] if base and s.path.startswith(base) else s.path)
                       for s in manifest.shards]
    if storage.is_local(fs):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    storage.write_bytes_atomic(fs, path, manifest.dumps())
    return manifest, url
