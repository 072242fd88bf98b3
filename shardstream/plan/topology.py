"""Topology: which rank of how many, and which DataLoader worker of how many. Asked here only.

Everything else takes a World and a worker index as arguments, so any (rank, worker) view can be
built in one process (tests do exactly that).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shardstream.errors import ConfigError


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not in a world of size {self.world_size}")

    @classmethod
    def detect(cls, rank: int | None = None, world_size: int | None = None) -> World:
        """Explicit values, else an initialized torch.distributed, else torchrun's RANK/WORLD_SIZE, else (0, 1)."""
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


def current_worker() -> tuple[int, int]:
    """(worker id, number of workers) of the DataLoader worker we run in; (0, 1) in the main process."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)
