"""A manifest for shards written by others (``shardstream index``): the shards are scanned, not
rewritten, and their paths stored relative to the manifest where they are under it.

Inputs, any number of them: a shard URL (plain or compressed tar), a brace pattern, a glob, a
directory (its ``*.tar*`` shards, sorted) or a text file listing shard URLs/patterns one a line
(``#`` comments). Local paths may be relative, ``./``-prefixed, absolute or ``file://`` URLs, on
either side: both sides are resolved to absolute paths before deciding what is under DEST.

Each shard's offsets go to a sidecar written before the manifest: ``SHARD.idx`` beside a shard
under DEST, ``offsets/NNNNNN.idx`` under DEST for shards elsewhere (nothing is written beside
shards shardstream does not own). The same scan records each shard's members (``format/members.py``):
a ``.members`` sidecar beside the ``.idx`` lets readers slice the members without parsing a header
(a shard the scan cannot vouch for gets none and is parsed). ``upgrade_manifest`` turns a version-1 manifest (offsets
inline) into version 2 the same way, without reading a shard.

``write_index`` refuses shards an interrupted pack left (``write.writer.interrupted_pack``: its
marker or a temporary file in a shard's folder or DEST): indexed, they read as a complete dataset
of part of the samples; ``pack`` again completes it.

Parquet files (``.parquet`` URLs or globs, or a folder holding them and no tar shards) get a table
manifest instead (``kind: "parquet"``, format/parquet.py): built from their footers alone, so a
large table is not footered again at every start.

Both take ``config`` (a ``StorageConfig``): every listing, read and manifest load follows its
retry policy and deadline (``upgrade_manifest``'s manifest also its ``allow_roots``), and the
sidecars and the manifest are uploaded with its timeouts and tries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardstream.errors import ConfigError, DestinationError, SourceError
from shardstream.format.compression import is_shard_name
from shardstream.format.manifest import MANIFEST_NAME, Manifest, check_dataset_root, load_manifest, manifest_url, write_manifest
from shardstream.format.offsets import SUFFIX
from shardstream.format.parquet import TableManifest, index_table, is_table_url, list_table_files, rebased
from shardstream.format.scan import scan_shards
from shardstream.sources import index_token_shards
from shardstream.storage import fs as storage
from shardstream.storage.classify import release_frames
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.fs import expand_retried, storage_call
from shardstream.storage.urls import PATTERN_CHARS, canonical_url
from shardstream.write.writer import refuse_interrupted_pack


def _look(fs, path: str) -> tuple[str, Any]:
    """What ``path`` is, with what it holds: ("dir", its files), ("file", its bytes) or ("none", None)."""
    if fs.isdir(path):
        return "dir", sorted(fs.find(path))
    try:
        return "file", fs.cat_file(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        release_frames(exc)  # (s3fs's error holds the callers' frames in a cycle)
        return "none", None


def shard_urls(
    inputs: str | Sequence[str], storage_options: Mapping[str, Any] | None = None, *, config: StorageConfig = DEFAULT_STORAGE
) -> list[str]:
    """Every shard URL the inputs name, in order, without repeats (see the module docstring).
    Listings and reads follow ``config`` (retries, deadline)."""
    urls: list[str] = []
    for source in [inputs] if isinstance(inputs, str) else inputs:
        if any(c in source for c in PATTERN_CHARS) or is_shard_name(source):
            found = expand_retried(source, storage_options, config)
        else:
            what, held = storage_call(source, _look, storage_options, config)
            if what == "dir":
                fs, _ = storage.get_fs(source, storage_options, config)  # (names the files: no request)
                found = [storage.full_url(fs, p) for p in held if is_shard_name(p)]
            elif what == "file":  # a list of shard URLs or patterns
                text = held.decode("utf-8")
                lines = [line.strip() for line in text.splitlines()]
                found = shard_urls([line for line in lines if line and not line.startswith("#")], storage_options, config=config)
            else:
                raise SourceError(source, "not found (expected shards, a pattern, a directory or a file listing shard URLs)")
        if not found:
            raise SourceError(source, "no shards match")
        urls += found
    return list(dict.fromkeys(urls))


def write_index(
    pattern: str | Sequence[str],
    dest: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    threads: int = 8,
    overwrite: bool = False,
    config: StorageConfig = DEFAULT_STORAGE,
    tokens: str | None = None,
) -> tuple[Manifest | TableManifest, str]:
    """Index the shards that ``pattern`` names (one input or several) and write their manifest at
    ``dest`` (a directory or a .json path). Shards are not modified. Returns the manifest and its URL.
    ``config``: the storage policy of every listing, read and upload (see the module docstring).
    ``tokens``: the member holding each sample's token ids (a 1-D integer ``.npy``): the manifest
    counts them per shard, a token corpus for ``Tokens(DEST, seq_len)`` (docs/tokens.md)."""
    check_dataset_root(dest)
    inputs = [pattern] if isinstance(pattern, str) else list(pattern)
    table = _table_inputs(inputs, storage_options, config)
    urls = [] if table else shard_urls(pattern, storage_options, config=config)
    url = dest if dest.endswith(".json") else storage.join(dest, MANIFEST_NAME)
    for folder in _folders([*urls, url]):  # an interrupted pack's shards are part of a dataset: never index them
        refuse_interrupted_pack(folder, storage_options, config=config)
    if storage_call(url, lambda fs, path: fs.exists(path), storage_options, config) and not overwrite:
        raise DestinationError(f"{url} exists; pass --overwrite to replace it")
    if table and tokens is not None:
        raise ConfigError("--tokens is for tar shards: a Parquet table's tokens are counted from its footers, Tokens(TABLE, seq_len, field=COLUMN)")
    if table:
        found = index_table([canonical_url(u) for u in inputs], storage_options, config=config, threads=threads)
        tm = rebased(found, canonical_url(url).rsplit("/", 1)[0])
        write_manifest(tm, url, storage.bound_options(url, storage_options, config))
        tm.base_url = url.rsplit("/", 1)[0] if "/" in url else "."
        tm.storage_options = dict(storage_options or {})
        return tm, url
    shards = [canonical_url(u) for u in urls]
    if tokens is not None:  # a token corpus written by others: its tokens counted in the same read
        manifest = index_token_shards(shards, tokens, storage_options, config=config, threads=threads)
    else:
        manifest = scan_shards(shards, storage_options, threads=threads, config=config, members=True)
    canonical = canonical_url(url)
    base = canonical.rsplit("/", 1)[0] + "/"
    manifest.paths = [p[len(base) :] if p.startswith(base) else p for p in manifest.paths]
    _place_sidecars(manifest)
    write_manifest(manifest, url, storage.bound_options(url, storage_options, config))  # sidecars first, the manifest last
    manifest.base_url = url.rsplit("/", 1)[0] if "/" in url else "."
    manifest.storage_options = dict(storage_options or {})
    return manifest, url


def _table_inputs(inputs: list[str], storage_options: Mapping[str, Any] | None, config: StorageConfig) -> bool:
    """True when the inputs are a Parquet table: .parquet URLs or globs, or one folder of .parquet files and no tar shards."""
    if all(is_table_url(u) for u in inputs):
        return True
    if len(inputs) != 1 or any(c in inputs[0] for c in PATTERN_CHARS) or is_shard_name(inputs[0]):
        return False
    try:
        list_table_files(inputs[0], storage_options, config)
    except Exception:  # noqa: BLE001 - not a folder of Parquet files: indexed as shards (with their errors)
        return False
    try:
        return not shard_urls(inputs, storage_options, config=config)
    except SourceError:
        return True


def upgrade_manifest(
    source: str, *, storage_options: Mapping[str, Any] | None = None, config: StorageConfig = DEFAULT_STORAGE
) -> tuple[Manifest, str, bool]:
    """Rewrite a version-1 manifest as version 2 in place: sidecars from its inline offsets
    first, then the manifest (atomically). Returns ``(manifest, url, upgraded)``; a version-2
    manifest is left alone (``upgraded`` False). ``config``: the storage policy (the manifest's
    read, its ``allow_roots``, the uploads)."""
    url = manifest_url(source)
    manifest = load_manifest(url, storage_options, config=config)
    if manifest.version >= 2:
        return manifest, url, False
    _place_sidecars(manifest)
    write_manifest(manifest, url, storage.bound_options(url, storage_options, config))
    return manifest, url, True


def _folders(urls: Sequence[str]) -> list[str]:
    """The folders holding ``urls``, and the dataset root above a numbered prefix folder
    (``ROOT/07/shard-000007.tar``: ``write.writer.shard_name``), where a pack keeps its marker."""
    folders: dict[str, None] = {}
    for u in urls:
        folder = u.rsplit("/", 1)[0] if "/" in u else "."
        folders[folder] = None
        head, _, last = folder.rpartition("/")
        if last.isdigit() and head:
            folders[head] = None
    return list(folders)


def _place_sidecars(manifest: Manifest) -> None:
    absolute = [("://" in p or p.startswith("/")) for p in manifest.paths]
    if any(absolute):
        manifest._sidecars = [f"offsets/{i:06d}{SUFFIX}" if a else p + SUFFIX for i, (p, a) in enumerate(zip(manifest.paths, absolute))]
