"""Read once, hand over: a job's sources (manifests, mix files, a table's footers) read by one
rank and sent to the others through torch.distributed, so a job's start costs the same GETs at
any world size.

Without a handover each rank reads ``index.json`` itself: 8,192 GETs of one object within
seconds at 1,024 nodes x 8 ranks, against S3's 5,500 GET/s per prefix, and the manifest's bytes
times 8,192 of egress. With one, rank 0 of the default process group reads, pickles what it read
(the ``Mix`` of every source's manifest), and broadcasts those bytes with their SHA-256; every
other rank checks the digest and unpickles. DataLoader workers get the sources with the pickled
dataset, from their rank, never from storage.

The handover runs only where it is one collective that every rank joins in the same order: the
default group is initialised with more than one rank, the stream's ``World`` was detected from
it (not given), and this is not a DataLoader worker. Otherwise each process reads as before. An
error on rank 0 (a missing manifest, access denied) is sent as that error and raised on every
rank; sources that do not pickle (a mix whose per-source transform is a lambda) are read by
every rank, as before, which rank 0 says with the same broadcast.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from shardstream.errors import ManifestError
from shardstream.plan.topology import World, get_worker_info

logger = logging.getLogger(__name__)

T = TypeVar("T")

_READ, _SENT, _FAILED = "read", "sent", "failed"  # what rank 0 broadcasts: read it yourselves, the bytes, its error


def handover_group(world: World | None) -> bool:
    """Whether this process takes part in a handover (see the module's docstring)."""
    if world is not None:
        return False
    import torch.distributed as dist

    if get_worker_info() is not None:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def read_once(read: Callable[[], T], world: World | None) -> T:
    """``read()`` on rank 0 and its result on every rank, handed over by a broadcast of its
    pickled bytes checked by SHA-256; ``read()`` itself where there is no handover."""
    if not handover_group(world):
        return read()
    import torch.distributed as dist

    if dist.get_rank() == 0:
        return _send(read)
    return _receive(read)


def _send(read: Callable[[], T]) -> T:
    import torch.distributed as dist

    try:
        value = read()
    except Exception as exc:
        _broadcast([_FAILED, _pickled_error(exc), b""])
        raise
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # a lambda in a mix's Source, say
        logger.info("the sources do not pickle (%s): every rank reads them itself", exc)
        _broadcast([_READ, b"", b""])
        return value
    _broadcast([_SENT, hashlib.sha256(payload).digest(), payload])
    logger.debug("sources handed over to %d ranks: %d bytes", dist.get_world_size() - 1, len(payload))
    return value


def _receive(read: Callable[[], T]) -> T:
    kind, digest, payload = _broadcast([None, None, None])
    if kind == _READ:
        return read()
    if kind == _FAILED:
        raise pickle.loads(digest)
    if hashlib.sha256(payload).digest() != digest:
        raise ManifestError(
            f"the sources rank 0 read reached this rank damaged ({len(payload)} bytes whose SHA-256 is not the one sent); "
            "the process group's transport corrupted them: restart the job"
        )
    value: T = pickle.loads(payload)
    return value


def _pickled_error(exc: Exception) -> bytes:
    """Rank 0's error as pickled bytes: itself where it pickles and rebuilds, else a ManifestError
    with its message (every shardstream error rebuilds from its message, errors.py)."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 - any failure to pickle or rebuild it: send its message instead
        return pickle.dumps(ManifestError(f"rank 0 could not read the sources: {type(exc).__name__}: {exc}"))


def _broadcast(items: list[Any]) -> list[Any]:
    import torch.distributed as dist

    dist.broadcast_object_list(items, src=0)
    return items
