"""ShardWriter: samples in, uniform WebDataset tar shards plus the manifest out.

Shards are named ``{prefix}-{index:06d}.tar`` (``shard_name``; with ``prefixes=N`` under one of N
directories, shard i in ``i mod N``) and rolled by sample count and byte size. Members of
a sample are adjacent and sorted; headers are deterministic, so the same samples give the same
bytes. Each shard is published atomically (temp file then rename, or one S3 upload), and the
manifest is written last, only when the writer closes without an error: an interrupted pack leaves
nothing that looks complete.

While a pack runs, its destination holds a marker (``PACK_MARKER``), written before the first
shard and removed once the manifest is written: whatever stops the pack (an error, Ctrl-C, kill -9,
a lost machine), the shards it left read as an unfinished pack (``interrupted_pack``), which
``shardstream index`` and ``ls`` refuse to take for a dataset ("run pack again to complete it").
A pack (a ``with ShardWriter`` block) that fails with an error removes the destination it made
(a local folder that did not exist, an S3 prefix that held no object) with everything it wrote
there; a destination that existed before keeps the shards written so far beside the marker (pack
again to complete it), or loses the marker too where no shard was written.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, BinaryIO

from shardstream.errors import AccessDenied, ConfigError, DestinationError, ManifestError, SourceError
from shardstream.format.manifest import MANIFEST_NAME, Manifest, ShardInfo, check_dataset_root, write_manifest
from shardstream.format.offsets import SUFFIX as SIDECAR_SUFFIX
from shardstream.format.offsets import encode_offsets
from shardstream.format.tar import END_OF_ARCHIVE
from shardstream.sidecar import MEMBERS_SUFFIX, MemberLog
from shardstream.storage import fs as storage
from shardstream.storage.classify import release_frames
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.write.encode import check_key, encode_sample
from shardstream.write.limits import DEFAULT_MAX_COUNT, DEFAULT_MAX_SIZE
from shardstream.write.members import encode_members

logger = logging.getLogger(__name__)

MAX_SKIPPED_LISTED = 100
_FLUSH_BYTES = 1 << 20
_PARTIAL_MARK = ".partial-"
PACK_MARKER = ".shardstream-packing"  # in the destination while a pack runs: removed once its manifest is written


def shard_name(stem: str, index: int, prefixes: int = 1) -> str:
    """Shard ``index``'s path under the dataset root: ``{stem}-{index:06d}.tar``, or with
    ``prefixes`` N > 1 that name under the directory ``index mod N``, zero-padded to the digits of
    N - 1 (N = 16: ``00/shard-000000.tar``, ``01/shard-000001.tar``, ..., ``15/...``,
    ``00/shard-000016.tar``). Consecutive shards land on different S3 prefixes, each with its own
    request rate; the manifest lists the paths, so readers find them wherever they are."""
    name = f"{stem}-{index:06d}.tar"
    if prefixes <= 1:
        return name
    return f"{index % prefixes:0{len(str(prefixes - 1))}d}/{name}"


def _is_leftover(name: str) -> bool:
    """A file of an interrupted pack that is no shard: a shard's temporary file (``.partial-``), a
    sidecar's or the manifest's (``write_bytes_atomic``'s ``.tmp-``), or the pack's marker."""
    return _PARTIAL_MARK in name or ".tmp-" in name or name == PACK_MARKER


def interrupted_pack(
    url: str, storage_options: Mapping[str, Any] | None = None, *, config: StorageConfig = DEFAULT_STORAGE, entries: list[str] | None = None
) -> str | None:
    """What shows that the folder ``url`` holds an unfinished pack (its marker, or a temporary file
    of a shard, sidecar or manifest), or None. ``entries``: the folder's names, when already listed
    (else one listing, under ``config``'s retry policy; a folder that does not exist holds none)."""
    if entries is None:
        if url.split("://", 1)[0] in ("http", "https", "hf"):  # no pack writes there
            return None

        def names(fs: Any, path: str) -> list[str]:
            try:
                return [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=False, refresh=True)]
            except (FileNotFoundError, NotADirectoryError):
                return []

        try:
            entries = storage.storage_call(url, names, storage_options, config)
        except AccessDenied:  # credentials that may read objects but not list them: nothing to tell
            return None
    names_ = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
    if PACK_MARKER in names_:
        return f"the marker {PACK_MARKER} of a pack that has not finished"
    leftover = next((e for e in names_ if _is_leftover(e)), None)
    if leftover is not None:
        return f"{leftover!r}, a temporary file of a pack that has not finished"
    return None


def refuse_interrupted_pack(
    url: str, storage_options: Mapping[str, Any] | None = None, *, config: StorageConfig = DEFAULT_STORAGE, entries: list[str] | None = None
) -> None:
    """Raise ManifestError when the folder ``url`` holds an unfinished pack (``interrupted_pack``):
    its shards are part of a dataset, and a manifest over them would train as if complete."""
    evidence = interrupted_pack(url, storage_options, config=config, entries=entries)
    if evidence is not None:
        raise ManifestError(
            f"{url} holds the shards of an interrupted pack ({evidence}), not a finished dataset: "
            "run pack again to complete it (same source and destination; no --overwrite needed)"
        )


class ShardWriter:
    """Write samples into tar shards under ``dest`` (a local directory or any fsspec URL).

    Use it as a context manager:

    ```python
    with ShardWriter("s3://bucket/train", max_count=1000) as writer:
        writer.write({"__key__": "cat/0001", "jpg": image, "cls": 3})
    ```

    ``dest`` must be a URL the reader takes as a dataset root (``format.manifest.dataset_root_problem``):
    no ``::`` (fsspec chaining), no ``* ? [ {`` (shard patterns), no tar suffix; ConfigError otherwise.
    ``overwrite=False`` refuses a destination that already holds a dataset or other files; a
    destination holding only the leftovers of an interrupted pack is cleaned and reused.

    ``config`` (``StorageConfig``): the storage policy. The destination check made here (one
    listing of the bucket) runs under shardstream's retry policy, bounded by ``config.deadline``
    (and ``config.max_attempts``, if set); each upload (a shard, a sidecar, the manifest) is retried
    by botocore's standard retry mode, up to ``config.upload_attempts`` tries, with ``config``'s timeouts.
    """

    def __init__(
        self,
        dest: str,
        *,
        max_count: int = DEFAULT_MAX_COUNT,
        max_size: int = DEFAULT_MAX_SIZE,
        prefix: str = "shard",
        storage_options: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        label_map: Mapping[str, int] | None = None,
        check_unique_keys: bool = True,
        prefixes: int = 1,
        config: StorageConfig = DEFAULT_STORAGE,
        token_info: Mapping[str, Any] | None = None,
    ):
        if max_count < 1:
            raise ConfigError(f"max_count must be >= 1, got {max_count}")
        if max_size < 1024:
            raise ConfigError(f"max_size must be at least 1 KB, got {max_size}")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", prefix):
            raise ConfigError(f"prefix {prefix!r} must be a plain file-name stem")
        if not isinstance(prefixes, int) or isinstance(prefixes, bool) or prefixes < 1:
            raise ConfigError(f"prefixes must be an integer >= 1 (directories the shards are spread over), got {prefixes!r}")
        self.prefixes = prefixes
        check_dataset_root(dest)  # what the reader could not read back is refused before anything is written
        self.dest = dest.rstrip("/") or dest
        self.max_count = max_count
        self.max_size = max_size
        self.prefix = prefix
        self.label_map = dict(label_map) if label_map is not None else None
        self.storage_options = dict(storage_options or {})
        self.config = config
        self.fs, self.root = storage.get_fs(self.dest, storage_options, config)
        self._local = storage.is_local(self.fs)
        self._shard_re = re.compile(re.escape(prefix) + r"-\d{6}\.tar(" + re.escape(SIDECAR_SUFFIX) + "|" + re.escape(MEMBERS_SUFFIX) + ")?")
        self._created = False  # set by _prepare_destination: the destination did not exist (no object under it)
        self._stale = self._prepare_destination(overwrite)
        self._mark_in_progress()
        if not self._local:
            reclaim_temp_partials()
        self.shards: list[ShardInfo] = []
        self.extensions: dict[str, int] = {}
        self.skipped: list[dict[str, str]] = []
        self.skipped_count = 0
        self.samples_written = 0
        self.bytes_written = 0
        self._label_counts: dict[int, int] = {}
        self._keys: set[str] | None = set() if check_unique_keys else None
        self._file: BinaryIO | None = None
        self._noted = MemberLog()  # a sample's members as ``encode_members`` notes them, before they are placed
        self._tmp_path: str | None = None
        self._closed = False
        self.manifest: Manifest | None = None  # set by close(): the one manifest of this dataset
        # A token corpus (write/tokens.py): each sample's tokens counted per shard, in the manifest.
        self.token_info = dict(token_info) if token_info is not None else None
        self.tokens_written = 0

    # -- destination ---------------------------------------------------------------------------
    def _prepare_destination(self, overwrite: bool) -> list[str]:
        """Refuse or clean the destination; returns old shard paths to delete once we succeed.
        Sets ``_created`` when there was no destination: no local folder (the check makes it),
        no object under the remote prefix."""
        if self._local:
            self._created = not os.path.lexists(self.root)
        storage.check_destination_writable(self.fs, self.root, storage_options=self.storage_options, config=self.config)
        try:
            entries = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.root, detail=False, refresh=True)]
        except FileNotFoundError as exc:
            release_frames(exc)  # (s3fs's error holds this pack's callers' frames in a cycle: see there)
            entries = []
            self._created = self._created or not self._local
        url = storage.full_url(self.fs, self.root)
        ours = [e for e in entries if self._shard_re.fullmatch(e) or _is_leftover(e)]
        foreign = [e for e in entries if e not in ours and e != MANIFEST_NAME]
        for folder in [e for e in foreign if e.isdigit()]:  # a prefix directory (``shard_name``) of a dataset here
            inside = self._prefix_entries(folder)
            if inside is not None:
                foreign.remove(folder)
                ours += [f"{folder}/{e}" for e in inside if self._shard_re.fullmatch(e) or _is_leftover(e)]
                foreign += [f"{folder}/{e}" for e in inside if not (self._shard_re.fullmatch(e) or _is_leftover(e))]
        if not overwrite:
            if MANIFEST_NAME in entries:
                raise DestinationError(
                    f"{url} already holds a dataset ({MANIFEST_NAME}); to replace it pass overwrite=True (shardstream pack: --overwrite)"
                )
            if foreign:
                raise DestinationError(
                    f"{url} is not empty ({len(foreign)} other entries, e.g. {foreign[0]!r}); "
                    "choose an empty destination or pass overwrite=True (shardstream pack: --overwrite)"
                )
            if ours:
                logger.warning("%s: replacing %d files left by an interrupted pack", url, len(ours))
        # The manifest is the commit: remove it first so the old dataset reads as incomplete
        # while it is being replaced.
        if MANIFEST_NAME in entries:
            self.fs.rm_file(storage.join(self.root, MANIFEST_NAME))
        stale = [storage.join(self.root, e) for e in ours]
        for path in stale:
            if _is_leftover(path):
                self.fs.rm_file(path)
        return [p for p in stale if not _is_leftover(p)]

    def _mark_in_progress(self) -> None:
        """Write the pack's marker (``PACK_MARKER``) before any shard: removed by ``close`` once the
        manifest is written, it tells a pack that stopped halfway from a dataset."""
        if self._local:
            os.makedirs(self.root, exist_ok=True)
        doc = {"pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        storage.write_bytes_atomic(self.fs, storage.join(self.root, PACK_MARKER), json.dumps(doc).encode())

    def _ours(self) -> list[str]:
        """Paths under the root (and its prefix folders) that a pack writes: shards, sidecars, leftovers."""
        try:
            entries = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.root, detail=False, refresh=True)]
        except FileNotFoundError as exc:
            release_frames(exc)
            return []
        ours = [e for e in entries if self._shard_re.fullmatch(e) or _is_leftover(e)]
        for folder in [e for e in entries if e.isdigit()]:
            inside = self._prefix_entries(folder) or []
            ours += [f"{folder}/{e}" for e in inside if self._shard_re.fullmatch(e) or _is_leftover(e)]
        return [storage.join(self.root, e) for e in ours]

    def _clean_up_failed(self) -> None:
        """After a failure (the pack's processes stopped): a destination this writer made loses
        everything the pack wrote, itself included; one that existed loses the temporary files of
        unfinished shards and keeps the marker beside any shard left there (pack again to complete
        it), and loses it where nothing else of a pack is left."""
        ours = self._ours()
        for path in [p for p in ours if _PARTIAL_MARK in p.rsplit("/", 1)[-1]]:
            # a shard's temporary file: never part of what is kept (a worker stopped mid-shard left it)
            self._remove_if_there(path)
            ours.remove(path)
        marker = storage.join(self.root, PACK_MARKER)
        if not self._created and any(p != marker for p in ours):
            return
        for path in ours:
            self._remove_if_there(path)
        if self._local and self._created:
            folders = {os.path.dirname(p) for p in ours} - {self.root}
            for folder in sorted(folders, reverse=True) + [self.root]:
                try:
                    os.rmdir(folder)  # only an empty folder: another writer's file keeps it
                except OSError:
                    pass

    def _prefix_entries(self, folder: str) -> list[str] | None:
        """The names in a prefix directory of the root, or None when ``folder`` is not a directory."""
        path = storage.join(self.root, folder)
        if not self.fs.isdir(path):
            return None
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(path, detail=False, refresh=True)]

    # -- writing -------------------------------------------------------------------------------
    def write(self, sample: Mapping[str, Any]) -> None:
        """Encode a sample dict (``__key__`` plus fields named by extension) and append it."""
        key, fields = encode_sample(dict(sample))
        self.write_encoded(key, fields)

    def write_encoded(self, key: str, fields: Mapping[str, bytes], tokens: int = 0) -> None:
        """Append a sample whose fields are already bytes (``tokens``: a token corpus's document's
        tokens, counted in its shard's manifest entry)."""
        noted = self._noted
        del noted.starts[:], noted.sizes[:], noted.exts[:]
        pieces, size = encode_members(key, fields, noted)  # (where it lands is known once the shard is)
        self._append(key, pieces, size, noted.exts, fields.get("cls"), tokens, list(zip(noted.starts, noted.sizes)))

    def write_members(
        self,
        key: str,
        members: bytes,
        extensions: Sequence[str],
        cls: bytes | None = None,
        layout: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Append a sample already encoded as its tar members (``encode_members``' pieces, joined),
        with its fields' extensions, its ``cls`` field's bytes and the members' ``layout`` (as
        ``(data start within the sample, size)`` per member, in member order; without one the
        shard gets no member sidecar): what pack's
        workers hand over, so the tar headers are built there and the process that writes only writes."""
        self._append(key, [members], len(members), extensions, cls, 0, layout)

    def _append(
        self,
        key: str,
        pieces: list[bytes],
        size: int,
        extensions: Iterable[str],
        cls: bytes | None,
        tokens: int,
        layout: Sequence[tuple[int, int]] | None,
    ) -> None:
        if self._closed:
            raise ValueError("ShardWriter is closed")
        if self._keys is not None:
            if key in self._keys:
                raise SourceError(f"key {key!r}", "duplicate key: two samples would share one key")
            self._keys.add(key)
        if self._file is not None and (self._count >= self.max_count or self._size + size + len(END_OF_ARCHIVE) > self.max_size):
            self._finish_shard()
        if self._file is None:
            self._start_shard()
        if layout is None:
            self._members.unknown()
        else:
            self._members.extend(self._size, layout, list(extensions))
        self._members.keep(key)
        self._offsets.append(self._size)
        self._pending += pieces
        self._pending_bytes += size
        self._size += size
        self._count += 1
        self._tokens += tokens
        self.tokens_written += tokens
        if self._pending_bytes >= _FLUSH_BYTES:
            self._flush()
        for ext in extensions:
            self.extensions[ext] = self.extensions.get(ext, 0) + 1
        if self.label_map is not None and cls is not None:
            label = int(cls)
            self._label_counts[label] = self._label_counts.get(label, 0) + 1
        self.samples_written += 1
        self.bytes_written += size

    def add_shard(self, info: ShardInfo, extensions: Mapping[str, int], label_counts: Mapping[int, int]) -> None:
        """Adopt a shard written elsewhere (a task of ``write.tasks``) as the next one, with its
        sidecar already published under ``info.index``; the manifest lists it when this closes."""
        if self._file is not None:
            raise ValueError("add_shard between samples written here would break the shard order")
        expected = shard_name(self.prefix, len(self.shards), self.prefixes)
        if info.path != expected:
            raise ValueError(f"shard {info.path!r} added where {expected!r} comes next")
        self.shards.append(info)
        for ext, n in extensions.items():
            self.extensions[ext] = self.extensions.get(ext, 0) + n
        for label, n in label_counts.items():
            self._label_counts[label] = self._label_counts.get(label, 0) + n
        self.samples_written += info.samples
        self.bytes_written += info.bytes

    def remove_partials(self) -> None:
        """Delete temporary files of shards that were never published (a killed task's)."""
        try:
            entries = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError as exc:
            release_frames(exc)
            return
        for folder in {shard_name(self.prefix, i, self.prefixes).rpartition("/")[0] for i in range(min(self.prefixes, len(self.shards)))}:
            if folder:  # the prefix directories written to (a local task's partials are made beside its shard)
                try:
                    entries += self.fs.ls(storage.join(self.root, folder), detail=False, refresh=True)
                except FileNotFoundError as exc:
                    release_frames(exc)
        for entry in entries:
            if _is_leftover(entry.rsplit("/", 1)[-1]):
                self._remove_if_there(entry)

    def _remove_if_there(self, path: str) -> None:
        """Remove ``path``; one already gone is fine (its error's frames let go: ``release_frames``)."""
        try:
            self.fs.rm_file(path)
        except FileNotFoundError as exc:
            release_frames(exc)

    def skip(self, where: str, error: str) -> None:
        """Record a sample left out under the skip policy (counted and listed in the manifest)."""
        self.skipped_count += 1
        if len(self.skipped) < MAX_SKIPPED_LISTED:
            self.skipped.append({"source": where, "error": error})
        logger.warning("skipped %s: %s", where, error)

    def _start_shard(self) -> None:
        name = shard_name(self.prefix, len(self.shards), self.prefixes)
        folder, _, base = name.rpartition("/")
        if self._local:
            os.makedirs(os.path.join(self.root, folder), exist_ok=True)
            self._tmp_path = os.path.join(self.root, folder, f".{base}{_PARTIAL_MARK}{uuid.uuid4().hex[:8]}")
        else:
            # The pid in the name lets a later run reclaim the file if this process dies (kill -9).
            fd, self._tmp_path = tempfile.mkstemp(prefix=f"shardstream-{os.getpid()}-{base}{_PARTIAL_MARK}")
            os.close(fd)
        self._file = open(self._tmp_path, "wb")
        self._name = name
        self._hash = hashlib.sha256()
        self._offsets: list[int] = []
        self._members = MemberLog()
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._size = 0
        self._count = 0
        self._tokens = 0

    def _flush(self) -> None:
        block = b"".join(self._pending)
        self._members.flushed(block, self._size - len(block))
        self._hash.update(block)
        assert self._file is not None, "no shard in progress"
        self._file.write(block)
        self._pending = []
        self._pending_bytes = 0

    def _finish_shard(self) -> None:
        self._offsets.append(self._size)
        self._pending.append(END_OF_ARCHIVE)
        self._size += len(END_OF_ARCHIVE)
        self._flush()
        assert self._file is not None and self._tmp_path is not None, "no shard in progress"
        self._file.close()
        self._file = None
        dest_path = storage.join(self.root, self._name)
        storage.publish_file(self.fs, self._tmp_path, dest_path)
        self._tmp_path = None
        # The offsets go to the shard's sidecar now (before the manifest), not into memory: a
        # billion-sample pack keeps O(shards) here.
        sidecar = self._name + SIDECAR_SUFFIX
        storage.write_bytes_atomic(self.fs, storage.join(self.root, sidecar), encode_offsets(self._offsets))
        sha256 = self._hash.hexdigest()
        table = self._members.encoded(self._offsets, self._size, sha256)  # (format/members.py: read by slicing)
        if table is not None:
            storage.write_bytes_atomic(self.fs, storage.join(self.root, self._name + MEMBERS_SUFFIX), table)
        self._members = MemberLog()
        self.shards.append(
            ShardInfo(
                self._name,
                self._count,
                self._size,
                sha256,
                index=sidecar,
                span=(self._offsets[0], self._offsets[-1]),
                tokens=self._tokens if self.token_info is not None else None,
                member_bytes=len(table) if table is not None else None,
            )
        )
        logger.debug("published %s (%d samples, %d bytes)", dest_path, self._count, self._size)

    # -- closing -------------------------------------------------------------------------------
    def close(self) -> Manifest:
        """Publish the last shard, delete stale shards of a replaced dataset, write the manifest."""
        if self._closed:
            raise ValueError("ShardWriter is already closed")
        if self._file is not None:
            self._finish_shard()
        self._closed = True
        kept = {storage.join(self.root, p) for s in self.shards for p in (s.path, s.index or "", s.path + MEMBERS_SUFFIX)}
        for path in self._stale:
            if path not in kept:
                self.fs.rm_file(path)
        manifest = Manifest(
            shards=list(self.shards),
            extensions=dict(self.extensions),
            label_map=self.label_map,
            label_counts=self.label_counts,
            skipped={"count": self.skipped_count, "items": list(self.skipped)},
            token_info=self.token_info,
        )
        # (options carrying the config: the manifest goes through this writer's own filesystem)
        write_manifest(manifest, storage.join(self.dest, MANIFEST_NAME), storage.bound_options(self.dest, self.storage_options, self.config))
        self._remove_if_there(storage.join(self.root, PACK_MARKER))  # the pack is complete
        manifest.base_url = self.dest
        manifest.storage_options = dict(self.storage_options)
        self.manifest = manifest
        return manifest

    def abort(self) -> None:
        """Drop the shard in progress; no manifest is written. What the pack published is removed
        (with the destination folder where this writer made it), or stays marked as unfinished
        (see the module docstring)."""
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tmp_path is not None:
            try:
                os.unlink(self._tmp_path)
            except FileNotFoundError:
                pass
            self._tmp_path = None
        try:
            self._clean_up_failed()
        except Exception as exc:  # noqa: BLE001 - the failure being reported matters more; the marker stays
            logger.warning("%s: could not remove what the failed pack wrote (%s); its marker says it is unfinished", self.dest, exc)

    @property
    def label_counts(self) -> dict[str, int] | None:
        if self.label_map is None:
            return None
        return {name: self._label_counts.get(index, 0) for name, index in self.label_map.items()}

    @property
    def manifest_url(self) -> str:
        return storage.join(self.dest, MANIFEST_NAME)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.close()
            except OSError as failed:
                full = self._disk_full(failed)
                if full is None:
                    raise
                self.abort()
                raise full from failed
            return
        full = self._disk_full(exc)
        self.abort()
        if full is not None:
            raise full from exc

    def _disk_full(self, exc: BaseException | None) -> DestinationError | None:
        """A full disk (ENOSPC, EDQUOT) met while writing, said as a DestinationError naming the
        destination, the local folder that filled up and its free space (measured before ``abort``
        frees what this pack wrote); None for anything else."""
        if not isinstance(exc, OSError) or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return None
        folder = self.root if self._local else tempfile.gettempdir()  # (a remote pack stages each shard there)
        try:
            usage = shutil.disk_usage(folder)
            free = f"{usage.free:,} bytes free of {usage.total:,}"
        except OSError:
            free = "free space unknown"
        what = "quota exceeded" if exc.errno == errno.EDQUOT else "no space left on device"
        staged = "" if self._local else " (shards are staged there before upload: set TMPDIR to a larger disk)"
        return DestinationError(f"cannot write {self.dest}: {what} in {folder}{staged}, {free}; no manifest was written")


def reclaim_temp_partials(tmpdir: str | None = None) -> int:
    """Remove upload staging files (``shardstream-PID-*.partial-*``) left in the temp directory by a
    pack whose process is gone; returns how many were removed."""
    tmpdir = tmpdir or tempfile.gettempdir()
    removed = 0
    for name in os.listdir(tmpdir):
        match = re.fullmatch(r"shardstream-(\d+)-.*" + re.escape(_PARTIAL_MARK) + r".*", name)
        if not match:
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its writer is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, someone else's
        try:
            os.unlink(os.path.join(tmpdir, name))
            removed += 1
        except FileNotFoundError:
            pass
    if removed:
        logger.info("removed %d upload staging files left in %s by an interrupted pack", removed, tmpdir)
    return removed


__all__ = [
    "ShardWriter",
    "encode_members",
    "check_key",
    "shard_name",
    "interrupted_pack",
    "refuse_interrupted_pack",
    "PACK_MARKER",
    "DEFAULT_MAX_COUNT",
    "DEFAULT_MAX_SIZE",
]
