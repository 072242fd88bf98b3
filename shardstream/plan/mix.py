"""Mix planning: a pure function from (sources' shard counts, what each source asks, topology,
batch size, seed, epoch) to the exact samples every (rank, worker) reads from every source.

What an epoch of a mix is (docs/mixing.md says the same for users):

1. Every source gets a quota q_i of samples per epoch from what it asks:
   - ``samples=n``: q = n;
   - ``repeat=r``: q = round(r * N) for a source of N samples (r = 1 is one pass, 2.5 is two
     passes and half of a third);
   - ``weight=w``: weights are shares among the weighted sources (normalised to sum to 1). The
     weighted group is as large as it can be without any weighted source repeating a sample:
     G = min(N_i / p_i), and q_i = floor(p_i * G). The source that limits G is used whole; the
     others leave samples unseen this epoch (a fresh choice every epoch).
2. A source's epoch sequence is q samples drawn pass by pass: every pass lays the source's shards
   end to end in a fresh order of (seed, epoch, source, pass) and starts at a random sample
   offset on that circle, wrapping around. A lone source (a single dataset: a stream over one
   root, or a mix of one source) draws its first pass as single datasets always have: the shard
   order of (seed, epoch) (``shard_permutation``), entered at its start when the pass is whole,
   so their epochs and saved states stay what they were. A full pass is every sample once; the last, partial
   pass is a random window of the circle, so each sample is in it with probability exactly
   (length / N): fractional repeats are honoured exactly in expectation, integral ones exactly.
   No sample appears twice in an epoch unless q > N.
3. The sources' sequences are interleaved into one mixed sequence of T = sum(q_i) samples:
   - ``per_batch="spread"``: the j-th sample of source i sits at key (j + phase_i) / q_i (a
     random phase per epoch); the mixed sequence is all samples ordered by key. Every run of L
     consecutive samples holds L * q_i / T samples of source i within (1 - p_i) + p_i * (m - 1) for m
     sources with share p_i = q_i / T (under 1 for two sources, under 2 for three), so
     every batch carries each source in proportion.
   - ``per_batch="exact"``: every batch carries the same count c_i of source i (the batch size
     apportioned by share, largest remainder; each source at least one sample, else an error).
     The epoch has min(q_i // c_i) such batches; what the quotas leave over is dropped.
4. Topology: every rank gets R = floor(batches / W)
   batches, rank r takes a contiguous slice of the mixed sequence, workers split a rank's slice
   in whole batches, and the tail that cannot make equal batches is dropped and counted per
   source (``mode="drop"``), or the mixed sequence wraps around to fill the last batches
   (``mode="pad"``, R = ceil(batches / W): every position of the epoch at least once). A
   worker's slice holds a contiguous run of each source's sequence, read as shard ranges, plus
   the pattern saying which source each position takes (``Interleave``).

All arithmetic on keys is exact (integers), so every rank and worker agrees on every boundary.

This is the one planner: a single dataset is a mix of one source (nothing to interleave, its
samples untagged unless given as a ``Source``); ``plan_epoch``/``EpochPlan`` (plan/epoch.py) are
views of it. Compressed shards (.tar.gz, .tar.zst, ...) are planned like plain ones, so batches
stay equal per rank; a range that starts mid-shard costs more, not less data: its reader
decompresses the shard from the start and skips to the range.
"""

from __future__ import annotations

import bisect
import heapq
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from shardstream.errors import ConfigError
from shardstream.plan.requests import RequestCount, count_mix_requests
from shardstream.plan.topology import batches_per_rank as _batches_per_rank
from shardstream.plan.topology import worker_share, worker_starts

MODES = ("drop", "pad")
PER_BATCH = ("spread", "exact")
PHASES = 1 << 16  # phases are multiples of 1/PHASES, so keys are exact rationals
_MIX_TAG = 0x6D6978  # "mix": keeps the mix's random streams apart from plan_epoch's


@dataclass(frozen=True)
class Range:
    """Samples [start, stop) of shard ``shard`` (an index into the manifest)."""

    shard: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


class RankSlices:
    """Rank r takes a contiguous slice of R batches of the laid-out sequence, its workers split it
    in whole batches (``topology.worker_share``, the split every pass uses)."""

    world_size: int
    num_workers: int
    batch_size: int
    batches_per_rank: int

    @property
    def samples_per_rank(self) -> int:
        return self.batches_per_rank * self.batch_size

    def worker_batches(self, worker: int) -> int:
        return worker_share(0, self.batches_per_rank, self.num_workers, worker)[1]

    def worker_slice(self, rank: int, worker: int) -> tuple[int, int]:
        """[begin, end) positions in the laid-out (possibly wrapped) sequence."""
        if not 0 <= rank < self.world_size or not 0 <= worker < self.num_workers:
            raise ConfigError(f"(rank {rank}, worker {worker}) outside {self.world_size} ranks x {self.num_workers} workers")
        before, count = worker_share(0, self.batches_per_rank, self.num_workers, worker)
        begin = rank * self.samples_per_rank + before * self.batch_size
        return begin, begin + count * self.batch_size

    def slice_begins(self) -> np.ndarray:
        """Every worker slice's first position, in (rank, worker) order (``worker_slice`` for all
        at once): the slices tile [0, W x R x B) of the laid-out (maybe wrapped) sequence."""
        before = np.asarray(worker_starts(self.batches_per_rank, self.num_workers), dtype=np.int64)
        ranks = np.arange(self.world_size, dtype=np.int64)[:, None] * self.samples_per_rank
        return (ranks + before[None, :] * self.batch_size).ravel()


def shard_permutation(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    """A single dataset's shard order of (``seed``, ``epoch``). Any integer seed: a negative one
    counts as its two's complement in 64 bits (``seed % 2**64``: -1 is 2**64 - 1, as the mix and
    rest-of-data draws take it); a non-negative one is used whole, as ever, so every order made
    before stays."""
    seed = operator.index(seed)
    if seed < 0:
        seed %= 1 << 64
    return np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, epoch]).permutation(num_shards)


def check_seed(seed: Any) -> int:
    """``seed`` as an int, or ConfigError: any Python or numpy integer (negative or past 64 bits too)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    return int(seed)


@dataclass(frozen=True)
class Ask:
    """What a source asks of every epoch: exactly one of a weight, a repeat factor or a sample count."""

    weight: float | None = None
    repeat: float | None = None
    samples: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("weight", "repeat", "samples") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(f"a source asks for exactly one of weight, repeat or samples, got {given or 'none'}")
        value = getattr(self, given[0])
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{given[0]} must be a positive number, got {value!r}")
        if self.samples is not None and int(self.samples) != self.samples:
            raise ConfigError(f"samples must be a whole number, got {self.samples!r}")

    def describe(self) -> str:
        if self.weight is not None:
            return f"weight {self.weight:g}"
        if self.repeat is not None:
            return f"repeat {self.repeat:g}"
        return f"{self.samples} samples"

    @classmethod
    def parse(cls, text: str) -> Ask:
        """The Ask ``describe`` wrote (what a resume state names it by); ValueError for other text."""
        word, _, value = text.partition(" ")
        if word == "weight":
            return cls(weight=float(value))
        if word == "repeat":
            return cls(repeat=float(value))
        if value == "samples":
            return cls(samples=int(word))
        raise ValueError(f"not an ask: {text!r}")


@dataclass(frozen=True)
class Pass:
    """One pass over a source: its shards in ``order`` laid end to end (``starts``), entered at ``offset``."""

    order: tuple[int, ...]
    starts: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class SourceShare:
    """A source's line of the plan report (one epoch)."""

    name: str
    samples: int  # in the source
    quota: int  # asked for this epoch (after rounding)
    used: int  # read this epoch, over all ranks
    repeated: int  # reads beyond the first of a sample
    dropped: int  # quota left out so that every rank gets equal whole batches
    unseen: int  # samples of the source not read this epoch
    asked_share: float  # share of the epoch the source asked for
    share: float  # realised share of the samples read

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.used} used of {self.samples} ({self.repeated} repeated, {self.dropped} dropped, "
            f"{self.unseen} unseen), share {self.share:.4f} asked {self.asked_share:.4f}"
        )


def quotas(sizes: Sequence[int], asks: Sequence[Ask]) -> tuple[list[int], list[float]]:
    """(quota per source, the real-valued quota each asked for): step 1 of the module docstring."""
    targets = [0.0] * len(sizes)
    out = [0] * len(sizes)
    weighted = [i for i, a in enumerate(asks) if a.weight is not None]
    if weighted:
        total_weight = sum(float(asks[i].weight or 0) for i in weighted)
        shares = {i: float(asks[i].weight or 0) / total_weight for i in weighted}
        group = min(sizes[i] / shares[i] for i in weighted)
        for i in weighted:
            targets[i] = shares[i] * group
            # The limiting source's target is its size up to float rounding: never more than the source.
            out[i] = min(sizes[i], math.floor(targets[i] + 1e-6))
    for i, a in enumerate(asks):
        if a.repeat is not None:
            targets[i] = a.repeat * sizes[i]
            out[i] = math.floor(targets[i] + 0.5)
        elif a.samples is not None:
            targets[i] = float(a.samples)
            out[i] = int(a.samples)
    return out, targets


def _rng(seed: int, epoch: int, *more: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, epoch, _MIX_TAG, *more])


def _passes(counts: np.ndarray, quota: int, *, seed: int, epoch: int, source: int, shuffle: bool, alone: bool) -> tuple[Pass, ...]:
    size = int(counts.sum())
    out = []
    for p in range(-(-quota // size)):
        if not shuffle:
            perm, offset = np.arange(len(counts)), 0
        elif alone and p == 0:  # a single dataset's first pass: its order of (seed, epoch), from its start when whole
            perm = shard_permutation(len(counts), seed, epoch)
            offset = 0 if quota >= size else int(_rng(seed, epoch, source, p).integers(0, size))
        else:
            rng = _rng(seed, epoch, source, p)
            perm = rng.permutation(len(counts))
            offset = int(rng.integers(0, size))
        order = perm[counts[perm] > 0]
        starts = np.concatenate([[0], np.cumsum(counts[order])[:-1]]).astype(np.int64)
        out.append(Pass(tuple(order.tolist()), tuple(starts.tolist()), offset))
    return tuple(out)


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder, ties to the first)."""
    s = float(sum(weights))
    exact = [total * w / s for w in weights]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(out)), key=lambda i: (-(exact[i] - out[i]), i))[: total - sum(out)]:
        out[i] += 1
    return out


@dataclass(frozen=True)
class Interleave:
    """Step 3 of the module docstring: which source each position of a mixed sequence of
    ``sum(quotas)`` positions takes, as exact integer arithmetic (every rank and worker agrees)."""

    quotas: tuple[int, ...]
    per_batch: str
    batch_size: int
    phases: tuple[int, ...]  # spread: source i's phase is phases[i] / PHASES
    per_batch_counts: tuple[int, ...] = ()  # exact: samples of each source in every batch
    batch_pattern: tuple[int, ...] = ()  # exact: the source of each position in a batch

    @property
    def total(self) -> int:
        return sum(self.quotas)

    def _key_scale(self) -> tuple[int, list[int]]:
        """A common denominator for all keys and each source's factor onto it (exact integer keys)."""
        lcm = math.lcm(*(q for q in self.quotas if q)) if any(self.quotas) else 1
        return PHASES * lcm, [lcm // q if q else 0 for q in self.quotas]

    def _position(self, k: int, j: int, factors: list[int]) -> int:
        """How many samples of the mixed sequence come before the j-th sample of source k (spread)."""
        key = (j * PHASES + self.phases[k]) * factors[k]
        pos = j
        for i, q in enumerate(self.quotas):
            if i == k or q == 0:
                continue
            num, den = key - self.phases[i] * factors[i], PHASES * factors[i]
            # Source i's samples with a smaller key (or an equal one and a smaller index) come first.
            n = num // den + 1 if i < k else -(-num // den)
            pos += min(q, max(0, n))
        return pos

    def used_before(self, pos: int) -> tuple[int, ...]:
        """How many samples of each source the first ``pos`` positions of the mixed sequence take."""
        if not 0 <= pos <= self.total:
            raise ValueError(f"position {pos} outside the mixed sequence of {self.total}")
        if len(self.quotas) == 1:
            return (pos,)
        if self.per_batch == "exact":
            k, o = divmod(pos, self.batch_size)
            head = self.batch_pattern[:o]
            return tuple(k * c + head.count(i) for i, c in enumerate(self.per_batch_counts))
        _, factors = self._key_scale()
        out = []
        for k, q in enumerate(self.quotas):
            lo, hi = 0, q  # the answer is the number of j in [0, q) placed before pos
            while lo < hi:
                mid = (lo + hi) // 2
                if self._position(k, mid, factors) < pos:
                    lo = mid + 1
                else:
                    hi = mid
            out.append(lo)
        return tuple(out)

    def pattern(self, begin: int, end: int) -> Iterator[int]:
        """The source of each position in [begin, end) of the mixed sequence, in order."""
        if len(self.quotas) == 1:
            return iter([0] * (end - begin))
        if self.per_batch == "exact":
            pattern, size = self.batch_pattern, self.batch_size
            return (pattern[p % size] for p in range(begin, end))
        first, last = self.used_before(begin), self.used_before(end)
        _, factors = self._key_scale()

        def keys(i: int) -> Iterator[tuple[int, int]]:
            phase, factor = self.phases[i], factors[i]
            return (((j * PHASES + phase) * factor, i) for j in range(first[i], last[i]))

        return (i for _, i in heapq.merge(*(keys(i) for i in range(len(self.quotas)))))


def exact_pattern(per_batch_counts: Sequence[int]) -> tuple[int, ...]:
    """Each source spread over the batch positions (phase one half, the same in every batch)."""
    keyed = sorted(((2 * j + 1) / (2 * c), i) for i, c in enumerate(per_batch_counts) for j in range(c))
    return tuple(i for _, i in keyed)


@dataclass(frozen=True)
class MixPlan(RankSlices):
    """The exact plan of one epoch of a mix, from ``plan_mix`` or ``ShardStream.plan()`` on
    several ``Source`` values: plain values, the same on every rank (the module docstring says how
    it is made).

    The settings it was made for: ``epoch``, ``seed``, ``shuffle``, ``world_size``,
    ``num_workers`` (at least 1), ``batch_size``, ``per_batch`` (``"spread"`` or ``"exact"``),
    ``mode``, and per source (in the order given) its name (``names``), what it asks (``asks``)
    and its samples per shard (``counts``). What it decides: ``quotas`` (each source's samples
    this epoch; ``targets`` are the real-valued amounts asked), ``batches_per_rank`` (the same on
    every rank), each source's passes and the interleaving. ``shares()`` reports each source's
    samples used, repeated, dropped and unseen, ``ranges(rank, worker)`` lists a worker's shard
    ranges per source, ``summary()`` says it all.
    """

    epoch: int
    seed: int
    shuffle: bool
    world_size: int
    num_workers: int
    batch_size: int
    per_batch: str
    names: tuple[str, ...]
    asks: tuple[Ask, ...]
    counts: tuple[tuple[int, ...], ...]  # per source, samples per shard
    quotas: tuple[int, ...]
    targets: tuple[float, ...]
    batches_per_rank: int
    passes: tuple[tuple[Pass, ...], ...]
    phases: tuple[int, ...]  # spread: source i's phase is phases[i] / PHASES
    per_batch_counts: tuple[int, ...]  # exact: samples of each source in every batch
    batch_pattern: tuple[int, ...]  # exact: the source of each position in a batch
    mode: str = "drop"
    resumed: str = ""  # set by ShardStream.plan() when the epoch continues a saved state
    workers_note: str = ""  # set by ShardStream.plan() when the worker count is assumed, not known
    requests: str = ""  # set by ShardStream.plan() when a source is remote: the GETs it makes (plan/requests.py)
    tokens: str = ""  # set by ShardStream.plan() for token corpora: their samples are sequences (format/tokens.py)

    # -- sizes ----------------------------------------------------------------------------------
    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Samples in each source."""
        return tuple(sum(c) for c in self.counts)

    @property
    def total_samples(self) -> int:
        """T: the length of the mixed sequence (sum of quotas)."""
        return sum(self.quotas)

    @property
    def used_samples(self) -> int:
        """Positions read this epoch over all ranks (more than T in pad mode: the sequence wraps)."""
        return self.world_size * self.samples_per_rank

    @property
    def dropped(self) -> int:
        """Positions of the mixed sequence no rank reads (``mode="drop"``: the tail that cannot fill equal batches)."""
        return max(0, self.total_samples - self.used_samples)

    @property
    def repeated(self) -> int:
        """Reads of a sample beyond its first this epoch, over all sources."""
        used = self.used_in(self.used_samples)
        return sum(max(0, u - n) for u, n in zip(used, self.sizes))

    # -- the mixed sequence ----------------------------------------------------------------------
    @cached_property
    def interleave(self) -> Interleave:
        return Interleave(self.quotas, self.per_batch, self.batch_size, self.phases, self.per_batch_counts, self.batch_pattern)

    def used_before(self, pos: int) -> tuple[int, ...]:
        """How many samples of each source the first ``pos`` positions of the mixed sequence take."""
        return self.interleave.used_before(pos)

    def used_in(self, pos: int) -> tuple[int, ...]:
        """Like ``used_before``, for positions past T too (pad mode wraps around the sequence)."""
        laps, rest = divmod(pos, self.total_samples)
        whole, part = self.used_before(self.total_samples), self.used_before(rest)
        return tuple(laps * w + p for w, p in zip(whole, part))

    def pattern(self, begin: int, end: int) -> Iterator[int]:
        """The source of each position in [begin, end) of the mixed sequence, in order."""
        return self.interleave.pattern(begin, end)

    # -- reads -----------------------------------------------------------------------------------
    def source_ranges(self, source: int, begin: int, end: int) -> list[Range]:
        """Shard ranges of samples [begin, end) of source ``source``'s epoch sequence, in order."""
        counts = self.counts[source]
        size = self.sizes[source]
        passes = self.passes[source]
        out: list[Range] = []
        j = begin
        while j < end:
            p, t = divmod(j, size)
            this = passes[p]
            c = (this.offset + t) % size
            k = bisect.bisect_right(this.starts, c) - 1
            shard = this.order[k]
            local = c - this.starts[k]
            take = min(counts[shard] - local, end - j, size - t)
            out.append(Range(shard, local, local + take))
            j += take
        return out

    def reads(self, begin: int, end: int) -> tuple[list[list[Range]], Iterator[int]]:
        """What positions [begin, end) need: each source's ranges, and the interleaving pattern."""
        first, last = self.used_before(begin), self.used_before(end)
        ranges = [self.source_ranges(i, first[i], last[i]) for i in range(len(self.quotas))]
        return ranges, self.pattern(begin, end)

    def ranges(self, rank: int, worker: int) -> list[list[Range]]:
        """Per source, the shard ranges worker ``worker`` of rank ``rank`` reads this epoch. In pad
        mode a slice can run past the end of the mixed sequence, which then starts again: each lap
        of it is read as positions of the sequence."""
        begin, end = self.worker_slice(rank, worker)
        size = self.total_samples
        out: list[list[Range]] = [[] for _ in self.quotas]
        while begin < end:
            lap = begin // size
            stop = min(end, (lap + 1) * size)
            for mine, found in zip(out, self.reads(begin - lap * size, stop - lap * size)[0]):
                mine.extend(found)
            begin = stop
        return out

    # -- report ----------------------------------------------------------------------------------
    def shares(self) -> list[SourceShare]:
        """Per source, its line of the report: samples, quota, used, repeated, dropped, unseen, and
        the share asked against the share read."""
        used = self.used_in(self.used_samples)
        total_used = max(1, sum(used))
        total_target = sum(self.targets)
        out = []
        for i, name in enumerate(self.names):
            n = self.sizes[i]
            out.append(
                SourceShare(
                    name=name,
                    samples=n,
                    quota=self.quotas[i],
                    used=used[i],
                    repeated=max(0, used[i] - n),
                    dropped=max(0, self.quotas[i] - used[i]),
                    unseen=max(0, n - min(used[i], self.quotas[i])),
                    asked_share=self.targets[i] / total_target,
                    share=used[i] / total_used,
                )
            )
        return out

    def count_requests(self, manifests: Sequence[Any]) -> RequestCount:
        """The store requests this epoch makes (a ``plan.requests.RequestCount``) over its
        sources' ``manifests`` (one per source, in order; a local source makes none)."""
        return count_mix_requests(self, manifests)

    def summary(self) -> str:
        """The plan in a few lines: the mix as a whole, then one line per source (``shares()``)."""
        extra = f"{self.dropped} dropped" if self.mode == "drop" else f"{self.used_samples - self.total_samples} repeated"
        head = (
            f"epoch {self.epoch}: mix of {len(self.names)} sources, {self.total_samples} samples "
            f"({self.per_batch} per batch) -> {self.world_size} ranks x {self.batches_per_rank} batches of "
            f"{self.batch_size} ({extra}), {self.num_workers} workers per rank{self.workers_note}" + (f"; {self.resumed}" if self.resumed else "")
        )
        notes = [n for n in (self.requests, self.tokens) if n]
        return "\n".join([head, *(f"  {s}" for s in self.shares()), *(f"  {n}" for n in notes)])


@dataclass(frozen=True)
class _Epoch:
    """What an epoch's settings decide before any random draw (``mix_batches``)."""

    counts: list[np.ndarray]
    quotas: list[int]
    targets: list[float]
    per_batch_counts: list[int]
    pattern: tuple[int, ...]
    batches_per_rank: int


def _arithmetic(
    counts: Sequence[Sequence[int] | np.ndarray],
    asks: Sequence[Ask],
    *,
    world_size: int,
    num_workers: int,
    batch_size: int,
    names: Sequence[str],
    per_batch: str,
    mode: str,
) -> _Epoch:
    """Steps 1, 3 and 4 of the module docstring without a random draw: every check (a ConfigError
    naming the source and the numbers), the quotas and the batches per rank. A lone source has
    nothing to interleave: ``per_batch`` does not apply to it, and its errors speak of a dataset."""
    if per_batch not in PER_BATCH:
        raise ConfigError(f"per_batch must be one of {PER_BATCH}, got {per_batch!r}")
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    if len(counts) != len(asks) or not counts:
        raise ConfigError(f"a mix needs one ask per source and at least one source, got {len(counts)} sources, {len(asks)} asks")
    alone = len(counts) == 1
    if mode == "pad" and per_batch == "exact" and not alone:
        raise ConfigError(
            "mode='pad' with per_batch='exact' cannot work: the same count of each source in every batch "
            "leaves out what the smallest source's batches cannot carry, while pad mode promises every "
            "sample of the epoch at least once; use per_batch='spread' with mode='pad'"
        )
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if len(set(names)) != len(names):
        raise ConfigError(f"source names must differ, got {list(names)}")
    arrays = [np.asarray(c, dtype=np.int64) for c in counts]  # vectorised: 100,000 shards plan in milliseconds
    sizes = [int(c.sum()) for c in arrays]
    for name, c, n in zip(names, arrays, sizes):
        if n == 0:
            raise ConfigError(f"the dataset is empty ({len(c)} shards, 0 samples)" if alone else f"source {name!r} is empty (0 samples)")
    q, targets = quotas(sizes, asks)
    for name, qi, ask in zip(names, q, asks):
        if qi == 0:
            raise ConfigError(f"source {name!r} ({ask.describe()}) gets 0 samples per epoch; raise its share")
    workers = max(1, num_workers)
    per_batch_counts: list[int] = []
    pattern: tuple[int, ...] = ()
    if per_batch == "exact" and alone:
        per_batch_counts = [batch_size]  # every batch is the source's alone: nothing to cut to whole batches
    elif per_batch == "exact":
        per_batch_counts = apportion(batch_size, targets)
        for name, share, t in zip(names, per_batch_counts, targets):
            if share == 0:
                raise ConfigError(
                    f"batch_size {batch_size} is too small to carry source {name!r} (share {t / sum(targets):.4f}) in every "
                    f"batch: use a larger batch size or per_batch='spread'"
                )
        batches = min(qi // c for qi, c in zip(q, per_batch_counts))
        q = [c * batches for c in per_batch_counts]
        pattern = exact_pattern(per_batch_counts)
    total = sum(q)
    per_step = world_size * batch_size
    batches_per_rank = _batches_per_rank(total, world_size, batch_size, mode)
    what = "the dataset" if alone else "an epoch of this mix"
    if batches_per_rank == 0:
        raise ConfigError(
            f"batch_size {batch_size} x world_size {world_size} = {per_step} samples per step, but {what} "
            f"has only {total}: use a smaller batch size, fewer ranks, or " + ("mode='pad'" if alone else "larger shares")
        )
    if batches_per_rank < workers:
        raise ConfigError(
            f"each rank gets {batches_per_rank} batches of {batch_size}"
            + ("" if alone else " per epoch of this mix")
            + f" but num_workers is {num_workers}: {workers - batches_per_rank} workers would have nothing to read; "
            f"use num_workers <= {batches_per_rank}"
        )
    return _Epoch(arrays, q, targets, per_batch_counts, pattern, batches_per_rank)


_TUPLES: dict[int, tuple[np.ndarray, tuple[int, ...]]] = {}  # read-only count arrays as plans hold them


def _as_tuple(counts: np.ndarray) -> tuple[int, ...]:
    """Samples per shard as a plan holds them (``MixPlan.counts``). A read-only array (a stream's
    counts, ``Sources.of``) is converted once, not for every plan: 100,000 shards take longer to
    convert than to order. The cache keeps the array, so its id names it while cached."""
    if counts.flags.writeable:
        return tuple(counts.tolist())
    hit = _TUPLES.get(id(counts))
    if hit is not None and hit[0] is counts:
        return hit[1]
    if len(_TUPLES) >= 16:
        _TUPLES.clear()
    out = tuple(counts.tolist())
    _TUPLES[id(counts)] = (counts, out)
    return out


def _names(names: Sequence[str] | None, count: int) -> list[str]:
    return list(names) if names is not None else [f"source {i}" for i in range(count)]


def mix_batches(
    counts: Sequence[Sequence[int] | np.ndarray],
    asks: Sequence[Ask],
    *,
    world_size: int,
    num_workers: int,
    batch_size: int,
    names: Sequence[str] | None = None,
    per_batch: str = "spread",
    mode: str = "drop",
) -> int:
    """``plan_mix``'s batches per rank and its ConfigErrors without a random draw (no shard order:
    a stream's construction and make_loader need none, nor ``numpy.random``'s import)."""
    return _arithmetic(
        counts,
        asks,
        world_size=world_size,
        num_workers=num_workers,
        batch_size=batch_size,
        names=_names(names, len(counts)),
        per_batch=per_batch,
        mode=mode,
    ).batches_per_rank


def plan_mix(
    counts: Sequence[Sequence[int] | np.ndarray],
    asks: Sequence[Ask],
    *,
    world_size: int,
    num_workers: int,
    batch_size: int,
    names: Sequence[str] | None = None,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    per_batch: str = "spread",
    mode: str = "drop",
) -> MixPlan:
    """Plan one epoch of a mix (one source: a single dataset); raises ConfigError (naming the
    source and the numbers) for settings that cannot work."""
    names = _names(names, len(counts))
    e = _arithmetic(counts, asks, world_size=world_size, num_workers=num_workers, batch_size=batch_size, names=names, per_batch=per_batch, mode=mode)
    alone = len(counts) == 1
    passes = tuple(_passes(c, q, seed=seed, epoch=epoch, source=i, shuffle=shuffle, alone=alone) for i, (c, q) in enumerate(zip(e.counts, e.quotas)))
    phases = tuple(int(x) for x in _rng(seed, epoch).integers(0, PHASES, len(counts))) if shuffle and not alone else (0,) * len(counts)
    return MixPlan(
        epoch=epoch,
        seed=seed,
        shuffle=shuffle,
        world_size=world_size,
        num_workers=max(1, num_workers),
        batch_size=batch_size,
        per_batch=per_batch,
        names=tuple(names),
        asks=tuple(asks),
        counts=tuple(_as_tuple(c) for c in e.counts),
        quotas=tuple(e.quotas),
        targets=tuple(e.targets),
        batches_per_rank=e.batches_per_rank,
        passes=passes,
        phases=phases,
        per_batch_counts=tuple(e.per_batch_counts),
        batch_pattern=e.pattern,
        mode=mode,
    )
