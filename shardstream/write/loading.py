"""What a pack worker runs: load listed items and encode each sample as its tar members.

``run_task(task)`` writes a whole shard of a local tree (``write/localshards.py``) or loads a
batch: ``load_encoded(items)`` gives ``(True, key, (members, extensions, cls, layout))`` or ``(False, where,
what)`` per item, in order; it runs where the loading runs (a worker of ``write/procs.py``, or the
one process), so the process that writes the shards only writes.

A spawned worker is a new Python, and what it imports is most of what it costs (a forked one,
``write/localshards.ListedWork``, has it all already): importing the storage layer and the
reader (fsspec, numpy, the format package) took about 0.5 CPU-s, more than loading 20,000 small
local files. So this module imports only ``localfiles`` and ``members``
(os, stat and the ustar header), enough for a local tree's items (a whole shard's member sidecar
imports numpy, about 0.1 CPU-s, at its first block: ``sidecar.block_fingerprints``); any other item (a remote
tree, JSONL, tar shards, Parquet) imports ``sources`` on first use, in that worker only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardstream.errors import SourceError
from shardstream.sidecar import MemberLog
from shardstream.write.localfiles import load_local
from shardstream.write.localshards import LocalShardTask, write_local_shard
from shardstream.write.members import encode_members

# ``sources.set_worker_storage_options``'s arguments from the last ``set_options``, handed to
# ``sources`` when it is first needed here (None: handed over already).
_pending: tuple[Any, ...] | None = ({},)


def set_options(options: Mapping[str, Any] | None, config: Any = None) -> None:
    """The storage options and policy (a ``StorageConfig``; None: the default) this process reads
    items with: a pack worker's initializer, and the one process's before it loads."""
    global _pending
    _pending = (dict(options or {}),) if config is None else (dict(options or {}), config)


def _loaded(items: Sequence[Any]):
    if all(payload[0] == "local" for _, payload in items):
        for where, payload in items:
            try:
                key, fields = load_local(where, payload)
            except SourceError as exc:
                yield False, exc.where, exc.what
                continue
            yield True, key, fields
        return
    from shardstream.write import sources  # (not a local tree: the storage layer, imported here on first use)

    global _pending
    if _pending is not None:
        sources.set_worker_storage_options(*_pending)
        _pending = None
    yield from sources.load_items(items)


def load_encoded(items: Sequence[Any]) -> list[tuple[bool, str, Any]]:
    """``items`` loaded, each sample encoded as its tar members: ``(True, key, (members,
    extensions, cls, layout))`` (``ShardWriter.write_members``' arguments; ``layout``: each
    member's data start in the sample and size) or ``(False, where, what)``."""
    out: list[tuple[bool, str, Any]] = []
    for ok, a, b in _loaded(items):
        if ok:
            log = MemberLog()
            pieces, _ = encode_members(a, b, log)
            b = (b"".join(pieces), log.exts, b.get("cls"), list(zip(log.starts, log.sizes)))
        out.append((ok, a, b))
    return out


def run_task(task: Any) -> Any:
    """A pack worker's function: a ``LocalShardTask`` (a whole shard of a local tree) is written
    here (``localshards``); anything else is a batch of items to load and encode."""
    if isinstance(task, LocalShardTask):
        return write_local_shard(task)
    return load_encoded(task)
