"""A manifest for shards written by others (``shardstream index``): the shards are scanned, not
rewritten, and their paths stored relative to the manifest where they are under it.

Inputs, any number of them: a shard URL (plain or compressed tar), a brace pattern, a glob, a
directory (its ``*.tar*`` shards, sorted) or a text file listing shard URLs/patterns one a line
(``#`` comments). Local paths may be relative, ``./``-prefixed, absolute or ``file://`` URLs, on
either side: both sides are resolved to absolute paths before deciding what is under DEST.

Each shard's offsets go to a sidecar written before the manifest: ``SHARD.idx`` beside a shard
under DEST, ``offsets/NNNNNN.idx`` under DEST for shards elsewhere (nothing is written beside
shards shardstream does not own). ``upgrade_manifest`` turns a version-1 manifest (offsets
inline) into version 2 the same way, without reading a shard.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from shardstream.errors import DestinationError, SourceError
from shardstream.format.compression import is_shard_name
from shardstream.format.manifest import MANIFEST_NAME, Manifest, check_dataset_root, load_manifest, manifest_url, write_manifest
from shardstream.format.offsets import SUFFIX
from shardstream.storage import fs as storage
from shardstream.storage.scan import scan_shards
from shardstream.storage.urls import PATTERN_CHARS, expand_urls


def _canonical(url: str) -> str:
    """A local path as an absolute path (``./x``, ``x``, ``file:///x`` alike); remote URLs as given."""
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" in url:
        return url
    return os.path.abspath(url)


def shard_urls(inputs: str | Sequence[str], storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Every shard URL the inputs name, in order, without repeats (see the module docstring)."""
    urls: list[str] = []
    for source in [inputs] if isinstance(inputs, str) else inputs:
        if any(c in source for c in PATTERN_CHARS) or is_shard_name(source):
            found = expand_urls(source, storage_options)
        else:
            fs, path = storage.get_fs(source, storage_options)
            if fs.isdir(path):
                found = [storage.full_url(fs, p) for p in sorted(fs.find(path)) if is_shard_name(p)]
            elif fs.isfile(path):  # a list of shard URLs or patterns
                text = fs.cat_file(path).decode("utf-8")
                lines = [line.strip() for line in text.splitlines()]
                found = shard_urls([line for line in lines if line and not line.startswith("#")], storage_options)
            else:
                raise SourceError(source, "not found (expected shards, a pattern, a directory or a file listing shard URLs)")
        if not found:
            raise SourceError(source, "no shards match")
        urls += found
    return list(dict.fromkeys(urls))


def write_index(
    pattern: str | Sequence[str], dest: str, *, storage_options: Mapping[str, Any] | None = None, threads: int = 8, overwrite: bool = False
) -> tuple[Manifest, str]:
    """Index the shards that ``pattern`` names (one input or several) and write their manifest at
    ``dest`` (a directory or a .json path). Shards are not modified. Returns the manifest and its URL."""
    check_dataset_root(dest)
    urls = shard_urls(pattern, storage_options)
    url = dest if dest.endswith(".json") else storage.join(dest, MANIFEST_NAME)
    fs, path = storage.get_fs(url, storage_options)
    if fs.exists(path) and not overwrite:
        raise DestinationError(f"{url} exists; pass --overwrite to replace it")
    manifest = scan_shards([_canonical(u) for u in urls], storage_options, threads=threads)
    canonical = _canonical(url)
    base = canonical.rsplit("/", 1)[0] + "/"
    manifest.paths = [p[len(base) :] if p.startswith(base) else p for p in manifest.paths]
    _place_sidecars(manifest)
    write_manifest(manifest, url, storage_options)  # sidecars first, the manifest last
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
    _place_sidecars(manifest)
    write_manifest(manifest, url, storage_options)
    return manifest, url, True


def _place_sidecars(manifest: Manifest) -> None:
    absolute = [("://" in p or p.startswith("/")) for p in manifest.paths]
    if any(absolute):
        manifest._sidecars = [f"offsets/{i:06d}{SUFFIX}" if a else p + SUFFIX for i, (p, a) in enumerate(zip(manifest.paths, absolute))]
