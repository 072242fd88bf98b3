"""Merge separately packed datasets into one (``shardstream merge DEST PART [PART ...]``).

Nothing is copied: the merged manifest lists every part's shards (and offset sidecars) in part
order, by a path relative to DEST where the part lies under DEST (``DEST/day-01/...``), else by
its full URL (a local shard by its absolute path). Both sides are normalised first (``./``, ``..``,
relative, absolute and ``file://`` spellings of one local path alike), so ``merge ./all ./day-01``
lists ``/abs/day-01/...`` and ``merge ./all ./all/day-01`` lists ``day-01/...``. A shard listed
twice (the same part given twice, or spelled two ways; overlapping parts) is refused.
Version-1 parts get their sidecars written next to their shards first. The merged manifest is
written last and atomically, like any other: DEST's dataset changes in one step.

``config`` (a ``StorageConfig``): the parts' manifests are read under its retry policy and
deadline and confined to their roots and its ``allow_roots``, DEST's probe is retried under it,
and the manifest is uploaded with its timeouts and tries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardstream.errors import ConfigError, DestinationError, ManifestError
from shardstream.format.manifest import MANIFEST_NAME, Manifest, ShardInfo, check_dataset_root, load_manifest, manifest_url, write_manifest
from shardstream.format.parquet import refuse_table
from shardstream.storage import fs as storage
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.fs import storage_call
from shardstream.storage.urls import canonical_url
from shardstream.write.writer import MAX_SKIPPED_LISTED


def merge_datasets(
    dest: str,
    parts: Sequence[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    config: StorageConfig = DEFAULT_STORAGE,
) -> tuple[Manifest, str]:
    """Write DEST's manifest listing the shards of ``parts`` in order; returns it and its URL.

    DEST may be one of the parts (its current shards come where it is listed): that is how a
    dataset grows. Otherwise an existing manifest at DEST needs ``overwrite``. ``config``: the
    storage policy (see the module docstring).
    """
    if not parts:
        raise ValueError("merge needs at least one part")
    check_dataset_root(dest)
    remote_dest = "://" in canonical_url(dest)
    url = manifest_url(canonical_url(dest) if remote_dest else dest)  # s3://b/all/./ is s3://b/all (a local path resolves itself)
    base = url.rsplit("/", 1)[0]
    part_urls = [manifest_url(canonical_url(p)) for p in parts]  # s3://b/all/./day-01/ reads s3://b/all/day-01
    grows = canonical_url(url) in {canonical_url(p) for p in part_urls}
    if not grows and not overwrite and storage_call(url, lambda fs, path: fs.exists(path), storage_options, config):
        raise DestinationError(f"{url} already holds a dataset; list it as a part to grow it, or pass --overwrite")
    shards: list[ShardInfo] = []
    where: dict[str, str] = {}
    extensions: dict[str, int] = {}
    label_map: dict[str, int] | None = None
    label_counts: dict[str, int] | None = None
    skipped: dict[str, Any] = {"count": 0, "items": []}
    for n, part_url in enumerate(part_urls):
        part = load_manifest(part_url, storage_options, config=config)
        refuse_table(part, "shardstream merge")
        if n == 0:
            label_map = part.label_map
            label_counts = dict(part.label_counts) if part.label_counts is not None else None
        elif part.label_map != label_map:
            raise ManifestError(
                f"{part_url}: its label_map differs from {part_urls[0]}'s: the labels would not mean "
                "the same class; pack the parts with the same classes"
            )
        elif label_counts is not None and part.label_counts is not None:
            for name, count in part.label_counts.items():
                label_counts[name] = label_counts.get(name, 0) + count
        for ext, count in part.extensions.items():
            extensions[ext] = extensions.get(ext, 0) + count
        skipped["count"] += int(part.skipped.get("count", 0))
        skipped["items"] = (skipped["items"] + list(part.skipped.get("items", [])))[:MAX_SKIPPED_LISTED]
        for i in range(len(part.paths)):
            shard_url = canonical_url(part.shard_url(i))
            if remote_dest and "://" not in shard_url:
                raise ConfigError(
                    f"{part_url}: its shards are local files ({shard_url}) and the merged manifest {url} is not: "
                    "a remote manifest cannot list local shards (upload the part first, or merge into a local DEST)"
                )
            if shard_url in where:
                raise ManifestError(f"{shard_url} is listed by both {where[shard_url]} and {part_url}: a shard may appear once in a dataset")
            where[shard_url] = part_url
            offsets = part.offsets(i) if part.version == 1 else None
            shards.append(
                ShardInfo(
                    path=_relative(shard_url, base),
                    samples=int(part.counts[i]),
                    bytes=int(part.sizes[i]),
                    sha256=part.sha256(i),
                    offsets=offsets,
                    index=_relative(part.sidecar_url(i), base),
                    span=(int(part.spans[i, 0]), int(part.spans[i, 1])),
                    member_bytes=int(part.member_bytes[i]) if part.member_bytes[i] >= 0 else None,  # (beside the sidecar: ``members_path``)
                )
            )
    manifest = Manifest(shards=shards, extensions=extensions, label_map=label_map, label_counts=label_counts, skipped=skipped)
    write_manifest(manifest, url, storage.bound_options(url, storage_options, config))
    manifest.base_url = base
    manifest.storage_options = dict(storage_options or {})
    return manifest, url


def _relative(target: str, base: str) -> str:
    """``target`` as the merged manifest at ``base`` lists it: relative to ``base`` when under it,
    else its canonical URL or absolute path (never a relative path that would climb or resolve
    against the wrong directory)."""
    target, base = canonical_url(target), canonical_url(base)
    prefix = base.rstrip("/") + "/"
    return target[len(prefix) :] if target.startswith(prefix) else target


__all__ = ["merge_datasets", "MANIFEST_NAME"]
