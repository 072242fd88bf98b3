"""One dataset's epoch, as a view of the one planner (plan/mix.py): a single dataset is a mix of
one source asking one whole pass per epoch. ``plan_epoch`` and ``EpochPlan`` are the names its
plan has always had (``ShardStream(root).plan()`` returns one); nothing here plans.

For one source the planner orders the shards by (seed, epoch) (``shard_permutation``: the same on
every rank, empty shards left out), lays them end to end as one sequence of N samples, gives every
rank R batches (floor(N / (W*B)) when dropping the tail, ceil when padding: the sequence wraps
around), rank r the slice [r*R*B, (r+1)*R*B) and its workers whole batches of it, contiguously, as
shard ranges: workers may share a shard at sample granularity. A range that starts inside a
compressed shard (.tar.gz, .tar.zst, ...) decompresses it from its start (``compressed_shards``
counts them, ``summary()`` says so); repack as plain tar for cheap splitting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardstream.plan.mix import MODES, Ask, MixPlan, Range, check_seed, plan_mix, shard_permutation
from shardstream.plan.requests import RequestCount, count_requests

__all__ = ["MODES", "Counts", "EpochPlan", "Range", "check_seed", "plan_epoch", "shard_permutation"]

Counts = Sequence[int] | np.ndarray  # samples per shard, in manifest order

WHOLE = Ask(repeat=1)  # what a single dataset asks of every epoch: one pass


@dataclass(frozen=True)
class EpochPlan:
    """The exact plan of one epoch of one dataset, from ``plan_epoch`` or ``ShardStream.plan()``:
    the one planner's plan of a mix of one source (``mix``, a ``MixPlan``) seen as one dataset,
    the same on every rank.

    The settings it was made for: ``epoch``, ``seed``, ``shuffle``, ``world_size``,
    ``num_workers`` (at least 1), ``batch_size``, ``mode`` (``"drop"`` or ``"pad"``),
    ``compressed_shards`` (how many shards are compressed: a range starting inside one reads it
    from its start). What it decides: ``total_samples`` (N), ``batches_per_rank`` (R, the same on
    every rank), ``shard_order`` (shard indices in this epoch's order, empty shards left out) and
    ``starts`` (where each of them begins in the sequence of N samples laid end to end);
    ``samples_per_rank`` is R x ``batch_size``. ``ranges(rank, worker)`` lists the shard ranges
    a worker reads, ``summary()`` says it all in one line (with ``resumed`` and ``requests``,
    the notes ``ShardStream.plan()`` adds).
    """

    mix: MixPlan
    compressed_shards: int = 0
    resumed: str = ""  # set by ShardStream.plan() when the epoch continues a saved state (plan/run.py)
    workers_note: str = ""  # set by ShardStream.plan() when the worker count is assumed, not known
    requests: str = ""  # set by ShardStream.plan() for a remote dataset: the GETs it makes (plan/requests.py)
    tokens: str = ""  # set by ShardStream.plan() for a token corpus: its samples are sequences (format/tokens.py)

    # -- the mix of one, as one dataset ---------------------------------------------------------------
    epoch = property(lambda self: self.mix.epoch)
    seed = property(lambda self: self.mix.seed)
    shuffle = property(lambda self: self.mix.shuffle)
    world_size = property(lambda self: self.mix.world_size)
    num_workers = property(lambda self: self.mix.num_workers)
    batch_size = property(lambda self: self.mix.batch_size)
    mode = property(lambda self: self.mix.mode)
    total_samples = property(lambda self: self.mix.total_samples)
    batches_per_rank = property(lambda self: self.mix.batches_per_rank)
    samples_per_rank = property(lambda self: self.mix.samples_per_rank)

    @property
    def shard_order(self) -> tuple[int, ...]:
        return self.mix.passes[0][0].order

    @property
    def starts(self) -> tuple[int, ...]:
        """Where each ``shard_order`` entry starts in the laid-out sequence."""
        return self.mix.passes[0][0].starts

    @property
    def dropped(self) -> int:
        """Samples no rank reads this epoch (``mode="drop"``: the tail that cannot fill equal batches)."""
        return self.mix.dropped

    @property
    def repeated(self) -> int:
        """Samples read a second time this epoch (``mode="pad"``: the sequence wraps to fill the last batches)."""
        return self.mix.repeated

    def worker_batches(self, worker: int) -> int:
        return self.mix.worker_batches(worker)

    def worker_slice(self, rank: int, worker: int) -> tuple[int, int]:
        """[begin, end) positions in the laid-out (possibly wrapped) sequence."""
        return self.mix.worker_slice(rank, worker)

    def slice_begins(self) -> np.ndarray:
        return self.mix.slice_begins()

    def ranges(self, rank: int, worker: int, counts: Counts | None = None) -> list[Range]:
        """The shard ranges worker ``worker`` of rank ``rank`` reads, in order (``counts``: the
        samples per shard, which the plan knows; accepted as before)."""
        return self.mix.ranges(rank, worker)[0]

    def ranges_between(self, begin: int, end: int, counts: Counts | None = None) -> list[Range]:
        """The shard ranges of positions [begin, end) of the laid-out (possibly wrapped) sequence."""
        out: list[Range] = []
        n = self.total_samples
        while begin < end:
            lap = begin // n
            stop = min(end, (lap + 1) * n)
            out += self.mix.source_ranges(0, begin - lap * n, stop - lap * n)
            begin = stop
        return out

    def count_requests(self, manifests: Sequence[Any]) -> RequestCount:
        """The store requests this epoch makes (a ``plan.requests.RequestCount``) over
        ``manifests`` (the dataset's manifest, alone in a list)."""
        return count_requests(self, manifests[0])

    def summary(self) -> str:
        """The plan in one line: samples over shards, ranks x batches, what is dropped or repeated,
        workers per rank (and the notes ``resumed`` and ``requests`` when set)."""
        extra = f"{self.dropped} dropped" if self.mode == "drop" else f"{self.repeated} repeated"
        return (
            f"epoch {self.epoch}: {self.total_samples} samples over {len(self.shard_order)} shards -> "
            f"{self.world_size} ranks x {self.batches_per_rank} batches of {self.batch_size} "
            f"({self.samples_per_rank} samples per rank, {extra}), {self.num_workers} workers per rank{self.workers_note}"
            + (
                f"; {self.compressed_shards} compressed shards: a range starting mid-shard decompresses from the "
                "shard's start and skips to it (repack as plain .tar to split cheaply)"
                if self.compressed_shards
                else ""
            )
            + (f"; {self.resumed}" if self.resumed else "")
            + (f"; {self.requests}" if self.requests else "")
            + (f"; {self.tokens}" if self.tokens else "")
        )


def plan_epoch(
    counts: Counts,
    *,
    world_size: int,
    num_workers: int,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    mode: str = "drop",
    compressed_shards: int = 0,
) -> EpochPlan:
    """Plan one epoch of one dataset (``plan_mix`` of one source asking one whole pass); raises
    ConfigError (naming the numbers) for settings that cannot work."""
    plan = plan_mix(
        [counts],
        [WHOLE],
        world_size=world_size,
        num_workers=num_workers,
        batch_size=batch_size,
        seed=check_seed(seed),
        epoch=epoch,
        shuffle=shuffle,
        mode=mode,
    )
    return EpochPlan(plan, compressed_shards)
