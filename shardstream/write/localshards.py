"""Whole shards of a local tree, planned from file sizes and written by whichever process runs them.

    listing + one stat per file (the main process) -> plan_shards -> LocalShardTask per shard
        -> write_local_shard (a worker, or the one process): read, encode, hash, write, publish
        -> LocalShardDone (the shard's manifest entry, its counts and keys) back to the main process

Workers forked after the listing (``procs.fork_safe()``) hold it already: ``ListedWork`` runs
their tasks by position in it, the stat of a span of items (``Sizes``) as well as whole shards,
so the stat is split among them and no item is pickled. Spawned workers get each shard's items.

A sample of a local tree is its files' bytes as they are (plus ``cls`` from its folder), so its
tar members' size is known from ``os.stat`` before any byte is read: header (``ustar``) + data +
padding per field. ``plan_shards`` cuts those sizes with the writer's own rule
(``ShardWriter._append``: a new shard once ``max_count`` samples are in, or the next sample would
take it past ``max_size``), so every shard is known up front and one process builds each, with no
sample crossing a pipe. The plan depends on the listing only, never on the worker count: the
output is byte-identical for any ``workers``, and to ``ShardWriter``'s for the same samples.

A file whose size changed between the stat and the read so that its sample's tar size is not the
planned one is a bad sample (``on_error``), named (a change within its last tar block leaves the
plan true, and is packed as read).
Each shard goes to a ``.partial-`` file beside its final name and is renamed into place when
whole, its sidecars after it (offsets, then members: ``sidecar.MemberLog``); a failure unlinks the partial file. A shard whose every sample
failed (``on_error="skip"``) is written empty, a valid tar: the names stay the plan's. Imports no more than the lean
loader (``write/loading.py``): os, hashlib and the ustar and sidecar writers (numpy, for the
member sidecar's fingerprints, once a block is written).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from shardstream.errors import SourceError
from shardstream.sidecar import MEMBERS_SUFFIX, MemberLog, encode_offsets
from shardstream.sidecar import SUFFIX as SIDECAR_SUFFIX
from shardstream.ustar import BLOCK, END_OF_ARCHIVE, header_size
from shardstream.write.localfiles import load_local
from shardstream.write.members import encode_members

_FLUSH_BYTES = 1 << 20
_PARTIAL_MARK = ".partial-"  # (``writer._PARTIAL_MARK``: a leftover the writer cleans up)


def sample_size(item: tuple[str, tuple]) -> int:
    """The tar bytes of a ``("local", key, files, label)`` item's sample, from its files' sizes
    (``os.stat``); a file that cannot be stat'ed counts 0 (its read fails and names it)."""
    _, (_, key, files, label) = item
    total = 0
    for ext, path in files:
        try:
            n = os.stat(path).st_size
        except (OSError, ValueError):
            n = 0
        total += header_size(f"{key}.{ext}", n) + n + (-n % BLOCK)
    if label is not None:
        n = len(str(label))
        total += header_size(f"{key}.cls", n) + n + (-n % BLOCK)
    return total


def plan_shards(sizes: Sequence[int], max_count: int, max_size: int) -> list[range]:
    """The samples of each shard, by position: ``ShardWriter``'s cut rule over known sizes."""
    cuts: list[range] = []
    start = count = size = 0
    for i, n in enumerate(sizes):
        if count and (count >= max_count or size + n + len(END_OF_ARCHIVE) > max_size):
            cuts.append(range(start, i))
            start, count, size = i, 0, 0
        count += 1
        size += n
    if count:
        cuts.append(range(start, len(sizes)))
    return cuts


@dataclass(frozen=True)
class LocalShardTask:
    """Write shard ``name`` under the local folder ``root`` from ``items`` (local tree items),
    whose samples' planned sizes are ``sizes``. ``positions``: the items are these positions of
    the listing a forked worker holds (``ListedWork``), and ``items`` is empty."""

    root: str
    name: str
    items: Sequence[tuple[str, tuple]]
    sizes: Sequence[int]
    on_error: str = "raise"
    positions: range | None = None


@dataclass(frozen=True)
class Sizes:
    """The planned sizes (``sample_size``) of the listing's items ``start:stop``."""

    start: int
    stop: int


class ListedWork:
    """A forked worker's function over the listing it inherited: ``Sizes`` gives those items'
    sizes, a ``LocalShardTask`` by ``positions`` writes that shard."""

    def __init__(self, items: Sequence[tuple[str, tuple]]):
        self.items = items

    def __call__(self, task: Sizes | LocalShardTask) -> list[int] | LocalShardDone:
        if isinstance(task, Sizes):
            return [sample_size(item) for item in self.items[task.start : task.stop]]
        if task.positions is not None:
            task = replace(task, items=self.items[task.positions.start : task.positions.stop], positions=None)
        return write_local_shard(task)


@dataclass
class LocalShardDone:
    """A written shard: what its manifest entry says (``ShardInfo``'s fields), and its counts."""

    name: str
    samples: int
    bytes: int
    sha256: str
    sidecar: str
    span: tuple[int, int]
    member_bytes: int | None = None  # its member sidecar's size (beside the offset sidecar), None for none
    extensions: dict[str, int] = field(default_factory=dict)
    label_counts: dict[int, int] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    skipped: list[tuple[int, str, str]] = field(default_factory=list)  # (position in the task, where, what)


def write_local_shard(task: LocalShardTask) -> LocalShardDone:
    """Build shard ``task.name`` and publish it (rename), then its sidecar; see the module docstring."""
    if task.positions is not None:
        raise ValueError(f"{task.name}: a task by positions runs on the listing that holds them (ListedWork)")
    folder, _, base = task.name.rpartition("/")
    where_to = os.path.join(task.root, folder)
    os.makedirs(where_to, exist_ok=True)
    final = os.path.join(where_to, base)
    tmp = os.path.join(where_to, f".{base}{_PARTIAL_MARK}{uuid.uuid4().hex[:8]}")
    done = LocalShardDone(task.name, 0, 0, "", task.name + SIDECAR_SUFFIX, (0, 0))
    digest = hashlib.sha256()
    offsets: list[int] = []
    members = MemberLog()
    pending: list[bytes] = []
    pending_bytes = size = 0
    try:
        with open(tmp, "wb") as f:
            for position, (item, planned) in enumerate(zip(task.items, task.sizes)):
                where, payload = item
                try:
                    key, fields = load_local(where, payload)
                    pieces, n = encode_members(key, fields, members, size)
                    if n != planned:
                        raise SourceError(where, "a file of this sample changed size while it was being packed")
                except SourceError as exc:
                    members.drop()  # (whatever of this sample was noted)
                    if task.on_error == "raise":
                        raise
                    done.skipped.append((position, exc.where, exc.what))
                    continue
                members.keep(key)
                offsets.append(size)
                pending += pieces
                pending_bytes += n
                size += n
                done.keys.append(key)
                for ext in fields:
                    done.extensions[ext] = done.extensions.get(ext, 0) + 1
                if payload[3] is not None:
                    done.label_counts[payload[3]] = done.label_counts.get(payload[3], 0) + 1
                if pending_bytes >= _FLUSH_BYTES:
                    block = b"".join(pending)
                    members.flushed(block, size - pending_bytes)
                    digest.update(block)
                    f.write(block)
                    pending, pending_bytes = [], 0
            offsets.append(size)
            pending.append(END_OF_ARCHIVE)
            block = b"".join(pending)
            members.flushed(block, size - pending_bytes)
            digest.update(block)
            f.write(block)
            size += len(END_OF_ARCHIVE)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _write_atomic(os.path.join(task.root, done.sidecar), encode_offsets(offsets))
    done.samples = len(done.keys)
    done.bytes = size
    done.sha256 = digest.hexdigest()
    table = members.encoded(offsets, size, done.sha256)
    if table is not None:
        _write_atomic(os.path.join(task.root, task.name + MEMBERS_SUFFIX), table)
        done.member_bytes = len(table)
    done.span = (offsets[0], offsets[-1])
    return done


def _write_atomic(path: str, data: bytes) -> None:
    """As ``storage.fs.write_bytes_atomic`` writes a local file: a synced temporary file, renamed."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
