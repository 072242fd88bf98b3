"""A manifest for shards written by others (``shardstream index``): the shards are scanned, not
rewritten, and their paths stored relative to the manifest where they are under it. Also turns
a version-1 manifest (offsets inline) into version 2 (offset sidecars) without reading a shard."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardstream.errors import DestinationError, SourceError
from shardstream.format.manifest import MANIFEST_NAME, Manifest, load_manifest, manifest_url, write_manifest
from shardstream.format.offsets import SUFFIX
from shardstream.storage import fs as storage
from shardstream.storage.scan import scan_shards
from shardstream.storage.urls import expand_urls

SIDECAR_DIR = "offsets"  # sidecars of shards that live outside the manifest's directory


def write_index(pattern: str, dest: str, *, storage_options: Mapping[str, Any] | None = None, threads: int = 8,
                overwrite: bool = False) -> tuple[Manifest, str]:
    """Index the shards matching ``pattern`` and write their manifest at ``dest`` (a directory or
    a .json path), with an offset sidecar per shard written first. Shards are not modified.
    Returns the manifest and its URL."""
    urls = expand_urls(pattern, storage_options)
    if not urls:
        raise SourceError(pattern, "no shards match")
    url = dest if dest.endswith(".json") else storage.join(dest, MANIFEST_NAME)
    fs, path = storage.get_fs(url, storage_options)
    if fs.exists(path) and not overwrite:
        raise DestinationError(f"{url} exists; pass --overwrite to replace it")
    manifest = scan_shards(urls, storage_options, threads=threads)
    base = url.rsplit("/", 1)[0] + "/" if "/" in url else ""
    paths = [p[len(base):] if base and p.startswith(base) else p for p in manifest.paths]
    # A sidecar goes next to its shard when the shard is under the manifest's directory, else
    # into offsets/ there: shardstream never writes beside shards it does not own.
    manifest.paths = paths
    manifest._sidecars = [p + SUFFIX if not _absolute(p) else f"{SIDECAR_DIR}/{i:06d}{SUFFIX}" for i, p in enumerate(paths)]
    write_manifest(manifest, url, storage_options)
    manifest.base_url = url.rsplit("/", 1)[0] if "/" in url else "."
    manifest.storage_options = dict(storage_options or {})
    return manifest, url


def upgrade_manifest(source: str, *, storage_options: Mapping[str, Any] | None = None) -> tuple[Manifest, str, bool]:
    """Rewrite a version-1 manifest as version 2 in place: sidecars from its inline offsets
    first, then the manifest (atomically). Returns ``(manifest, url, upgraded)``; a version-2
    manifest is left alone (``upgraded`` False)."""
    url = manifest_url(source)
    manifest = load_manifest(url, storage_options)
    if manifest.version >= 2:
        return manifest, url, False
    manifest._sidecars = [p + SUFFIX if not _absolute(p) else f"{SIDECAR_DIR}/{i:06d}{SUFFIX}" for i, p in enumerate(manifest.paths)]
    write_manifest(manifest, url, storage_options)
    return manifest, url, True


def _absolute(path: str) -> bool:
    return "://" in path or path.startswith("/")
