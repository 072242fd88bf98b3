"""The manifest, ``index.json``: what a complete dataset holds, written last by the packer.

Its presence means the dataset is complete. Version 2 (written today) lists every shard with its
path relative to the manifest, sample count, byte size, sha256, the byte span its samples cover,
and the path of its offset sidecar (``format/offsets.py``): its size grows with shards, not
samples. Version 1 manifests (offsets inline, one list per shard) keep reading. Format:
docs/manifest.md.

In memory a manifest is columns (numpy arrays of counts, sizes and spans, a list of paths), so a
100,000-shard manifest is a few MB, and so is every copy pickled to a DataLoader worker. Per-sample
offsets are read through one accessor, ``Manifest.offsets(i)`` / ``Manifest.byte_range(i, a, b)``,
which fetch a shard's sidecar on first use into a bounded per-process cache; whole-shard ranges
need none.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from shardstream.errors import ManifestError, StorageError
from shardstream.format.offsets import OFFSET_CACHE, SUFFIX, check_offsets, decode_offsets, encode_offsets
from shardstream.storage import fs as storage

FORMAT_NAME = "shardstream-index"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
MANIFEST_NAME = "index.json"


@dataclass(frozen=True)
class ShardInfo:
    """One shard. ``offsets`` is held only by shards just written or scanned (before their
    sidecar exists); readers ask the manifest (``Manifest.offsets(i)``), never this field."""

    path: str  # relative to the manifest's directory (or an absolute URL)
    samples: int
    bytes: int
    sha256: str | None
    offsets: Sequence[int] | np.ndarray | None = None
    index: str | None = None  # sidecar path, relative like ``path`` (version 2)
    span: tuple[int, int] | None = None  # (first sample's header, end of the last sample's data)


def default_sidecar(path: str) -> str:
    return path + SUFFIX


class ShardTable(Sequence[ShardInfo]):
    """``manifest.shards``: a read-only view that builds a ShardInfo per access, not per shard.
    Its ShardInfos carry no offsets: ask ``Manifest.offsets(i)``."""

    def __init__(self, manifest: Manifest):
        self._m = manifest

    def __len__(self) -> int:
        return len(self._m.paths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        m = self._m
        i = range(len(m.paths))[i]  # negative indices, IndexError
        return ShardInfo(path=m.paths[i], samples=int(m.counts[i]), bytes=int(m.sizes[i]), sha256=m.sha256(i),
                         index=m.sidecar_path(i), span=(int(m.spans[i, 0]), int(m.spans[i, 1])))

    def __iter__(self) -> Iterator[ShardInfo]:
        for i in range(len(self)):
            yield self[i]


class Manifest:
    """A dataset's shards as compact columns plus its dataset-level fields."""

    def __init__(
        self,
        shards: Sequence[ShardInfo] = (),
        extensions: Mapping[str, int] | None = None,
        label_map: dict[str, int] | None = None,
        label_counts: dict[str, int] | None = None,
        skipped: dict[str, Any] | None = None,
        created: str = "",
        shardstream_version: str = "",
        base_url: str = "",  # directory the shard paths are relative to (set when loaded)
    ):
        self.extensions = dict(extensions or {})
        self.label_map = label_map
        self.label_counts = label_counts
        self.skipped = skipped if skipped is not None else {"count": 0, "items": []}
        self.created = created
        self.shardstream_version = shardstream_version
        self.base_url = base_url
        self.storage_options: dict[str, Any] = {}  # for sidecar reads (set when loaded)
        self.version = FORMAT_VERSION
        self._set_columns(list(shards))

    # -- columns -------------------------------------------------------------------------------
    def _set_columns(self, shards: list[ShardInfo]) -> None:
        n = len(shards)
        self.paths: list[str] = [s.path for s in shards]
        self.counts = np.fromiter((s.samples for s in shards), dtype=np.int64, count=n)
        self.sizes = np.fromiter((s.bytes for s in shards), dtype=np.int64, count=n)
        self._sha = np.zeros((n, 32), dtype=np.uint8)
        self._has_sha = np.zeros(n, dtype=bool)
        self.spans = np.zeros((n, 2), dtype=np.int64)
        self._inline: dict[int, np.ndarray] = {}
        sidecars: list[str | None] = []
        for i, s in enumerate(shards):
            if s.sha256:
                self._sha[i] = np.frombuffer(bytes.fromhex(s.sha256), dtype=np.uint8)
                self._has_sha[i] = True
            if s.offsets is not None:
                arr = np.asarray(s.offsets, dtype=np.int64)
                self._inline[i] = arr
                self.spans[i] = (arr[0], arr[-1])
            elif s.span is not None:
                self.spans[i] = s.span
            sidecars.append(s.index)
        # The usual sidecar is the shard's path plus ".idx": stored once, not per shard.
        self._sidecars: list[str | None] | None = (
            None if all(x is None or x == default_sidecar(p) for x, p in zip(sidecars, self.paths)) else sidecars
        )

    @property
    def shards(self) -> ShardTable:
        return ShardTable(self)

    @shards.setter
    def shards(self, shards: Sequence[ShardInfo]) -> None:
        self._set_columns(list(shards))

    def sha256(self, i: int) -> str | None:
        return bytes(self._sha[i]).hex() if self._has_sha[i] else None

    def sidecar_path(self, i: int) -> str:
        custom = self._sidecars[i] if self._sidecars is not None else None
        return custom if custom is not None else default_sidecar(self.paths[i])

    @property
    def total_samples(self) -> int:
        return int(self.counts.sum())

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    def _resolve(self, path: str) -> str:
        if "://" in path or path.startswith("/") or not self.base_url:
            return path
        return storage.join(self.base_url, path)

    def shard_url(self, index: int) -> str:
        return self._resolve(self.paths[index])

    def sidecar_url(self, index: int) -> str:
        return self._resolve(self.sidecar_path(index))

    # -- offsets ---------------------------------------------------------------------------------
    def offsets(self, i: int, storage_options: Mapping[str, Any] | None = None) -> np.ndarray:
        """Shard ``i``'s ``samples + 1`` byte offsets (int64): inline, cached, or one sidecar read."""
        inline = self._inline.get(i)
        if inline is not None:
            return inline
        url = self.sidecar_url(i)
        samples, size = int(self.counts[i]), int(self.sizes[i])
        options = storage_options if storage_options is not None else self.storage_options

        def load() -> np.ndarray:
            fs, path = storage.get_fs(url, options)
            try:
                data = storage.read_bytes(fs, path)
            except StorageError as exc:
                raise StorageError(f"{url}: cannot read the offset sidecar of {self.shard_url(i)} ({exc}); "
                                   "run `shardstream verify` on the dataset") from exc
            return decode_offsets(data, url, samples, size)

        sha = self.sha256(i) or f"{size}"
        return OFFSET_CACHE.get(f"{url}#{sha}", load)

    def byte_range(self, i: int, start: int, stop: int, storage_options: Mapping[str, Any] | None = None) -> tuple[int, int]:
        """Bytes ``[a, b)`` of shard ``i`` holding samples ``[start, stop)``; the whole shard needs no sidecar."""
        if start == 0 and stop == int(self.counts[i]):
            return int(self.spans[i, 0]), int(self.spans[i, 1])
        offsets = self.offsets(i, storage_options)
        return int(offsets[start]), int(offsets[stop])

    # -- writing ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        from shardstream import __version__

        shards = []
        for i, path in enumerate(self.paths):
            shards.append({"path": path, "samples": int(self.counts[i]), "bytes": int(self.sizes[i]),
                           "sha256": self.sha256(i), "span": [int(self.spans[i, 0]), int(self.spans[i, 1])],
                           "index": self.sidecar_path(i)})
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
            "shards": shards,
        }

    def dumps(self) -> bytes:
        # One line per shard: readable, and still O(shards).
        doc = self.to_json()
        shards = doc.pop("shards")
        head = json.dumps(doc, indent=1)[:-2]
        lines = ",\n  ".join(json.dumps(s) for s in shards)
        return (head + ',\n "shards": [\n  ' + lines + "\n ]\n}\n").encode("utf-8") if shards else \
            (head + ',\n "shards": []\n}\n').encode("utf-8")

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, doc: Any, where: str) -> Manifest:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not a shardstream manifest (no \"format\": \"{FORMAT_NAME}\")")
        version = doc.get("version")
        if version not in READ_VERSIONS or isinstance(version, bool):
            raise ManifestError(f"{where}: unknown manifest format version {version!r} (this shardstream reads "
                                f"versions {', '.join(map(str, READ_VERSIONS))}; upgrade shardstream)")
        raw_shards = doc.get("shards")
        if not isinstance(raw_shards, list):
            raise ManifestError(f"{where}: 'shards' must be a list")
        parse = _shard_from_json_v1 if version == 1 else _shard_from_json_v2
        shards = []
        seen: set[str] = set()
        for i, raw in enumerate(raw_shards):
            shard = parse(raw, f"{where}: shard #{i}")
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
        manifest.version = version
        total = doc.get("total_samples")
        if total is not None and total != manifest.total_samples:
            raise ManifestError(
                f"{where}: total_samples says {total} but the shards add up to {manifest.total_samples}"
            )
        return manifest


def _common_fields(raw: Any, where: str) -> tuple[str, int, int, str | None, str]:
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: not an object")
    path, samples, size = raw.get("path"), raw.get("samples"), raw.get("bytes")
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where}: missing 'path'")
    where = f"{where} ({path})"
    if not _is_count(samples) or not _is_count(size):
        raise ManifestError(f"{where}: 'samples' and 'bytes' must be non-negative integers")
    sha = raw.get("sha256")
    if sha is not None and not (isinstance(sha, str) and len(sha) == 64 and _is_hex(sha)):
        raise ManifestError(f"{where}: 'sha256' must be 64 hex digits")
    return path, samples, size, sha, where


def _shard_from_json_v1(raw: Any, where: str) -> ShardInfo:
    path, samples, size, sha, where = _common_fields(raw, where)
    offsets = raw.get("offsets")
    if not isinstance(offsets, list) or len(offsets) != samples + 1 or not all(_is_count(o) for o in offsets):
        raise ManifestError(f"{where}: 'offsets' must list samples + 1 = {samples + 1} byte offsets")
    problem = check_offsets(np.asarray(offsets, dtype=np.int64), samples, size)
    if problem is not None:
        raise ManifestError(f"{where}: {problem}")
    return ShardInfo(path=path, samples=samples, bytes=size, sha256=sha, offsets=offsets)


def _shard_from_json_v2(raw: Any, where: str) -> ShardInfo:
    path, samples, size, sha, where = _common_fields(raw, where)
    span, index = raw.get("span"), raw.get("index")
    if not (isinstance(span, list) and len(span) == 2 and _is_count(span[0]) and _is_count(span[1])
            and (span[0] < span[1] or (samples == 0 and span[0] <= span[1])) and span[1] <= size):
        raise ManifestError(f"{where}: 'span' must be [first sample's offset, end of the last sample], "
                            f"increasing and within the shard's {size} bytes")
    if not isinstance(index, str) or not index:
        raise ManifestError(f"{where}: 'index' must name the shard's offset sidecar")
    return ShardInfo(path=path, samples=samples, bytes=size, sha256=sha, index=index, span=(span[0], span[1]))


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def manifest_url(source: str) -> str:
    """Accept a dataset root or the manifest URL itself."""
    return source if source.rstrip("/").endswith(".json") else storage.join(source, MANIFEST_NAME)


def load_manifest(source: str, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """Read and validate a manifest; shard paths resolve against its directory."""
    url = manifest_url(source)
    fs, path = storage.get_fs(url, storage_options)
    try:
        raw = storage.read_bytes(fs, path)
    except StorageError as exc:
        raise ManifestError(f"{url}: cannot read the manifest ({exc}); is this a packed dataset root?") from exc
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{url}: not valid JSON ({exc})") from exc
    del raw
    manifest = Manifest.from_json(doc, url)
    manifest.base_url = url.rsplit("/", 1)[0] if "/" in url else "."
    manifest.storage_options = dict(storage_options or {})
    return manifest


def write_manifest(manifest: Manifest, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Publish ``manifest`` at ``url``: first a sidecar for every shard whose offsets it holds in
    memory (each written atomically), then the manifest itself, atomically, last: the commit."""
    fs, path = storage.get_fs(url, storage_options)
    base = url.rsplit("/", 1)[0] if "/" in url else "."
    if storage.is_local(fs):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for i, offsets in sorted(manifest._inline.items()):
        side = manifest.sidecar_path(i)
        side_url = side if ("://" in side or side.startswith("/")) else storage.join(base, side)
        side_fs, side_path = storage.get_fs(side_url, storage_options)
        if storage.is_local(side_fs):
            os.makedirs(os.path.dirname(os.path.abspath(side_path)), exist_ok=True)
        storage.write_bytes_atomic(side_fs, side_path, encode_offsets(offsets))
    storage.write_bytes_atomic(fs, path, manifest.dumps())
