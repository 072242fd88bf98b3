"""The manifest, ``index.json``: what a complete dataset holds, written last by the packer.

Its presence means the dataset is complete. It lists every shard with its path relative to the
manifest, sample count, byte size, sha256 and the byte offset where each sample starts (plus one
final offset where the last sample ends), so a reader can plan an epoch, split it at sample
granularity and seek to any sample with nothing else. Format: docs/manifest.md.
"""

from __future__ import annotations

import array
import json
import os
import posixpath
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from shardstream.errors import ManifestError, StorageError, StorageNotFound
from shardstream.format.compression import shard_compression
from shardstream.storage import fs as storage
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.ranges import read_object

FORMAT_NAME = "shardstream-index"
FORMAT_VERSION = 1
MANIFEST_NAME = "index.json"


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the manifest's directory (or an absolute URL)
    samples: int
    bytes: int
    sha256: str | None
    # samples + 1 entries: each sample's first header, then the data end. Loaded manifests keep
    # them as a compact array.array("q") (8 bytes each, Python ints on indexing), not a tuple.
    offsets: Sequence[int]

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "samples": self.samples, "bytes": self.bytes, "sha256": self.sha256,
                "offsets": list(self.offsets)}  # array.array -> Python ints


@dataclass
class Manifest:
    shards: list[ShardInfo]
    extensions: dict[str, int] = field(default_factory=dict)
    label_map: dict[str, int] | None = None
    label_counts: dict[str, int] | None = None
    skipped: dict[str, Any] = field(default_factory=lambda: {"count": 0, "items": []})
    created: str = ""
    shardstream_version: str = ""
    base_url: str = ""  # directory the shard paths are relative to (set when loaded)

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def shard_url(self, index: int) -> str:
        path = self.shards[index].path
        if "://" in path or path.startswith("/") or not self.base_url:
            return path
        return storage.join(self.base_url, path)

    def to_json(self) -> dict[str, Any]:
        from shardstream import __version__

        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "shardstream_version": self.shardstream_version or __version__,
            "created": self.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "total_samples": self.total_samples,
            "total_bytes": self.total_bytes,
            "extensions": dict(sorted(self.extensions.items())),
            "label_map": self.label_map,
            "label_counts": self.label_counts,
            "skipped": self.skipped,
            "shards": [s.to_json() for s in self.shards],
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1).encode("utf-8")

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Manifest:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not a shardstream manifest (no \"format\": \"{FORMAT_NAME}\")")
        version = doc.get("version")
        if version != FORMAT_VERSION:
            raise ManifestError(f"{where}: unknown manifest format version {version!r} (this shardstream reads {FORMAT_VERSION})")
        raw_shards = doc.get("shards")
        if not isinstance(raw_shards, list):
            raise ManifestError(f"{where}: 'shards' must be a list")
        shards = []
        seen: set[str] = set()
        for i, raw in enumerate(raw_shards):
            shard = _shard_from_json(raw, f"{where}: shard #{i}")
            if shard.path in seen:
                raise ManifestError(f"{where}: shard {shard.path!r} is listed twice")
            seen.add(shard.path)
            shards.append(shard)
        manifest = cls(
            shards=shards,
            extensions=dict(doc.get("extensions") or {}),
            label_map=doc.get("label_map"),
            label_counts=doc.get("label_counts"),
            skipped=doc.get("skipped") or {"count": 0, "items": []},
            created=doc.get("created", ""),
            shardstream_version=doc.get("shardstream_version", ""),
        )
        total = doc.get("total_samples")
        if total is not None and total != manifest.total_samples:
            raise ManifestError(
                f"{where}: total_samples says {total} but the shards add up to {manifest.total_samples}"
            )
        return manifest


def _shard_from_json(raw: Any, where: str) -> ShardInfo:
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: not an object")
    path, samples, size, offsets = raw.get("path"), raw.get("samples"), raw.get("bytes"), raw.get("offsets")
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where}: missing 'path'")
    where = f"{where} ({path})"
    if not _is_count(samples) or not _is_count(size):
        raise ManifestError(f"{where}: 'samples' and 'bytes' must be non-negative integers")
    packed = _offsets_from_json(offsets, samples, size, where, compressed=bool(shard_compression(path)))
    sha = raw.get("sha256")
    if sha is not None and not (isinstance(sha, str) and len(sha) == 64):
        raise ManifestError(f"{where}: 'sha256' must be 64 hex digits")
    return ShardInfo(path=path, samples=samples, bytes=size, sha256=sha, offsets=packed)


def _offsets_from_json(offsets: Any, samples: int, size: int, where: str, *, compressed: bool = False) -> array.array:
    """Checked offsets as one array.array("q"), validated with numpy, not a Python loop per sample.

    This runs for every shard before the first read, so its cost is per shard, not per sample:
    converting a JSON list of N ints to array("q") rejects non-integers in C (about 20 ns each),
    and one vectorised pass checks order and bounds. A JSON ``true``/``false`` would convert to
    1/0; in a strictly increasing non-negative sequence only the first two entries can be 0 or 1,
    so checking those two for bool is exact.
    """
    problem = f"{where}: 'offsets' must list samples + 1 = {samples + 1} byte offsets"
    if not isinstance(offsets, list) or len(offsets) != samples + 1:
        raise ManifestError(problem)
    try:
        packed = array.array("q", offsets)
    except (TypeError, OverflowError):
        raise ManifestError(problem) from None
    if any(type(o) is bool for o in offsets[:2]):
        raise ManifestError(problem)
    values = np.frombuffer(packed, dtype=np.int64)
    if values[0] < 0:
        raise ManifestError(problem)
    if samples and not bool((values[1:] > values[:-1]).all()):
        raise ManifestError(f"{where}: offsets are not strictly increasing")
    if values[-1] > size and not compressed:  # a compressed shard's offsets are in its decompressed stream
        raise ManifestError(f"{where}: offsets run to byte {values[-1]}, past the shard's {size} bytes")
    return packed


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def manifest_url(source: str) -> str:
    """Accept a dataset root or the manifest URL itself."""
    return source if source.rstrip("/").endswith(".json") else storage.join(source, MANIFEST_NAME)


def load_manifest(source: str, storage_options: Mapping[str, Any] | None = None, *,
                  config: StorageConfig = DEFAULT_STORAGE) -> Manifest:
    """Read and validate a manifest; shard paths resolve against its directory and may not leave
    it (see ``confine``). The read follows ``config``: timeouts, retries, resume mid-body."""
    url = manifest_url(source)
    try:
        raw = read_object(url, storage_options, config=config)
    except StorageNotFound as exc:
        root = url.rsplit("/", 1)[0] if "/" in url else "."
        raise ManifestError(
            f"{url}: cannot read the manifest (not found). Is this a packed dataset root? For tar shards written by other "
            f"tools, run `shardstream index '{root}/*.tar' {root}` once, or pass the shards themselves as a glob "
            f"('{root}/*.tar')"
        ) from exc
    except StorageError as exc:
        raise ManifestError(f"cannot read the manifest: {exc}") from exc
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{url}: not valid JSON ({exc})") from exc
    manifest = Manifest.from_json(doc, url)
    manifest.base_url = url.rsplit("/", 1)[0] if "/" in url else "."
    confine(manifest, url, config.allow_roots)
    return manifest


def _normal(url: str) -> str:
    """A URL or path with '.'/'..' segments resolved (``file://`` and local paths made absolute)."""
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}"
    return os.path.abspath(url)


def _under(url: str, root: str) -> bool:
    root = root.rstrip("/")
    return url == root or url.startswith(root + "/")


def confine(manifest: Manifest, where: str, allow_roots: tuple[str, ...] = ()) -> None:
    """Refuse shard entries that leave the manifest's directory: absolute paths, other schemes or
    buckets, and '..' that climbs out. A dataset on a bucket is data from whoever can write that
    bucket; it must not make a reader open ``/etc/passwd``. ``allow_roots`` names further URL
    prefixes the user trusts (datasets that span buckets).

    One exception: a manifest on local disk may name other local files by absolute path (what
    ``shardstream index`` writes for shards outside its destination); whoever can write that
    manifest can write local files anyway. A remote manifest never reaches local files."""
    base = _normal(manifest.base_url)
    local_manifest = "://" not in base
    roots = [base] + [_normal(r) for r in allow_roots]
    for i, shard in enumerate(manifest.shards):
        entry = shard.path
        absolute = "://" in entry or entry.startswith(("/", "~", "\\"))
        target = _normal(entry if absolute else storage.join(manifest.base_url, entry))
        if local_manifest and absolute and "://" not in target and not entry.startswith("~"):
            continue
        if not any(_under(target, root) for root in roots):
            raise ManifestError(
                f"{where}: shard #{i} {entry!r} points outside the dataset's root {base}/ "
                f"({'an absolute path or URL' if absolute else 'a path that climbs out with ..'}); shard entries "
                "must be relative paths under the manifest's directory. If the dataset really spans several "
                "locations, pass StorageConfig(allow_roots=(...)) (CLI: --allow-root) naming them"
            )
