"""A data epoch laid out over one topology, and what each (rank, worker) reads of it. Pure: no I/O.

A *layout* is a mixed sequence of T positions, each one sample of one source (a single dataset
is a mix of one source): source i's j-th sample sits where the interleave puts it
(``plan/mix.py``, ``Interleave``). Rank r takes positions [r*R*B, (r+1)*R*B); in pad mode
positions past T wrap around to p - T. Two layouts share this arithmetic:

- ``epoch_layout(plan_mix(...))``: a data epoch as planned, each source's sequence drawn pass by pass;
- ``RestLayout``: the samples an interrupted epoch left unconsumed, per source, laid out again
  over a new topology (an elastic resume), interleaved the same way.

What a worker reads in a window of a layout (``window_read``), and which samples a window left
unconsumed after k batches (``unconsumed``), are written once here, for both. A lone source's
shuffle streams are a single dataset's (``stream_rng`` with no source), whether it was given as
a root or as a mix of one.

A pass hands its batches out round-robin (DataLoader delivers the pass's t-th batch from worker
t % K), so worker w yields the batches t = w, w + K, ... of the pass; within each window of a
layout, its share is a contiguous slice (``worker_share``), so reads stay contiguous and, after n
batches received, every window before the one holding batch n is wholly consumed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from shardstream.plan.mix import PHASES, Interleave, MixPlan, Range, apportion, exact_pattern
from shardstream.plan.shuffle import StreamCut, cut_stream, stream_rng
from shardstream.plan.topology import batches_per_rank, consumed_in, worker_share

_REST_TAG = 0x72657374  # "rest": keeps a rest layout's phases apart from the epoch's


class SampleIds:
    """Global sample ids of one source: sample i of shard s is ``base[s] + i``."""

    def __init__(self, counts: Sequence[int] | np.ndarray):
        self.base = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)

    def of_ranges(self, ranges: Sequence[Range]) -> np.ndarray:
        if not ranges:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(self.base[r.shard] + r.start, self.base[r.shard] + r.stop, dtype=np.int64) for r in ranges])

    def ranges(self, ids: np.ndarray) -> list[Range]:
        """Ids (in read order) as shard ranges; consecutive ids of one shard become one range."""
        if len(ids) == 0:
            return []
        shards = np.searchsorted(self.base, ids, side="right") - 1
        breaks = np.flatnonzero((np.diff(ids) != 1) | (np.diff(shards) != 0)) + 1
        starts = np.concatenate([[0], breaks])
        stops = np.concatenate([breaks, [len(ids)]])
        return [Range(int(shards[a]), int(ids[a] - self.base[shards[a]]), int(ids[b - 1] - self.base[shards[a]] + 1)) for a, b in zip(starts, stops)]


class Layout:
    """The arithmetic every layout shares; subclasses say where each source's j-th sample is."""

    epoch: int
    segment: int  # 0: the epoch as planned; k: its rest after the k-th elastic resume
    seed: int
    world_size: int
    batch_size: int
    batches_per_rank: int
    total: int  # T: positions of the mixed sequence
    mode: str
    ids: list[SampleIds]  # per source
    interleave: Interleave

    # -- what subclasses define ---------------------------------------------------------------------
    def source_ranges(self, source: int, j0: int, j1: int) -> list[Range]:
        raise NotImplementedError

    def source_ids(self, source: int, j0: int, j1: int) -> np.ndarray:
        return self.ids[source].of_ranges(self.source_ranges(source, j0, j1))

    # -- shared ---------------------------------------------------------------------------------------
    @property
    def num_sources(self) -> int:
        return len(self.ids)

    @property
    def laid_out(self) -> int:
        """Positions read over all ranks: W * R * B."""
        return self.world_size * self.batches_per_rank * self.batch_size

    @property
    def dropped(self) -> int:
        return max(0, self.total - self.laid_out)

    @property
    def repeated(self) -> int:
        return max(0, self.laid_out - self.total)

    def rng(self, rank: int, worker: int, source: int, at: int):
        # one stream per source of a mix; a lone source's is a single dataset's
        return stream_rng(self.seed, self.epoch, rank, worker, source=source if len(self.ids) > 1 else None, segment=self.segment, at=at)

    def span(self, rank: int, lo: int, hi: int) -> tuple[int, int]:
        """Positions of rank ``rank``'s batches [lo, hi) of this layout."""
        base = rank * self.batches_per_rank * self.batch_size
        return base + lo * self.batch_size, base + hi * self.batch_size

    def pieces(self, p0: int, p1: int) -> list[tuple[int, int]]:
        """Positions [p0, p1) as pieces of the sequence [0, T] (pad mode wraps around)."""
        out = []
        while p0 < p1:
            lap, q0 = divmod(p0, self.total)
            q1 = min(self.total, q0 + p1 - p0)
            out.append((q0, q1))
            p0 += q1 - q0
        return out

    def runs(self, p0: int, p1: int) -> list[list[tuple[int, int]]]:
        """Per source, the runs [j0, j1) of its sequence that positions [p0, p1) take, in order."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.ids]
        for q0, q1 in self.pieces(p0, p1):
            first, last = self.interleave.used_before(q0), self.interleave.used_before(q1)
            for i, (a, b) in enumerate(zip(first, last)):
                if b > a:
                    out[i].append((a, b))
        return out

    def pattern(self, p0: int, p1: int) -> Iterator[int] | None:
        """The source of each position in [p0, p1); None for a single source (nothing to interleave)."""
        if self.num_sources == 1:
            return None
        return (i for q0, q1 in self.pieces(p0, p1) for i in self.interleave.pattern(q0, q1))

    def counts_in(self, p0: int, p1: int) -> list[int]:
        return [sum(b - a for a, b in runs) for runs in self.runs(p0, p1)]

    def ranges_of(self, source: int, runs: list[tuple[int, int]]) -> list[Range]:
        return [r for a, b in runs for r in self.source_ranges(source, a, b)]

    def ids_of(self, source: int, runs: list[tuple[int, int]]) -> np.ndarray:
        parts = [self.source_ids(source, a, b) for a, b in runs]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class _EpochLayout(Layout):
    """A data epoch as planned (segment 0), over ``plan_mix`` (one source or several)."""

    def __init__(self, plan: MixPlan, counts: Sequence[np.ndarray], *, seed: int):
        self.plan = plan
        self.epoch, self.segment, self.seed = plan.epoch, 0, seed
        self.world_size, self.batch_size, self.batches_per_rank = plan.world_size, plan.batch_size, plan.batches_per_rank
        self.total, self.mode = plan.total_samples, plan.mode
        self.ids = [SampleIds(c) for c in counts]
        self.interleave = plan.interleave

    def source_ranges(self, source: int, j0: int, j1: int) -> list[Range]:
        return self.plan.source_ranges(source, j0, j1)


def epoch_layout(plan: MixPlan, counts: Sequence[np.ndarray], *, seed: int) -> Layout:
    return _EpochLayout(plan, counts, seed=seed)


class RestLayout(Layout):
    """What an interrupted epoch left unconsumed (per source, sample ids in order), laid out again."""

    def __init__(
        self,
        rest: Sequence[np.ndarray],
        ids: Sequence[SampleIds],
        *,
        epoch: int,
        segment: int,
        seed: int,
        shuffle: bool,
        world_size: int,
        batch_size: int,
        mode: str,
        per_batch: str,
        targets: Sequence[float],
    ):
        self.epoch, self.segment, self.seed = epoch, segment, seed
        self.world_size, self.batch_size, self.mode = world_size, batch_size, mode
        self.ids = list(ids)
        self.rest = [np.asarray(r, dtype=np.int64) for r in rest]
        quotas = [len(r) for r in self.rest]
        counts: tuple[int, ...] = ()
        pattern: tuple[int, ...] = ()
        if len(self.rest) > 1 and per_batch == "exact":
            counts = tuple(apportion(batch_size, targets))
            batches = min((q // c if c else 0) for q, c in zip(quotas, counts))
            quotas = [c * batches for c in counts]  # the rest of each source beyond whole batches is left out
            pattern = exact_pattern(counts)
        if shuffle and len(quotas) > 1:
            phases = tuple(
                int(x)
                for x in np.random.default_rng([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, epoch, _REST_TAG, segment]).integers(
                    0, PHASES, len(quotas)
                )
            )
        else:
            phases = (0,) * len(quotas)
        self.interleave = Interleave(tuple(quotas), per_batch, batch_size, phases, counts, pattern)
        self.total = sum(quotas)
        # The rest of a source that exact batches cannot carry is counted as dropped, like the tail.
        self.left_out = sum(len(r) for r in self.rest) - self.total
        self.batches_per_rank = batches_per_rank(self.total, world_size, batch_size, mode)

    @property
    def dropped(self) -> int:
        return self.left_out + max(0, self.total - self.laid_out)

    def source_ranges(self, source: int, j0: int, j1: int) -> list[Range]:
        return self.ids[source].ranges(self.rest[source][j0:j1])

    def source_ids(self, source: int, j0: int, j1: int) -> np.ndarray:
        return self.rest[source][j0:j1]


# -- what a worker reads --------------------------------------------------------------------------------
@dataclass
class SourceRead:
    """One source's part of a worker's window: what to read back into its shuffle buffer, what to
    read after it, and where the shuffle stood (a fresh cut for a window read from its start)."""

    back: list[Range]  # samples that sat in the buffer, sorted by sample id
    placement: np.ndarray | None  # the buffer slot of each read-back sample
    ranges: list[Range]
    cut: StreamCut
    # Pad mode (``None`` in drop mode): how many of the samples of ``ranges``, from the first, are
    # originals (the rest are positions past T, the layout's repeats), and whether each read-back
    # sample is one. Batches carry it as ``__valid__`` (``pipeline.interleave.read_planned``).
    valid: int | None = None
    back_valid: np.ndarray | None = None


@dataclass
class WindowRead:
    """A worker's slice of one window of a layout: ``batches`` batches, per source reads, the pattern."""

    layout: Layout
    rank: int
    worker: int  # the pass's worker this slice belongs to
    batches: int
    begin: int  # positions [begin, end) still to deliver
    end: int
    sources: list[SourceRead] = field(default_factory=list)

    @property
    def epoch(self) -> int:
        return self.layout.epoch

    def pattern(self) -> Iterator[int] | None:
        return self.layout.pattern(self.begin, self.end)

    @property
    def samples(self) -> int:
        return self.end - self.begin


def window_read(
    layout: Layout, rank: int, worker: int, lo: int, t0: int, t1: int, num_workers: int, received: int, *, buffer: int, initial: int
) -> WindowRead | None:
    """Worker ``worker``'s slice of the window of batches [lo, lo + t1 - t0) of ``layout``, which
    is batches [t0, t1) of a pass of which the loop received ``received``; None when it has
    nothing left to deliver there. A slice with batches already consumed is cut: its shuffle is
    replayed over positions to find what sat in its buffer (``cut_stream``)."""
    offset, count = worker_share(t0, t1, num_workers, worker)
    consumed = consumed_in(t0, t1, received, num_workers, worker)
    if count == 0 or consumed >= count:
        return None
    p0, p1 = layout.span(rank, lo + offset, lo + offset + count)
    runs = layout.runs(p0, p1)
    read = WindowRead(layout, rank, worker, count - consumed, p0 + consumed * layout.batch_size, p1)
    outputs = layout.counts_in(p0, read.begin) if consumed else [0] * layout.num_sources
    # Pad mode: positions past T repeat the sequence from its start; in each source's stream of this
    # window they come after every original (positions ascend), so the originals are a prefix.
    originals = layout.counts_in(p0, max(p0, min(p1, layout.total))) if layout.mode == "pad" else None
    for i, source_runs in enumerate(runs):
        rng = layout.rng(rank, worker, i, lo)
        if not outputs[i]:
            read.sources.append(
                SourceRead([], None, layout.ranges_of(i, source_runs), StreamCut.fresh(rng), None if originals is None else originals[i])
            )
            continue
        stream = layout.ids_of(i, source_runs)
        cut = cut_stream(len(stream), outputs[i], buffer_size=buffer, initial=initial, rng=rng)
        buffered = np.asarray(cut.buffered, dtype=np.int64)
        held = stream[buffered]
        order = np.argsort(held, kind="stable")  # read back sorted by sample id: the i-th read sits in slot order[i]
        source = SourceRead(layout.ids[i].ranges(held[order]), order, layout.ids[i].ranges(stream[cut.taken :]), cut)
        if originals is not None:
            source.valid = max(0, originals[i] - cut.taken)
            source.back_valid = buffered[order] < originals[i]
        read.sources.append(source)
    return read


@dataclass(frozen=True)
class Consumption:
    """How a pass consumed a layout: the layout's batch 0 is at timeline position ``start``; the
    pass ran [pass_start, pass_end) with ``num_workers`` workers and the loop received
    ``received`` of its batches (a timeline counts every rank's batches, one per step)."""

    start: int
    pass_start: int
    pass_end: int
    num_workers: int
    received: int
    buffer: int
    initial: int

    def window(self, layout: Layout) -> tuple[int, int, int]:
        """(lo, hi, t0): the layout's batches [lo, hi) this pass covers, the first as its batch t0."""
        r = layout.batches_per_rank
        lo = min(r, max(0, self.pass_start - self.start))
        hi = max(lo, min(r, self.pass_end - self.start))
        return lo, hi, self.start + lo - self.pass_start


def unconsumed(layout: Layout, used: Consumption) -> list[np.ndarray]:
    """Per source, the ids of the samples ``layout`` has not delivered after ``used``, in a fixed
    order (rank by rank: each worker's buffered samples sorted by id, then its unread rest; then
    the rank's batches past this pass). Batches before this pass's window were delivered whole.
    Pad mode counts a sample delivered once any of its wrapped positions was: what is left is the
    positions of the sequence none of whose copies was delivered, once each."""
    lo, hi, t0 = used.window(layout)
    t1 = t0 + hi - lo
    ids: list[list[np.ndarray]] = [[] for _ in range(layout.num_sources)]
    js: list[list[np.ndarray]] = [[] for _ in range(layout.num_sources)]  # the same, as sequence indices (pad mode)
    for rank in range(layout.world_size):
        for worker in range(used.num_workers):
            offset, count = worker_share(t0, t1, used.num_workers, worker)
            if not count:
                continue
            consumed = consumed_in(t0, t1, used.received, used.num_workers, worker)
            p0, p1 = layout.span(rank, lo + offset, lo + offset + count)
            outputs = layout.counts_in(p0, p0 + consumed * layout.batch_size)
            for i, source_runs in enumerate(layout.runs(p0, p1)):
                stream = layout.ids_of(i, source_runs)
                index = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in source_runs] or [np.zeros(0, np.int64)])
                cut = cut_stream(len(stream), outputs[i], buffer_size=used.buffer, initial=used.initial, rng=layout.rng(rank, worker, i, lo))
                order = np.asarray(cut.buffered, dtype=np.int64)
                order = order[np.argsort(stream[order], kind="stable")]
                ids[i] += [stream[order], stream[cut.taken :]]
                js[i] += [index[order], index[cut.taken :]]
        p0, p1 = layout.span(rank, hi, layout.batches_per_rank)
        for i, source_runs in enumerate(layout.runs(p0, p1)):
            ids[i].append(layout.ids_of(i, source_runs))
            js[i].append(np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in source_runs] or [np.zeros(0, np.int64)]))
    rest = [np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64) for parts in ids]
    if layout.laid_out <= layout.total:
        return rest  # nothing wraps: every unconsumed position is a sample still owed
    owed = []
    every = layout.runs(0, layout.laid_out)
    for i, (left, where) in enumerate(zip(rest, js)):
        index = np.concatenate(where) if where else np.zeros(0, dtype=np.int64)
        all_js = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in every[i]] or [np.zeros(0, np.int64)])
        copies, copies_count = np.unique(all_js, return_counts=True)
        left_js, left_count = np.unique(index, return_counts=True)
        untouched = left_js[left_count == copies_count[np.searchsorted(copies, left_js)]]
        keep = np.isin(index, untouched)
        _, first = np.unique(index[keep], return_index=True)
        owed.append(left[keep][np.sort(first)])
    return owed
