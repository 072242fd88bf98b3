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

import array
import builtins
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from shardstream.errors import BucketNotFound, ConfigError, ManifestError, StorageError, StorageNotFound, restated
from shardstream.format.compression import SUFFIXES as COMPRESSED_SUFFIXES
from shardstream.format.compression import UNKNOWN_END, shard_compression
from shardstream.format.members import MEMBER_CACHE, REBUILD, MemberTable, decode_members, members_path
from shardstream.format.offsets import OFFSET_CACHE, SUFFIX, decode_offsets, encode_offsets, sidecar_size
from shardstream.storage import fs as storage
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.ranges import TooLarge, read_head, read_object
from shardstream.storage.urls import PATTERN_CHARS, canonical_url, is_shard_pattern
from shardstream.version import __version__

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
    tokens: int | None = None  # a token corpus's shard: the tokens its documents hold (format/tokens.py)
    members: builtins.bytes | None = None  # a just-scanned shard's member sidecar (format/members.py), before it is written
    member_bytes: int | None = None  # the size of its member sidecar, written already (by pack), or None


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
        return ShardInfo(
            path=m.paths[i],
            samples=int(m.counts[i]),
            bytes=int(m.sizes[i]),
            sha256=m.sha256(i),
            index=m.sidecar_path(i),
            span=(int(m.spans[i, 0]), int(m.spans[i, 1])),
            tokens=int(m.tokens[i]) if m.tokens is not None else None,
            member_bytes=int(m.member_bytes[i]) if m.member_bytes[i] >= 0 else None,
        )

    def __iter__(self) -> Iterator[ShardInfo]:
        for i in range(len(self)):
            yield self[i]


class Manifest:
    """A packed dataset's table of contents (its ``index.json``): every shard with its sample
    count, size and sha256, plus the dataset-level fields. Planning needs nothing else.

    Get one with ``load_manifest(root)`` (a dataset root or the URL of its ``index.json``; the
    manifest is checked as it loads), or take the one at hand: ``ShardStream(...).manifest`` (a
    mix's first source's), ``pack(...).manifest``, ``ShardWriter.manifest`` after ``close()``. A
    Manifest can be passed to ``ShardStream`` or ``Source`` in place of a URL.

    Shards, as columns in shard order (shard ``i`` at position ``i``): ``paths`` (list of str,
    relative to ``base_url`` unless absolute), ``counts`` (int64 array of samples per shard),
    ``sizes`` (int64 array of bytes per shard), ``spans`` (int64 array of shape (shards, 2): the
    byte where the first sample's header starts and the byte where the last sample's data ends),
    ``compressed`` (bool array: a ``.tar.gz``/``.tar.zst``/... shard, known by its suffix).
    ``shards`` is the same as one ``ShardInfo`` per shard, ``len(manifest.shards)`` the number of
    shards; ``sha256(i)`` is a shard's digest, ``shard_url(i)`` the URL to open it by;
    ``total_samples`` and ``total_bytes`` sum the columns.

    Dataset fields: ``base_url`` (the manifest's directory, set by ``load_manifest`` and by the
    writers; empty in one built with ``Manifest(...)``), ``storage_options`` (those it was loaded with, used to read offset
    sidecars), ``extensions`` (extension -> number of samples carrying it), ``label_map`` (class
    name -> ``cls`` value when labels came from folder names, else None), ``label_counts`` (class
    name -> samples, with ``label_map``), ``skipped`` (``{"count": n, "items": [...]}``: samples
    left out under ``on_error="skip"``, the first 100 listed with their ``source`` and ``error``),
    ``created`` (UTC time of writing) and ``shardstream_version`` (the version that wrote it),
    both as read from ``index.json``, and ``version`` (the format version it was read from, 1 or
    2; 2 when built in memory). The file format: docs/manifest.md.
    """

    kind: str | None = None  # the ``"kind"`` field of the JSON it is read from (None: a tar dataset's, with none)
    tokens: np.ndarray | None = None  # a token corpus's tokens per shard (int64), else None
    token_info: dict[str, Any] | None = None
    kinds: dict[str, type[Manifest]] = {}  # kind -> its subclass (``TableManifest``: format/parquet.py), each registered as defined

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind is not None:
            Manifest.kinds[cls.kind] = cls

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
        token_info: dict[str, Any] | None = None,  # a token corpus: its dtype, vocabulary, EOS id, tokenizer (format/tokens.py)
    ):
        self.token_info = dict(token_info) if token_info is not None else None
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
        inline: dict[int, np.ndarray] = {}
        spans = np.zeros((len(shards), 2), dtype=np.int64)
        for i, s in enumerate(shards):
            if s.offsets is not None:
                arr = np.asarray(s.offsets, dtype=np.int64)
                inline[i] = arr
                spans[i] = (arr[0], arr[-1])
            elif s.span is not None:
                spans[i] = s.span
        self._set_arrays(
            [s.path for s in shards],
            [s.samples for s in shards],
            [s.bytes for s in shards],
            [s.sha256 for s in shards],
            spans,
            [s.index for s in shards],
            inline,
        )
        self.tokens: np.ndarray | None = (
            np.array([s.tokens for s in shards], dtype=np.int64) if shards and all(s.tokens is not None for s in shards) else None
        )
        for i, s in enumerate(shards):
            if s.members is not None:
                self._inline_members[i] = s.members
                self.member_bytes[i] = len(s.members)
            elif s.member_bytes is not None:
                self.member_bytes[i] = s.member_bytes

    def _set_arrays(
        self,
        paths: list[str],
        counts: Sequence[int] | np.ndarray,
        sizes: Sequence[int] | np.ndarray,
        shas: list[str | None],
        spans: np.ndarray,
        sidecars: list[str | None] | None,
        inline: dict[int, np.ndarray],
    ) -> None:
        n = len(paths)
        self.paths = paths
        self.counts = np.asarray(counts, dtype=np.int64).reshape(n)
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(n)
        self._has_sha = np.fromiter((h is not None for h in shas), dtype=bool, count=n)
        zero = "0" * 64
        self._sha = np.frombuffer(bytes.fromhex("".join(h or zero for h in shas)), dtype=np.uint8).reshape(n, 32).copy()
        self.spans = np.asarray(spans, dtype=np.int64).reshape(n, 2)
        self._inline = inline
        suffixes = tuple(suffix for suffix, _ in COMPRESSED_SUFFIXES)  # str.endswith(tuple): a C loop
        self.compressed = np.fromiter((p.lower().endswith(suffixes) for p in paths), dtype=bool, count=n)
        # The usual sidecar is the shard's path plus ".idx": stored once, not per shard.
        self._sidecars: list[str | None] | None = (
            None if sidecars is None or all(x is None or x == default_sidecar(p) for x, p in zip(sidecars, paths)) else sidecars
        )
        # Each shard's member sidecar's size (format/members.py: ``shardstream index`` writes one
        # for the shards it can slice), -1 for none: such a shard is parsed.
        self.member_bytes = np.full(n, -1, dtype=np.int64)
        self._inline_members: dict[int, bytes] = {}

    @property
    def shards(self) -> ShardTable:
        """A read-only sequence of one ``ShardInfo`` per shard (``path``, ``samples``, ``bytes``,
        ``sha256``, ``index``: its sidecar path, ``span``), built on access from the columns.
        Its ``offsets`` are None: ask ``offsets(i)``."""
        return ShardTable(self)

    @shards.setter
    def shards(self, shards: Sequence[ShardInfo]) -> None:
        self._set_columns(list(shards))

    def sha256(self, i: int) -> str | None:
        """Shard ``i``'s sha256 as 64 hex digits, or None when the manifest has none for it."""
        return bytes(self._sha[i]).hex() if self._has_sha[i] else None

    def sidecar_path(self, i: int) -> str:
        """Where shard ``i``'s offset sidecar is, relative like its path (by default the path + ``.idx``)."""
        custom = self._sidecars[i] if self._sidecars is not None else None
        return custom if custom is not None else default_sidecar(self.paths[i])

    @property
    def total_samples(self) -> int:
        """Samples in the whole dataset (the sum of ``counts``)."""
        return int(self.counts.sum())

    @property
    def total_tokens(self) -> int | None:
        """Tokens of a token corpus (packed with a tokenizer), None for other datasets."""
        return int(self.tokens.sum()) if self.tokens is not None else None

    @property
    def total_bytes(self) -> int:
        """Bytes of all the shards (the sum of ``sizes``; sidecars and the manifest not counted)."""
        return int(self.sizes.sum())

    def resolve(self, path: str) -> str:
        """A path of this dataset (a shard's, a sidecar's, a directory of them) as the URL or path to
        open it by: joined to ``base_url`` (an absolute one, or any path without a base, as is)."""
        if "://" in path or path.startswith("/") or not self.base_url:
            return path
        return storage.join(self.base_url, path)

    def shard_url(self, index: int) -> str:
        """The URL or path to open shard ``index`` by: its path joined to ``base_url`` (an absolute one as is)."""
        return self.resolve(self.paths[index])

    def sidecar_url(self, index: int) -> str:
        """The URL or path of shard ``index``'s offset sidecar, resolved like ``shard_url``."""
        return self.resolve(self.sidecar_path(index))

    def members_url(self, index: int) -> str:
        """The URL or path of shard ``index``'s member sidecar (beside its offset sidecar)."""
        return self.resolve(members_path(self.sidecar_path(index)))

    def member_table(
        self, i: int, storage_options: Mapping[str, Any] | None = None, *, config: StorageConfig = DEFAULT_STORAGE, counters: Any = None
    ) -> MemberTable | None:
        """Shard ``i``'s member table (format/members.py), or None when it has none (it is parsed):
        one read of its sidecar per process (cached), checked against this manifest's entry."""
        expected = int(self.member_bytes[i])
        if expected < 0:
            return None
        url, shard = self.members_url(i), self.shard_url(i)
        samples, size, sha = int(self.counts[i]), int(self.sizes[i]), self.sha256(i)
        options = storage_options if storage_options is not None else self.storage_options
        inline = self._inline_members.get(i)

        def load() -> MemberTable:
            if inline is not None:
                data = inline
            else:
                try:
                    data = read_head(url, expected + 1, options, config=config, counters=counters)  # one GET; one byte more shows a longer file
                except StorageError as exc:
                    raise restated(
                        exc,
                        # (a missing one needs rebuilding; a timeout or a denied read says its own advice)
                        f"{url}: cannot read the member sidecar of {shard} ({exc})" + (f"; {REBUILD}" if isinstance(exc, StorageNotFound) else ""),
                    ) from exc
            return decode_members(data, url, shard, samples, size, sha, expected)

        return MEMBER_CACHE.get(f"{url}#{sha or size}#{expected}", load)

    # -- offsets ---------------------------------------------------------------------------------
    def offsets(
        self, i: int, storage_options: Mapping[str, Any] | None = None, *, config: StorageConfig = DEFAULT_STORAGE, counters: Any = None
    ) -> np.ndarray:
        """Shard ``i``'s ``samples + 1`` byte offsets (int64): inline, cached, or one sidecar read
        (under ``config``'s timeouts, retries and deadline, counted in ``counters``)."""
        inline = self._inline.get(i)
        if inline is not None:
            return inline
        url = self.sidecar_url(i)
        samples, size = int(self.counts[i]), int(self.sizes[i])
        if self.compressed[i]:
            size = UNKNOWN_END  # offsets count decompressed bytes: no bound from the object's size
        options = storage_options if storage_options is not None else self.storage_options

        def load() -> np.ndarray:
            try:
                # A range of one byte more than expected: one GET and no HEAD first, under the
                # retry policy (in a DataLoader worker, through the same client as the shards'
                # bytes), and a sidecar too long still shows.
                data = read_head(url, sidecar_size(samples) + 1, options, config=config, counters=counters)
            except StorageError as exc:  # its own class (AccessDenied, StorageNotFound, ...), said with the shard
                raise restated(
                    exc, f"{url}: cannot read the offset sidecar of {self.shard_url(i)} ({exc}); run `shardstream verify` on the dataset"
                ) from exc
            return decode_offsets(data, url, samples, size)

        sha = self.sha256(i) or f"{size}"
        return OFFSET_CACHE.get(f"{url}#{sha}", load)

    def byte_range(
        self,
        i: int,
        start: int,
        stop: int,
        storage_options: Mapping[str, Any] | None = None,
        *,
        config: StorageConfig = DEFAULT_STORAGE,
        counters: Any = None,
    ) -> tuple[int, int]:
        """Bytes ``[a, b)`` of shard ``i`` holding samples ``[start, stop)``; the whole shard needs no
        sidecar, a range inside it reads the sidecar (``offsets``) under ``config``."""
        if start == 0 and stop == int(self.counts[i]):
            return int(self.spans[i, 0]), int(self.spans[i, 1])
        table = self.member_table(i, storage_options, config=config, counters=counters)  # (holds the offsets: no second sidecar read)
        offsets = table.offsets if table is not None else self.offsets(i, storage_options, config=config, counters=counters)
        return int(offsets[start]), int(offsets[stop])

    # -- writing ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The manifest as a version-2 JSON document (a dict), as ``index.json`` holds it."""
        doc: dict[str, Any] = {
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
            "shards": {  # columns: one list per field, shard i at position i in each
                "path": list(self.paths),
                "samples": self.counts.tolist(),
                "bytes": self.sizes.tolist(),
                "sha256": [self.sha256(i) for i in range(len(self.paths))],
                "data_start": self.spans[:, 0].tolist(),
                "data_end": self.spans[:, 1].tolist(),
                "index": None if self._sidecars is None else [self.sidecar_path(i) for i in range(len(self.paths))],
            },
        }
        if bool((self.member_bytes >= 0).any()):  # (absent from manifests without member sidecars, and ignored by older readers)
            doc["shards"]["members"] = [int(b) if b >= 0 else None for b in self.member_bytes.tolist()]
        if self.tokens is not None:  # a token corpus: tokens per shard, what they are (format/tokens.py)
            doc["total_tokens"] = self.total_tokens
            doc["tokens"] = self.token_info or {}
            doc["shards"]["tokens"] = self.tokens.tolist()
        return doc

    def dumps(self) -> bytes:
        """``to_json()`` as the UTF-8 bytes of ``index.json``."""
        # One line per field and per column: readable at the top, compact below.
        doc = self.to_json()
        columns = doc.pop("shards")
        head = json.dumps(doc, indent=1)[:-2]
        body = ",\n  ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in columns.items())
        return (head + ',\n "shards": {\n  ' + body + "\n }\n}\n").encode("utf-8")

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, doc: Any, where: str) -> Manifest:
        """Check and read a parsed ``index.json`` (version 1 or 2); ManifestError names ``where`` and
        what is wrong. Sets no ``base_url``: ``load_manifest`` does, and also confines the paths."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f'{where}: not a shardstream manifest (no "format": "{FORMAT_NAME}")')
        version = doc.get("version")
        if version not in READ_VERSIONS or isinstance(version, bool):
            raise ManifestError(
                f"{where}: unknown manifest format version {version!r} (this shardstream reads "
                f"versions {', '.join(map(str, READ_VERSIONS))}; upgrade shardstream)"
            )
        manifest = cls(
            extensions=dict(doc.get("extensions") or {}),
            label_map=doc.get("label_map"),
            label_counts=doc.get("label_counts"),
            skipped=doc.get("skipped") or {"count": 0, "items": []},
            created=doc.get("created", ""),
            shardstream_version=doc.get("shardstream_version", ""),
        )
        manifest.version = version
        if version == 1:
            _read_shards_v1(manifest, doc.get("shards"), where)
        else:
            _read_shards_v2(manifest, doc.get("shards"), where)
        if len(set(manifest.paths)) != len(manifest.paths):
            seen: set[str] = set()
            for path in manifest.paths:
                if path in seen:
                    raise ManifestError(f"{where}: shard {path!r} is listed twice")
                seen.add(path)
        total = doc.get("total_samples")
        if total is not None and total != manifest.total_samples:
            raise ManifestError(f"{where}: total_samples says {total} but the shards add up to {manifest.total_samples}")
        if version == 2 and isinstance(doc.get("shards"), dict) and "tokens" in doc["shards"]:
            _read_tokens(manifest, doc, where)
        return manifest


def _read_shards_v1(manifest: Manifest, raw_shards: Any, where: str) -> None:
    """Version 1: a list of shard objects, each with its offsets inline."""
    if not isinstance(raw_shards, list):
        raise ManifestError(f"{where}: 'shards' must be a list")
    shards = []
    for i, raw in enumerate(raw_shards):
        w = f"{where}: shard #{i}"
        if not isinstance(raw, dict):
            raise ManifestError(f"{w}: not an object")
        path, samples, size = raw.get("path"), raw.get("samples"), raw.get("bytes")
        if not isinstance(path, str) or not path:
            raise ManifestError(f"{w}: missing 'path'")
        w = f"{w} ({path})"
        if not _is_count(samples) or not _is_count(size):
            raise ManifestError(f"{w}: 'samples' and 'bytes' must be non-negative integers")
        sha = raw.get("sha256")
        if sha is not None and not _is_sha(sha):
            raise ManifestError(f"{w}: 'sha256' must be 64 hex digits")
        packed = _offsets_from_json(raw.get("offsets"), samples, size, w, compressed=bool(shard_compression(path)))
        shards.append(ShardInfo(path=path, samples=samples, bytes=size, sha256=sha, offsets=np.frombuffer(packed, dtype=np.int64)))
    manifest._set_columns(shards)


def _read_shards_v2(manifest: Manifest, cols: Any, where: str) -> None:
    """Version 2: columns, checked a whole column at a time (100,000 shards in milliseconds)."""
    if not isinstance(cols, dict):
        raise ManifestError(f"{where}: 'shards' must be an object of columns (path, samples, bytes, ...)")
    paths = cols.get("path")
    if not isinstance(paths, list):
        raise ManifestError(f"{where}: 'shards.path' must be a list")
    n = len(paths)
    names = ("samples", "bytes", "sha256", "data_start", "data_end")
    for name in names:
        if not isinstance(cols.get(name), list) or len(cols[name]) != n:
            raise ManifestError(f"{where}: 'shards.{name}' must be a list of {n} entries, one per shard")

    def bad(i: int, what: str) -> ManifestError:
        return ManifestError(f"{where}: shard #{i} ({paths[i]!r}): {what}")

    # Type checks as set(map(type, column)): C loops, not a Python frame per shard.
    if n and (set(map(type, paths)) != {str} or not all(paths)):
        i = next(i for i, p in enumerate(paths) if not (isinstance(p, str) and p))
        raise ManifestError(f"{where}: shard #{i}: missing 'path'")
    ints = {}
    for name in ("samples", "bytes", "data_start", "data_end"):
        column = cols[name]
        if n and set(map(type, column)) != {int}:  # bool is not int here: type(True) is bool
            i = next(i for i, x in enumerate(column) if type(x) is not int)
            raise bad(i, f"'{name}' must be a non-negative integer")
        try:
            ints[name] = np.array(column, dtype=np.int64)
        except OverflowError:
            raise ManifestError(f"{where}: 'shards.{name}' holds a number beyond 64 bits") from None
        if n and ints[name].min() < 0:
            raise bad(int(ints[name].argmin()), f"'{name}' must be a non-negative integer")
    counts, sizes, first, end = ints["samples"], ints["bytes"], ints["data_start"], ints["data_end"]
    # A compressed shard's offsets are in its decompressed stream, so they may run past its size.
    suffixes = tuple(suffix for suffix, _ in COMPRESSED_SUFFIXES)
    compressed = np.fromiter((p.lower().endswith(suffixes) for p in paths), dtype=bool, count=n)
    wrong = (first > end) | ((end > sizes) & ~compressed) | ((first == end) & (counts > 0))
    del compressed
    if wrong.any():
        i = int(np.argmax(wrong))
        raise bad(i, f"data span [{first[i]}, {end[i]}) must be increasing and within the shard's {sizes[i]} bytes")
    shas = cols["sha256"]
    present = [h for h in shas if h is not None]
    if not (set(map(type, present)) <= {str} and set(map(len, present)) <= {64} and _is_hex("".join(present))):
        i = next(i for i, h in enumerate(shas) if not (h is None or _is_sha(h)))
        raise bad(i, "'sha256' must be 64 hex digits")
    sidecars = cols.get("index")
    if sidecars is not None and not (isinstance(sidecars, list) and len(sidecars) == n and all(isinstance(x, str) and x for x in sidecars)):
        raise ManifestError(f"{where}: 'shards.index' must be null (each shard's sidecar is its path + '{SUFFIX}') or a list of {n} sidecar paths")
    manifest._set_arrays(paths, counts, sizes, shas, np.stack([first, end], axis=1), sidecars, {})
    members = cols.get("members")
    if members is not None:
        if not (isinstance(members, list) and len(members) == n and all(x is None or (type(x) is int and x > 0) for x in members)):
            raise ManifestError(f"{where}: 'shards.members' must be a list of {n} entries, each a member sidecar's size in bytes or null")
        manifest.member_bytes = np.array([-1 if x is None else x for x in members], dtype=np.int64)


def _read_tokens(manifest: Manifest, doc: dict[str, Any], where: str) -> None:
    """A token corpus's columns: tokens per shard (non-negative integers), their total and what they are."""
    column = doc["shards"]["tokens"]
    n = len(manifest.paths)
    if not isinstance(column, list) or len(column) != n or (n and set(map(type, column)) != {int}) or any(t < 0 for t in column):
        raise ManifestError(f"{where}: 'shards.tokens' must be a list of {n} non-negative integers, one per shard")
    info = doc.get("tokens")
    if not isinstance(info, dict):
        raise ManifestError(f"{where}: a token corpus's 'tokens' must be an object (dtype, vocab_size, eos_id, tokenizer)")
    manifest.tokens = np.array(column, dtype=np.int64)
    manifest.token_info = dict(info)
    total = doc.get("total_tokens")
    if total is not None and total != manifest.total_tokens:
        raise ManifestError(f"{where}: total_tokens says {total} but the shards add up to {manifest.total_tokens}")


def _offsets_from_json(offsets: Any, samples: int, size: int, where: str, *, compressed: bool = False) -> array.array:
    """Checked version-1 offsets as one array.array("q"), validated with numpy, not a Python loop per sample.

    Converting a JSON list of N ints to array("q") rejects non-integers in C (about 20 ns each),
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


def _is_sha(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and _is_hex(value)


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


def dataset_root_problem(url: str) -> str | None:
    """Why ``url`` cannot be a dataset root (a place to write a dataset and read it back by the
    same URL), or None when it can. The reader's own rule (``storage.urls.is_shard_pattern``)
    decides what names shards rather than a dataset root; fsspec's URL chaining (``::``) is
    refused as well: a name appended to a chained URL lands in its last link, while the files are
    opened at the first link's path (``s3://b/p/a::b`` would put the shards under ``p/a/`` and
    the manifest *as* the object ``p/a``)."""
    if "::" in url:
        return (
            "'::' chains filesystems in an fsspec URL (as in 'simplecache::s3://...'): the shards would be "
            "written under the path before '::' and the manifest over that path itself, so the dataset could "
            "not be read back; use a plain URL without '::'"
        )
    if is_shard_pattern(url):
        char = next((c for c in PATTERN_CHARS if c in url), None)
        if char is not None:
            return (
                f"{char!r} makes the reader take the URL as a shard pattern (glob or brace expansion), "
                "not a dataset root, so ShardStream could not read the dataset back; use a path without any of "
                f"{' '.join(PATTERN_CHARS)}"
            )
        return (
            "it ends like a tar shard's name, so the reader would take it as one shard file, not a "
            "dataset root; choose a folder name without a tar suffix"
        )
    return None


def check_dataset_root(url: str, what: str = "destination") -> None:
    """Raise ConfigError when ``url`` (a dataset root, or its manifest's URL) cannot be a dataset
    root (``dataset_root_problem``): writers call it before they write anything."""
    problem = dataset_root_problem(url)
    if problem is not None:
        raise ConfigError(f"{what} {url!r} cannot be a dataset root: {problem}")


def load_manifest(source: str, storage_options: Mapping[str, Any] | None = None, *, config: StorageConfig = DEFAULT_STORAGE) -> Manifest:
    """Read and check a dataset's manifest. ``source``: the dataset root (``index.json`` is read
    there) or the manifest's own URL (ending in ``.json``), a local path or any fsspec URL;
    ``storage_options``: fsspec's options for it. Shard paths resolve against the manifest's
    directory and may not leave it (``StorageConfig(allow_roots=...)`` names further trusted
    prefixes). The read follows ``config``: timeouts, retries, resume mid-body. A manifest missing,
    unreadable or invalid raises ManifestError."""
    if "::" in source:  # the writers' rule (dataset_root_problem), on the reader's side too
        raise ConfigError(f"{source!r} cannot be a dataset root: {dataset_root_problem(source)}")
    storage.check_url(source)  # (before index.json is joined to it)
    url = manifest_url(source)
    try:
        raw = _read_manifest(url, storage_options, config)
    except BucketNotFound as exc:  # no dataset root without a bucket: say so, as pack does
        raise restated(exc, f"cannot read the manifest: {exc}", ManifestError) from exc
    except StorageNotFound as exc:
        root = url.rsplit("/", 1)[0] if "/" in url else "."
        raise restated(
            exc,
            f"{url}: cannot read the manifest (not found). Is this a packed dataset root? For a folder of files (an "
            f"ImageFolder tree), run `shardstream pack {root} DEST` and read DEST; for tar shards written by other "
            f"tools, run `shardstream index '{root}/*.tar' DEST` once and read DEST (a folder of its own: your shard "
            f"folder stays as it is), or index them at each start with ShardStream.from_urls('{root}/*.tar', ...)",
            ManifestError,
        ) from exc
    except StorageError as exc:  # each is both a ManifestError and its storage class (AccessDenied, ...)
        raise restated(exc, f"cannot read the manifest: {exc}", ManifestError) from exc
    doc = parse_json(raw, url)
    del raw
    kind = Manifest.kinds.get(str(doc.get("kind"))) if isinstance(doc, dict) else None  # a Parquet table's: format/parquet.py
    manifest = (kind or Manifest).from_json(doc, url)
    manifest.base_url = url.rsplit("/", 1)[0] if "/" in url else "."
    manifest.storage_options = dict(storage_options or {})
    confine(manifest, url, config.allow_roots)
    return manifest


MAX_DEPTH = 64  # nesting of a manifest's JSON: 4 is what shardstream writes
_QUOTE, _BACKSLASH = 2, 3
_JSON_MARKS = np.zeros(256, dtype=np.int8)  # per byte: 1 opens, -1 closes, a quote, a backslash, 0 nothing to see
_JSON_MARKS[[ord("["), ord("{")]] = 1
_JSON_MARKS[[ord("]"), ord("}")]] = -1
_JSON_MARKS[ord('"')], _JSON_MARKS[ord("\\")] = _QUOTE, _BACKSLASH


def _read_manifest(url: str, storage_options: Mapping[str, Any] | None, config: StorageConfig) -> bytes:
    """The manifest's bytes, at most ``config.max_manifest_bytes`` of them: a larger one is refused
    once its size is known, before the rest is read or parsed."""
    try:
        return read_object(url, storage_options, config=config, limit=config.max_manifest_bytes)
    except TooLarge as exc:
        raise ManifestError(
            f"{url}: the manifest is {exc.size:,} bytes{' or more' if exc.size == exc.limit + 1 else ''}, more than the "
            f"{exc.limit:,} read (StorageConfig.max_manifest_bytes). Raise it for a manifest this large that you trust; a "
            "version-1 manifest shrinks with `shardstream index --upgrade`"
        ) from None


def nesting_depth(raw: bytes | str) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not count),
    found without recursion, in linear time (numpy): the quotes that open and close strings are
    those not escaped by an odd run of backslashes, and a bracket counts when an even number of
    them come before it. A text with at most ``MAX_DEPTH`` brackets is not looked at closer: their
    number is returned, a bound. (Past a stray character the count may differ from the parser's
    view, but the parser stops there: it never goes deeper than the depth found before it.)"""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    brackets = data.count(b"[") + data.count(b"{")
    if brackets <= MAX_DEPTH:
        return brackets
    a = np.frombuffer(data, dtype=np.uint8)
    where = np.flatnonzero(_JSON_MARKS[a])  # every bracket, quote and backslash, in one pass
    marks = _JSON_MARKS[a[where]]
    quotes = where[marks == _QUOTE]
    slashes = where[marks == _BACKSLASH]
    if len(slashes):
        starts = np.ones(len(slashes), dtype=bool)
        starts[1:] = slashes[1:] != slashes[:-1] + 1
        run_start = slashes[np.maximum.accumulate(np.where(starts, np.arange(len(slashes)), 0))]
        before = np.minimum(np.searchsorted(slashes, quotes - 1), len(slashes) - 1)
        escaped = (slashes[before] == quotes - 1) & ((quotes - run_start[before]) % 2 == 1)
        quotes = quotes[~escaped]
    bracket = (marks == 1) | (marks == -1)
    outside = np.searchsorted(quotes, where[bracket]) % 2 == 0  # an even number of quotes before it: not in a string
    steps = marks[bracket][outside]
    return max(0, int(np.cumsum(steps, dtype=np.int64).max(initial=0)))


def parse_json(raw: bytes | str, url: str) -> Any:
    """The manifest's JSON document. Malformed text, and nesting deeper than ``MAX_DEPTH`` (checked
    before the parser's recursion sees it; its RecursionError too), are a ManifestError naming ``url``."""
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise ManifestError(f"{url}: not a manifest: its JSON nests {depth} levels deep, more than the {MAX_DEPTH} allowed")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{url}: not valid JSON ({exc})") from exc
    except RecursionError:
        raise ManifestError(f"{url}: not a manifest: its JSON nests too deep to parse") from None


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
    base = canonical_url(manifest.base_url)
    local_manifest = "://" not in base
    roots = [base] + [canonical_url(r) for r in allow_roots]
    for i, entry in ((k, e) for k in range(len(manifest.paths)) for e in (manifest.paths[k], manifest.sidecar_path(k))):
        absolute = "://" in entry or entry.startswith(("/", "~", "\\"))
        target = canonical_url(entry if absolute else storage.join(manifest.base_url, entry))
        if local_manifest and absolute and "://" not in target and not entry.startswith("~"):
            continue
        if not any(_under(target, root) for root in roots):
            raise ManifestError(
                f"{where}: shard #{i} {entry!r} points outside the dataset's root {base}/ "
                f"({'an absolute path or URL' if absolute else 'a path that climbs out with ..'}); shard entries "
                "must be relative paths under the manifest's directory. If the dataset really spans several "
                "locations, pass StorageConfig(allow_roots=(...)) (CLI: --allow-root) naming them"
            )


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
    for i, table in sorted(manifest._inline_members.items()):
        side = members_path(manifest.sidecar_path(i))
        side_url = side if ("://" in side or side.startswith("/")) else storage.join(base, side)
        side_fs, side_path = storage.get_fs(side_url, storage_options)
        storage.write_bytes_atomic(side_fs, side_path, table)
    # what index.json will say, the object written says too (``pack(...).manifest.created``)
    manifest.shardstream_version = manifest.shardstream_version or __version__
    manifest.created = manifest.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    storage.write_bytes_atomic(fs, path, manifest.dumps())
