"""Packing as independent shard tasks, for any ``concurrent.futures.Executor`` (a process pool,
Dask's ``Client.get_executor()``, another engine's executor).

The driver lists the source once and cuts the list into shards before anything is loaded: shard
``i`` holds units ``[i * max_count, (i + 1) * max_count)`` (a unit is a listed source item, or one
input of ``pack(fn, inputs)``). A task is "write shard i from these units": small (paths, line
ranges, inputs; never sample bytes), deterministic (the same units give the same bytes on any
machine), and idempotent: the shard is built in a temporary file and published under its final
name in one atomic step (rename, or one S3 PUT), then its offset and member sidecars, so an engine that retries
a failed or lost task rewrites the same bytes under the same names and never leaves two versions.
The driver adopts the results in shard order and writes the manifest last.

Sizes are not known before loading, so under an executor ``max_size`` does not cut shards: they
hold ``max_count`` units each (the last one fewer), and a shard that ends up above ``max_size`` is
reported in a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any

from shardstream.errors import SourceError
from shardstream.format.manifest import ShardInfo
from shardstream.format.offsets import SUFFIX as SIDECAR_SUFFIX
from shardstream.format.offsets import encode_offsets
from shardstream.format.tar import END_OF_ARCHIVE
from shardstream.format.tokens import FIELD as TOKENS_FIELD
from shardstream.format.tokens import npy_header_size
from shardstream.sidecar import MEMBERS_SUFFIX, MemberLog
from shardstream.storage import fs as storage
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.write.encode import check_key, encode_sample
from shardstream.write.sources import load_items, set_worker_storage_options
from shardstream.write.writer import encode_members

logger = logging.getLogger(__name__)

DEFAULT_IN_FLIGHT = 64  # tasks submitted ahead of the one the driver waits for
_FLUSH_BYTES = 1 << 20


@dataclass(frozen=True)
class ShardTask:
    """Write shard ``index`` (named ``name``) under ``dest`` from ``units``."""

    dest: str
    name: str
    index: int
    first: int  # position of units[0] in the whole list (names inputs in errors)
    units: Sequence[Any]
    fn: Callable[[Any], Any] | None = None  # None: units are listed source items
    on_error: str = "raise"
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    config: StorageConfig = DEFAULT_STORAGE  # the storage policy: the destination's uploads, and the reads of listed items
    token_itemsize: int = 0  # a token corpus (write/tokens.py): its ids' itemsize; each sample's FIELD tokens counted into the shard's entry


@dataclass
class ShardResult:
    info: ShardInfo
    extensions: dict[str, int]
    label_counts: dict[int, int]
    keys: list[str]
    skipped: list[tuple[str, str]]


def _samples_of(task: ShardTask) -> Iterator[tuple[str, dict[str, bytes]] | tuple[None, tuple[str, str]]]:
    """(key, fields) per sample in order, or (None, (where, what)) for a unit that failed."""
    if task.fn is None:  # listed source items (a Parquet row group's rows load together)
        for ok, a, b in load_items(task.units):
            yield (a, b) if ok else (None, (a, b))
        return
    for n, unit in enumerate(task.units):
        where = f"input #{task.first + n} ({_short(unit)})"
        try:
            out = task.fn(unit)
            produced = [out] if isinstance(out, Mapping) else list(out) if out is not None else []
            encoded = []
            for sample in produced:
                key, fields = encode_sample(dict(sample))
                check_key(key, where)
                encoded.append((key, fields))
        except SourceError as exc:
            yield None, (where, exc.what)
            continue
        except Exception as exc:  # noqa: BLE001 - the user's fn: its failure goes to the error policy, named
            yield None, (where, f"{type(exc).__name__}: {exc}")
            continue
        yield from encoded


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def write_shard(task: ShardTask) -> ShardResult:
    """Run one task (in a worker process, a Dask worker, or inline): build, publish, describe."""
    set_worker_storage_options(task.storage_options, task.config)  # listed items are read under the task's policy
    fs, root = storage.get_fs(task.dest, task.storage_options, task.config)
    local = storage.is_local(fs)
    folder, _, base = task.name.rpartition("/")  # (a prefix directory: ``writer.shard_name``)
    if local:
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        tmp = os.path.join(root, folder, f".{base}.partial-{uuid.uuid4().hex[:8]}")
    else:
        fd, tmp = tempfile.mkstemp(prefix=f"shardstream-{base}.partial-")
        os.close(fd)
    digest = hashlib.sha256()
    offsets: list[int] = []
    members = MemberLog()
    extensions: dict[str, int] = {}
    labels: dict[int, int] = {}
    keys: list[str] = []
    seen: set[str] = set()
    skipped: list[tuple[str, str]] = []
    size = 0
    tokens = 0
    pending: list[bytes] = []
    pending_bytes = 0

    def flush() -> None:  # whole samples, a block at a time: their headers fingerprinted at once
        nonlocal pending, pending_bytes
        block = b"".join(pending)
        members.flushed(block, size - pending_bytes)
        digest.update(block)
        f.write(block)
        pending, pending_bytes = [], 0

    try:
        with open(tmp, "wb") as f:
            for key, fields in _samples_of(task):
                if key is None:
                    where, what = fields
                    if task.on_error == "raise":
                        raise SourceError(where, what)
                    skipped.append((where, what))
                    continue
                assert isinstance(fields, dict)
                if key in seen:
                    if task.on_error == "raise":
                        raise SourceError(f"key {key!r}", "duplicate key: two samples would share one key")
                    skipped.append((f"key {key!r}", "duplicate key: two samples would share one key"))
                    continue
                seen.add(key)
                pieces, n = encode_members(key, fields, members, size)
                members.keep(key)
                offsets.append(size)
                pending += pieces
                pending_bytes += n
                size += n
                if pending_bytes >= _FLUSH_BYTES:
                    flush()
                keys.append(key)
                if task.token_itemsize:
                    data = fields[TOKENS_FIELD]
                    tokens += (len(data) - npy_header_size(data)) // task.token_itemsize
                for ext in fields:
                    extensions[ext] = extensions.get(ext, 0) + 1
                if "cls" in fields:
                    try:
                        label = int(fields["cls"])
                        labels[label] = labels.get(label, 0) + 1
                    except ValueError:
                        pass
            offsets.append(size)
            pending.append(END_OF_ARCHIVE)
            pending_bytes += len(END_OF_ARCHIVE)
            size += len(END_OF_ARCHIVE)
            flush()
        # Atomic under the final name: a retried task replaces the same bytes, never adds a copy.
        storage.publish_file(fs, tmp, storage.join(root, task.name))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    sidecar = task.name + SIDECAR_SUFFIX
    storage.write_bytes_atomic(fs, storage.join(root, sidecar), encode_offsets(offsets))
    sha256 = digest.hexdigest()
    table = members.encoded(offsets, size, sha256)
    if table is not None:
        storage.write_bytes_atomic(fs, storage.join(root, task.name + MEMBERS_SUFFIX), table)
    info = ShardInfo(
        task.name,
        len(keys),
        size,
        sha256,
        index=sidecar,
        span=(offsets[0], offsets[-1]),
        tokens=tokens if task.token_itemsize else None,
        member_bytes=len(table) if table is not None else None,
    )
    return ShardResult(info, extensions, labels, keys, skipped)


def cut_shards(count: int, max_count: int) -> list[range]:
    """Shard boundaries over ``count`` units: ``max_count`` each, the last one fewer."""
    return [range(a, min(a + max_count, count)) for a in range(0, count, max_count)]


def adopt(writer: Any, result: Any, max_size: int, progress: Callable[[int, int], None] | None) -> None:
    """A finished task's shard into ``writer``'s manifest (in shard order), with a warning where it
    came out above ``max_size`` (tasks are cut by count alone) and the progress said."""
    writer.add_shard(result.info, result.extensions, result.label_counts)
    if result.info.bytes > max_size:
        logger.warning(
            "%s is %d bytes, above max_size %d (shard tasks are cut by max_count only: lower it)", result.info.path, result.info.bytes, max_size
        )
    if progress is not None:
        progress(writer.samples_written, writer.bytes_written)


def run_tasks(executor: Executor | None, tasks: Iterable[ShardTask], *, in_flight: int = DEFAULT_IN_FLIGHT) -> Generator[ShardResult, None, None]:
    """Results in task order; at most ``in_flight`` tasks submitted ahead. ``None`` runs them here."""
    if executor is None:
        for task in tasks:
            yield write_shard(task)
        return
    pending: list[Future] = []
    it = iter(tasks)
    try:
        for task in it:
            pending.append(executor.submit(write_shard, task))
            if len(pending) >= in_flight:
                yield pending.pop(0).result()
        while pending:
            yield pending.pop(0).result()
    finally:
        for fut in pending:
            fut.cancel()
        # Tasks already running finish before the caller cleans up after the failure (a shard
        # published after that would be left in a destination no longer marked as unfinished).
        wait([fut for fut in pending if not fut.cancelled()])
