"""Topology: which rank of how many, and which DataLoader worker of how many. Asked here only.

Everything else takes a World and a worker index as arguments, so any (rank, worker) view can be
built in one process (tests do exactly that).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

from shardstream.errors import ConfigError


@dataclass(frozen=True)
class World:
    """Which rank this process is (``rank``, from 0) of how many (``world_size``): it decides
    which share of every epoch this process reads. A rank outside ``[0, world_size)`` is a
    ConfigError.

    ``ShardStream(world=None)`` (the default) takes ``World.detect()`` once, when the stream is
    built: the default process group's rank and size if ``torch.distributed`` is initialized by
    then, else the ``RANK`` and ``WORLD_SIZE`` environment variables (set by torchrun), else rank
    0 of 1. Pass ``world=World(rank, world_size)`` when that would be wrong: a stream built before
    ``init_process_group`` by a launcher that sets no ``RANK``/``WORLD_SIZE`` (for instance
    ``torch.multiprocessing.spawn``), ranks that should split the data over another group than
    the default one (the data-parallel group when model parallelism makes several ranks share a
    batch: they pass the same data-parallel rank), or one rank's view of a run built in a single
    process (tests, planning).
    """

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not in a world of size {self.world_size}")

    @classmethod
    def detect(cls, rank: int | None = None, world_size: int | None = None) -> World:
        """Explicit values (both or neither), else an initialized torch.distributed (the default
        group's rank and size), else torchrun's RANK/WORLD_SIZE, else (0, 1)."""
        if rank is not None or world_size is not None:
            if rank is None or world_size is None:
                raise ConfigError("give both rank and world_size, or neither")
            return cls(rank, world_size)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        return cls(0, 1)


@dataclass(frozen=True)
class Topology:
    """What a rank's share of a pass depends on besides the data: ranks, workers per rank, batch
    size and the shuffle buffer (a state saved under one topology resumes exactly on the same one)."""

    world_size: int
    num_workers: int
    batch_size: int
    shuffle_buffer: int
    shuffle_initial: int

    def to_json(self) -> dict[str, int]:
        return {
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "batch_size": self.batch_size,
            "shuffle_buffer": self.shuffle_buffer,
            "shuffle_initial": self.shuffle_initial,
        }

    def describe(self) -> str:
        return f"{self.world_size} ranks x {self.num_workers} workers x batch {self.batch_size}"


def batches_per_rank(total: int, world_size: int, batch_size: int, mode: str) -> int:
    """The batches every rank gets from a laid-out sequence of ``total`` samples, written once (one
    dataset, a mix, the rest of an interrupted epoch): ``floor(total / (W * B))`` when dropping the
    tail that cannot fill equal batches, ``ceil`` when padding (the sequence wraps around)."""
    per_step = world_size * batch_size
    return total // per_step if mode == "drop" else -(-total // per_step)


def _upto(t: int, worker: int, num_workers: int) -> int:
    """How many of a pass's batches [0, t) come from ``worker`` (batch t' from worker t' % K)."""
    return max(0, -(-(t - worker) // num_workers))


def worker_share(t0: int, t1: int, num_workers: int, worker: int) -> tuple[int, int]:
    """The worker split, written once. DataLoader hands a pass's batches out round-robin (the t-th
    from worker t % K), so of the pass's batches [t0, t1) (one window, counted from the pass's
    first) ``worker`` yields those with t % K == worker: (how many come from the workers before it,
    how many from it). Its slice of the window starts after theirs, so reads stay contiguous; a
    whole epoch from t0 = 0 gives the first R % K workers one batch more."""
    shares = [_upto(t1, w, num_workers) - _upto(t0, w, num_workers) for w in range(worker + 1)]
    return sum(shares[:-1]), shares[-1]


def worker_starts(batches: int, num_workers: int) -> list[int]:
    """``worker_share(0, batches, K, w)[0]`` for every worker w at once: where each worker's slice
    of a whole epoch of ``batches`` batches per rank starts, in batches (the split every plan and
    the request count use)."""
    base, extra = divmod(batches, num_workers)
    return [w * base + min(w, extra) for w in range(num_workers)]


def consumed_in(t0: int, t1: int, received: int, num_workers: int, worker: int) -> int:
    """How many of ``worker``'s batches in the window [t0, t1) the loop received after ``received``."""
    return max(0, _upto(min(received, t1), worker, num_workers) - _upto(t0, worker, num_workers))


class WorkerInfo(NamedTuple):
    """The worker this code runs in, as torch's ``get_worker_info()`` describes one: its ``id``
    (0 to ``num_workers - 1``), ``seed`` (its random generators' seed) and the ``dataset`` copy
    it iterates. A worker process of make_loader's also says where large batch buffers come from
    (``take(nbytes)``, its hand-off's segment pool: the batch crosses without a copy) and whether its
    samples reach the hand-off as stored (``as_stored``: a large member stays in pieces,
    ``format.tar.Unjoined``, joined once into its segment)."""

    id: int
    num_workers: int
    seed: int
    dataset: Any
    take: Any = None
    as_stored: bool = False


_thread_worker = threading.local()  # a thread worker's own (make_loader(workers="threads"))
_process_worker: WorkerInfo | None = None  # a worker process of make_loader's


def set_worker(info: WorkerInfo | None, *, thread: bool) -> None:
    """Mark this thread (a thread worker) or this process (a worker process) as ``info``'s worker."""
    global _process_worker
    if thread:
        _thread_worker.info = info
    else:
        _process_worker = info


def get_worker_info() -> Any:
    """The worker this code runs in: a worker of make_loader's loader (thread or process), else
    torch's DataLoader worker (``torch.utils.data.get_worker_info()``), else None (the loop's own
    process and thread). Each has ``id``, ``num_workers``, ``seed`` and ``dataset``."""
    info = getattr(_thread_worker, "info", None) or _process_worker
    if info is not None:
        return info
    from torch.utils.data import get_worker_info as torch_worker_info

    return torch_worker_info()


def current_worker() -> tuple[int, int]:
    """(worker id, number of workers) of the worker we run in; (0, 1) in the loop's own process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)
