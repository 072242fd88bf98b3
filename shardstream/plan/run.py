"""The one schedule: every pass of a run is a window over one sequence of data epochs. Pure: no I/O.

A run reads data epochs one after another; data epoch e is a layout (plan/layout.py) of R
batches per rank. Laid end to end they form the run's *timeline* of steps (one batch on every
rank per step). A pass (one ``for batch in loader``, loader epoch k) is a window of it:

- a run by epochs: pass k is data epoch k, whole (each on its own timeline from 0);
- ``steps=N``: pass k is steps [kN, (k+1)N), crossing data epochs as it goes, so no rank ever
  runs dry and every loader epoch has N steps; ``samples_per_epoch=S`` is N = S // (W * B), and
  ``tokens=T`` (token corpora, sequences of seq_len + 1) is S = T // seq_len.

One planner for every run: a single dataset is a mix of one source (plan/mix.py), so
``ShardStream(root)`` and ``ShardStream([Source(root)])`` read the same samples in the same order
and save interchangeable states; they differ only in what they report (an ``EpochPlan`` for a
root, a ``MixPlan`` for sources given as a list) and in ``__source__``, which samples of sources
given as a list carry. One source or a mix, drop or pad, every window is read the same way (``window_read``): DataLoader
hands a pass's batches out round-robin, so worker w yields the pass's batches w, w + K, ...; in
each window its share is a contiguous slice of every rank's part of the layout.

A resume state (plan/state.py) is a position on the timeline. On the topology it was saved on,
the pass goes on exactly: each worker replays its shuffle over positions to learn what sat in its
buffer, reads that back and continues. On another topology the data epoch in progress is finished
first: what it left unconsumed (every source's samples, once each) is laid out again over the new
topology (``RestLayout``: fewer than W * B samples left out in drop mode, padded to a multiple of
W * B in pad mode), then fresh data epochs follow on the new topology. A run by epochs yields the
rest of that epoch in the resumed pass; a run by steps yields the rest of the pass (N - k steps).

``RunPlan`` is all ``ShardStream`` asks: ``batches_per_pass``, ``report(e)`` (a data epoch's plan),
``pass_plan(loader_epoch, num_workers, state)`` -> ``PassPlan`` (``.worker(rank, worker)``: its
reads; ``.state_after(n)``: the state after n received batches; ``.summary()``) and ``load(doc)``.
A ``Cursor`` (plan/cursor.py) is where one consumer stands in a pass: every state the loader or
the dataset gives is a cursor's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardstream.errors import ConfigError, StateError
from shardstream.plan.epoch import WHOLE, EpochPlan
from shardstream.plan.layout import Consumption, Layout, RestLayout, WindowRead, epoch_layout, unconsumed, window_read
from shardstream.plan.mix import Ask, MixPlan, mix_batches, plan_mix, quotas
from shardstream.plan.state import Segment, State
from shardstream.plan.topology import Topology

_CURRICULUM_TAG = 0x637572  # "cur": the draw of what a curriculum's new asks keep of an epoch's rest


@dataclass(frozen=True, eq=False)
class Sources:
    """What planning knows of a run's data: samples per shard of each source, what each asks of an
    epoch, and what a state names them by (``identity``, from ``Sources.of``). ``names``: the
    sources' names when given as a list (its samples carry ``__source__``; a plan reports as a
    ``MixPlan``), empty for a dataset given as a root (untagged samples, an ``EpochPlan``). The
    planning is the same either way."""

    counts: tuple[np.ndarray, ...]
    identity: tuple[dict[str, Any], ...]
    names: tuple[str, ...] = ()
    asks: tuple[Ask, ...] = (WHOLE,)
    compressed_shards: int = 0  # reported by a single dataset's plan

    @classmethod
    def of(
        cls,
        counts: Sequence[np.ndarray],
        digests: Sequence[str],
        names: Sequence[str] = (),
        asks: Sequence[Ask] = (WHOLE,),
        compressed_shards: int = 0,
        *,
        documents: bool = False,
    ) -> Sources:
        """Sources with their identity: for a mix, each source's name, manifest digest, samples and
        ask; for one source its digest and samples (and its ask when an epoch is not one whole
        pass of it), no name, so a dataset's states resume under any name, given as a root or as a
        mix of one (plan/state.py: version 3); ``documents``: each also says its documents are
        shuffled (a token corpus under ``Shuffle(documents=True)``)."""
        counts = tuple(np.array(c, dtype=np.int64) for c in counts)
        for c in counts:
            c.flags.writeable = False  # planned from, never changed (plan/mix.py converts it once)
        sizes = [int(c.sum()) for c in counts]
        if len(counts) == 1:
            ident: dict[str, Any] = {"manifest": digests[0], "samples": sizes[0]}
            if quotas(sizes, asks)[0][0] != sizes[0]:
                ident["ask"] = asks[0].describe()
            identity: tuple[dict[str, Any], ...] = (ident,)
        else:
            identity = tuple({"name": n, "manifest": d, "samples": size, "ask": a.describe()} for n, d, size, a in zip(names, digests, sizes, asks))
        if documents:  # a token corpus's documents shuffled: its sequences hold other tokens than in the corpus's order
            identity = tuple({**ident, "documents": "shuffled"} for ident in identity)
        return cls(counts, identity, tuple(names), tuple(asks), compressed_shards)


@dataclass(frozen=True)
class RunSettings:
    seed: int
    shuffle: bool
    mode: str
    per_batch: str
    world_size: int
    batch_size: int
    shuffle_buffer: int
    shuffle_initial: int
    steps: int | None = None
    samples_per_epoch: int | None = None
    # Schedule(tokens=T) over token corpora of ``seq_len``: samples_per_epoch is T // seq_len
    # (seq_len trained tokens a sequence), and the state names the run by T.
    tokens: int | None = None
    seq_len: int = 0


@dataclass(frozen=True)
class Window:
    """Batches [lo, hi) of a layout, its batch lo at timeline position ``at``; ``start`` is where the
    layout's batch 0 is, ``history`` the segments of its data epoch before this layout."""

    layout: Layout
    lo: int
    hi: int
    at: int
    history: tuple[Segment, ...] = ()

    @property
    def start(self) -> int:
        return self.at - self.lo

    @property
    def end(self) -> int:
        return self.at + self.hi - self.lo


class Timeline:
    """Which layout covers each step of a run: data epochs of ``batches`` steps laid end to end,
    data epoch ``epoch`` starting at ``start``; ``first`` (a layout and where it starts), when
    given, is data epoch ``epoch - 1``: the epoch a state was loaded in, as it goes on."""

    def __init__(
        self,
        fresh: Callable[[int], Layout],
        batches: int,
        epoch: int = 0,
        start: int = 0,
        first: tuple[Layout, int, tuple[Segment, ...]] | None = None,
    ):
        self.fresh, self.batches, self.epoch, self.start, self.first = fresh, batches, epoch, start, first

    def windows(self, a: int, b: int) -> list[Window]:
        out = []
        x = a
        while x < b:
            layout, start, history = self._at(x)
            hi = min(b - start, layout.batches_per_rank)
            if hi > x - start:
                out.append(Window(layout, x - start, hi, x, history))
            x = start + layout.batches_per_rank
        return out

    def _at(self, x: int) -> tuple[Layout, int, tuple[Segment, ...]]:
        if self.first is not None:
            layout, start, history = self.first
            if start <= x < start + layout.batches_per_rank:
                return layout, start, history
            if x < start:  # before the loaded epoch: earlier epochs, back to back, ending where it starts
                back = -(-(start - x) // self.batches)
                return self.fresh(layout.epoch - back), start - back * self.batches, ()
        epoch = self.epoch + (x - self.start) // self.batches
        return self.fresh(epoch), self.start + (epoch - self.epoch) * self.batches, ()


@dataclass
class WorkerPlan:
    """What one DataLoader worker of one rank yields in a pass: ``num_batches`` batches, read window by window."""

    rank: int
    worker: int
    plays: int  # the pass's worker whose batches it delivers (a resumed pass keeps the round-robin order)
    num_batches: int
    windows: list[WindowRead]
    names: tuple[str, ...] | None  # a mix tags each sample with its source's name
    shuffle_buffer: int
    shuffle_initial: int


@dataclass(frozen=True)
class Resumption:
    """How a resumed pass continues the state it was loaded from (``PassPlan.summary`` says it):
    ``how`` is ``"exact"`` (the same topology: the pass goes on), ``"fresh"`` (another topology,
    nothing of the epoch consumed: it starts afresh) or ``"elastic"`` (another topology: the rest
    of the epoch is laid out again). ``epoch``: the data epoch; ``done``: batches per rank of it
    received on ``saved_on``; ``batches``: batches per rank of the layout the pass reads it by (the
    epoch's own for an exact resume); ``left``: samples of the epoch not yet consumed (elastic)."""

    how: str
    epoch: int
    done: int
    saved_on: Topology
    batches: int
    left: int = 0
    asks: str = ""  # a curriculum: the sources' asks before -> now


@dataclass(frozen=True, eq=False)
class PassPlan:
    """One pass: windows [pass_start, pass_end) of the timeline, of which ``received`` batches were
    received before (a pass resumed on its own topology); what every (rank, worker) reads. Built
    whole and never changed: a resumed pass carries its ``timeline`` (the run's from the loaded
    state on) and its ``resumption``, from which ``summary()`` is rendered."""

    run: RunPlan
    loader_epoch: int
    topology: Topology
    windows: tuple[Window, ...]
    pass_start: int
    pass_end: int
    received: int = 0
    loaded: State | None = None
    exact: bool | None = None
    dropped: int = 0
    repeated: int = 0
    timeline: Timeline | None = None
    resumption: Resumption | None = None

    @property
    def batches_per_rank(self) -> int:
        """Batches every rank yields in this pass (the rest of it, in a resumed pass)."""
        return self.pass_end - self.pass_start - self.received

    def worker(self, rank: int, worker: int) -> WorkerPlan:
        k = self.topology.num_workers
        if not 0 <= rank < self.topology.world_size or not 0 <= worker < k:
            raise ConfigError(f"(rank {rank}, worker {worker}) outside {self.topology.world_size} ranks x {k} workers")
        plays = (worker + self.received) % k
        reads = []
        for w in self.windows:
            t0 = w.at - self.pass_start
            read = window_read(
                w.layout,
                rank,
                plays,
                w.lo,
                t0,
                t0 + w.hi - w.lo,
                k,
                self.received,
                buffer=self.topology.shuffle_buffer,
                initial=self.topology.shuffle_initial,
            )
            if read is not None:
                reads.append(read)
        names = self.run.sources.names or None
        return WorkerPlan(
            rank, worker, plays, sum(r.batches for r in reads), reads, names, self.topology.shuffle_buffer, self.topology.shuffle_initial
        )

    def state_after(self, batches: int) -> dict[str, Any]:
        """The resume state once every rank received ``batches`` batches of this pass."""
        if not 0 <= batches <= self.batches_per_rank:
            raise ConfigError(f"{batches} batches received, but this pass has {self.batches_per_rank} per rank")
        if self.loaded is not None and batches == 0:
            return self.loaded.to_json()  # nothing new: the state as loaded, on whatever topology it was saved
        received = self.received + batches
        x = self.pass_start + received
        window = self._window_at(x)
        segment = Segment(self.topology, window.start, self.pass_start, None if self.run.by_epochs else self.pass_end, received)
        return self.run.state(self.loader_epoch, window.layout.epoch, window.history + (segment,)).to_json()

    def _window_at(self, x: int) -> Window:
        for w in self.windows:
            if w.at <= x < w.end:
                return w
        if self.windows and x == self.windows[-1].end:
            return self.windows[-1]
        # An empty pass (a resumed one with nothing left): the epoch it was in, complete.
        layout = self.run.layout(self.loader_epoch)
        return Window(layout, layout.batches_per_rank, layout.batches_per_rank, x)

    def summary(self) -> str:
        r = self.resumption
        if r is not None:
            return self._resumed_summary(r)
        first = self.windows[0].layout.epoch if self.windows else self.loader_epoch
        head = self.run.as_report(self.run.plan_epoch(first, self.topology.num_workers if self.run.by_epochs else 1)).summary()
        if self.run.by_epochs:
            return head
        last = self.windows[-1].layout.epoch if self.windows else first
        return (
            f"loader epoch {self.loader_epoch}: steps {self.pass_start}..{self.pass_end} of the run, "
            f"{self.batches_per_rank} batches per rank from data epochs {first}..{last}; {head}"
        )

    def _resumed_summary(self, r: Resumption) -> str:
        now, old = self.topology.describe(), r.saved_on.describe()
        if r.how == "exact":
            return (
                f"resuming epoch {r.epoch} exactly after {r.done} of {r.batches} batches per rank "
                f"({now}): {self.batches_per_rank} batches per rank to go"
            )
        extra = f"{self.dropped} dropped" if self.run.settings.mode == "drop" else f"{self.repeated} repeated"
        if r.how == "fresh":
            return f"resuming epoch {r.epoch} from its start on {now} (none of it was consumed on {old}): {r.batches} batches per rank ({extra})"
        how, drawn = (f"with new asks ({r.asks})", " drawn by them") if r.asks else ("elastically", "")
        text = (
            f"resuming epoch {r.epoch} {how}: {r.left} samples not yet consumed after {r.done} "
            f"batches per rank on {old}{drawn} -> {now}: {r.batches} batches per rank ({extra})"
        )
        if not self.run.by_epochs:
            text += f"; this pass yields {self.batches_per_rank} batches per rank, then fresh data epochs follow"
        return text


def check_length(steps: int | None, samples_per_epoch: int | None, tokens: int | None = None) -> None:
    """A run's length: by epochs (all None), ``steps``, ``samples_per_epoch`` or ``tokens``, a positive integer."""
    given = [name for name, x in (("steps", steps), ("samples_per_epoch", samples_per_epoch), ("tokens", tokens)) if x is not None]
    if len(given) == 2:
        raise ConfigError(f"give {given[0]} or {given[1]}, not both")
    if len(given) > 2:
        raise ConfigError("give one of steps, samples_per_epoch or tokens, not all three")
    for name, value in (("steps", steps), ("samples_per_epoch", samples_per_epoch), ("tokens", tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"Schedule({name}=...) must be a positive integer, got {value!r}")


class RunPlan:
    """A run's schedule over its sources (see the module docstring)."""

    def __init__(self, sources: Sources, settings: RunSettings):
        self.sources, self.settings = sources, settings
        s = settings
        check_length(s.steps, s.samples_per_epoch)
        self._layouts: dict[tuple[int, int, int, tuple[Ask, ...] | None], Layout] = {}
        self._resumed_plan: tuple[State, Topology, PassPlan] | None = None  # the last resumed pass planned
        self._replayed: tuple[State, list[Layout]] | None = None  # the last state's segment layouts
        self.batches_per_epoch = self._epoch_batches(1)  # settings that cannot work fail here
        self.batches_per_pass = self._pass_length(s.world_size, s.batch_size)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_layouts"], state["_resumed_plan"], state["_replayed"] = {}, None, None  # caches: rebuilt where needed
        return state

    @property
    def by_epochs(self) -> bool:
        return self.settings.steps is None and self.settings.samples_per_epoch is None

    @property
    def run_json(self) -> dict[str, int]:
        s = self.settings
        if s.tokens is not None:
            return {"tokens": s.tokens}
        return {"steps": s.steps} if s.steps is not None else {"samples_per_epoch": s.samples_per_epoch} if s.samples_per_epoch is not None else {}

    def _pass_length(self, world_size: int, batch_size: int) -> int:
        s = self.settings
        if s.samples_per_epoch is not None:
            steps = s.samples_per_epoch // (world_size * batch_size)
            if steps < 1 and s.tokens is not None:
                raise ConfigError(
                    f"Schedule(tokens={s.tokens}) is less than one step of batch_size x world_size x seq_len = "
                    f"{world_size * batch_size * s.seq_len} tokens"
                )
            if steps < 1:
                raise ConfigError(
                    f"samples_per_epoch={s.samples_per_epoch} is less than one step of batch_size x world_size = {world_size * batch_size} samples"
                )
            return steps
        return s.steps if s.steps is not None else self.batches_per_epoch

    def topology(self, num_workers: int) -> Topology:
        s = self.settings
        return Topology(s.world_size, max(1, num_workers), s.batch_size, s.shuffle_buffer, s.shuffle_initial)

    def check_workers(self, num_workers: int) -> None:
        """Refuse a worker count that leaves workers with nothing to yield, naming the numbers."""
        if self.by_epochs:
            self._epoch_batches(num_workers)  # the planner says it with its numbers
        elif self.batches_per_pass < num_workers:
            raise ConfigError(
                f"steps={self.batches_per_pass} per rank but num_workers is {num_workers}: "
                f"{num_workers - self.batches_per_pass} workers would have nothing to yield"
            )

    def report(self, epoch: int, num_workers: int | None = None, assumed: int = 1) -> EpochPlan | MixPlan:
        """The plan of data epoch ``epoch`` as a report, ``num_workers`` checked (without it, for
        ``assumed`` workers, unchecked): a run by epochs splits each epoch among the workers; a run
        by steps splits each pass, so its plan is for one."""
        if num_workers is not None:
            self.check_workers(num_workers)
        return self.as_report(self.plan_epoch(epoch, max(1, num_workers if num_workers is not None else assumed) if self.by_epochs else 1))

    def as_report(self, plan: MixPlan) -> EpochPlan | MixPlan:
        """A data epoch's plan as the stream reports it: a dataset given as a root as one dataset
        (``EpochPlan``, a view of the same plan), sources given as a list as a mix."""
        return plan if self.sources.names else EpochPlan(plan, self.sources.compressed_shards)

    # -- data epochs --------------------------------------------------------------------------------
    def _names(self) -> list[str] | None:
        return list(self.sources.names) or None

    def _epoch_batches(self, num_workers: int) -> int:
        """Batches per rank of a data epoch, its settings checked as ``plan_epoch`` checks them,
        without planning a shard order (construction and make_loader need no permutation, nor
        ``numpy.random``'s import)."""
        s, src = self.settings, self.sources
        return mix_batches(
            src.counts,
            src.asks,
            world_size=s.world_size,
            num_workers=num_workers,
            batch_size=s.batch_size,
            names=self._names(),
            per_batch=s.per_batch,
            mode=s.mode,
        )

    def plan_epoch(
        self, epoch: int, num_workers: int = 1, world_size: int | None = None, batch_size: int | None = None, asks: tuple[Ask, ...] | None = None
    ) -> MixPlan:
        """The plan of data epoch ``epoch`` (one source or a mix: ``as_report`` gives the report);
        raises ConfigError for settings that cannot work."""
        s, src = self.settings, self.sources
        return plan_mix(
            src.counts,
            asks if asks is not None else src.asks,
            world_size=world_size or s.world_size,
            num_workers=num_workers,
            batch_size=batch_size or s.batch_size,
            names=self._names(),
            seed=s.seed,
            epoch=epoch,
            shuffle=s.shuffle,
            per_batch=s.per_batch,
            mode=s.mode,
        )

    def layout(self, epoch: int, world_size: int | None = None, batch_size: int | None = None, asks: tuple[Ask, ...] | None = None) -> Layout:
        """Data epoch ``epoch`` laid out (``asks``: what the sources asked then, a curriculum's earlier asks)."""
        asks = asks if asks is not None and asks != self.sources.asks else None
        key = (epoch, world_size or self.settings.world_size, batch_size or self.settings.batch_size, asks)
        found = self._layouts.get(key)
        if found is None:
            if len(self._layouts) > 8:
                self._layouts.clear()
            plan = self.plan_epoch(epoch, 1, key[1], key[2], asks)
            found = self._layouts[key] = epoch_layout(plan, self.sources.counts, seed=self.settings.seed)
        return found

    # -- states ---------------------------------------------------------------------------------------
    def state(self, loader_epoch: int, epoch: int, segments: tuple[Segment, ...]) -> State:
        s = self.settings
        return State(self.sources.identity, s.seed, s.shuffle, s.mode, s.per_batch, self.run_json, loader_epoch, epoch, segments)

    def load(self, doc: Mapping[str, Any]) -> State:
        """Read and check a state: StateError for a state of other data, order or run."""
        state = State.from_json(doc)
        s = self.settings
        state.check(sources=self.sources.identity, seed=s.seed, shuffle=s.shuffle, mode=s.mode, per_batch=s.per_batch, run=self.run_json)
        if state.asks_changed(self.sources.identity):  # a curriculum: what was consumed under the old asks, the rest under these
            state = state.asked_now(self.sources.identity)
        self._replay(state)  # a state that does not fit this data fails now, not in a worker
        return state

    def finished(self, state: State) -> bool:
        """The state's pass was over where it was saved (its loop received every batch of it)."""
        return self._resumed(state, state.last.topology).batches_per_rank == 0

    def _replay(self, state: State) -> list[Layout]:
        """The layout of every segment of the state's data epoch."""
        if self._replayed is not None and self._replayed[0] is state:
            return self._replayed[1]
        layouts: list[Layout] = []
        for i, seg in enumerate(state.segments):
            t = seg.topology
            if i == 0:
                layout = self.layout(state.epoch, t.world_size, t.batch_size, self.asks_of(seg))
            else:
                layout = self._rest(layouts[-1], state.segments[i - 1], i, t, self.asks_of(seg))
            if seg.position - seg.start > layout.batches_per_rank:
                raise StateError(
                    f"the resume state says {seg.position - seg.start} batches were received in segment {i}, "
                    f"which has only {layout.batches_per_rank} per rank; the state does not fit this dataset"
                )
            layouts.append(layout)
        self._replayed = (state, layouts)
        return layouts

    def _consumption(self, layout: Layout, seg: Segment) -> Consumption:
        t = seg.topology
        end = seg.pass_end if seg.pass_end is not None else seg.start + layout.batches_per_rank
        return Consumption(seg.start, seg.pass_start, end, t.num_workers, seg.batches, t.shuffle_buffer, t.shuffle_initial)

    def asks_of(self, seg: Segment) -> tuple[Ask, ...]:
        """What each source asked when ``seg`` was laid out (a curriculum's earlier asks), else now."""
        if seg.asks is None:
            return self.sources.asks
        try:
            return tuple(Ask.parse(a) for a in seg.asks)
        except (ValueError, ConfigError) as exc:
            raise StateError(f"resume state segment asks {list(seg.asks)} are not asks ({exc}); it was not written by state_dict()") from exc

    def _rest(self, layout: Layout, seg: Segment, index: int, topology: Topology, asks: tuple[Ask, ...] | None = None) -> RestLayout:
        """What ``layout`` left after ``seg``, laid out again over ``topology`` as segment ``index``.
        Asked other shares than ``seg`` was (a curriculum), each source's rest is cut to its
        share of the new asks (``quotas`` of what is left: the source the new shares limit is
        used whole), a seeded choice kept in order; what is cut is not seen this data epoch."""
        s = self.settings
        asks = asks if asks is not None else self.sources.asks
        targets = quotas([int(c.sum()) for c in self.sources.counts], asks)[1]
        rest = unconsumed(layout, self._consumption(layout, seg))
        if asks != self.asks_of(seg):
            keep = quotas([len(r) for r in rest], asks)[0]
            rng = np.random.default_rng([s.seed & 0xFFFFFFFF, (s.seed >> 32) & 0xFFFFFFFF, layout.epoch, index, _CURRICULUM_TAG])
            rest = [r if q >= len(r) else r[np.sort(rng.choice(len(r), q, replace=False))] for r, q in zip(rest, keep)]
        return RestLayout(
            rest,
            layout.ids,
            epoch=layout.epoch,
            segment=index,
            seed=s.seed,
            shuffle=s.shuffle,
            world_size=topology.world_size,
            batch_size=topology.batch_size,
            mode=s.mode,
            per_batch=s.per_batch,
            targets=targets,
        )

    # -- passes ---------------------------------------------------------------------------------------
    def pass_plan(self, loader_epoch: int, num_workers: int, state: State | None = None, resumed: bool = False) -> PassPlan:
        """Pass ``loader_epoch`` with ``num_workers`` workers per rank. ``state``: the state loaded
        (a run by steps lays its later passes out from it too); ``resumed``: this pass is the one
        that continues it."""
        topology = self.topology(num_workers)
        if resumed and state is not None and state.loader_epoch == loader_epoch:
            return self._resumed(state, topology)
        if self.by_epochs:  # pass k is data epoch k, on its own timeline
            timeline = Timeline(self.layout, self.batches_per_epoch, loader_epoch, 0)
            return PassPlan(self, loader_epoch, topology, tuple(timeline.windows(0, self.batches_per_epoch)), 0, self.batches_per_epoch)
        timeline, at, anchor = self._timeline(state, topology)
        a = at + (loader_epoch - anchor) * self.batches_per_pass
        b = a + self.batches_per_pass
        return PassPlan(self, loader_epoch, topology, tuple(timeline.windows(a, b)), a, b)

    def _timeline(self, state: State | None, topology: Topology) -> tuple[Timeline, int, int]:
        """A run by steps: its timeline, and (x, k) where pass k starts at step x. Fresh, pass k
        starts at k * N; after a state was loaded, the pass after the resumed one starts where it ends."""
        if state is None:
            return Timeline(self.layout, self.batches_per_epoch), 0, 0
        plan = self._resumed(state, topology)
        assert plan.timeline is not None
        return plan.timeline, plan.pass_end, state.loader_epoch + 1

    def _resumed(self, state: State, topology: Topology) -> PassPlan:
        cached = self._resumed_plan
        if cached is None or cached[0] is not state or cached[1] != topology:
            cached = self._resumed_plan = (state, topology, self._plan_resumed(state, topology))
        return cached[2]

    def _plan_resumed(self, state: State, topology: Topology) -> PassPlan:
        layouts = self._replay(state)
        last, layout = state.last, layouts[-1]
        x = last.position
        epoch_end = last.start + layout.batches_per_rank
        pass_end = last.pass_end if last.pass_end is not None else epoch_end
        if pass_end < x:
            raise StateError(f"the resume state stops at step {x}, past the end of its pass ({pass_end})")
        k, e = state.loader_epoch, state.epoch
        done = x - last.start
        changed = self.asks_of(last) != self.sources.asks  # a curriculum: the rest of the epoch by the new asks
        if last.topology == topology and not changed:  # exact: the same pass goes on, each worker from where it stood
            timeline = Timeline(self.layout, self.batches_per_epoch, e + 1, epoch_end, (layout, last.start, state.segments[:-1]))
            windows = timeline.windows(max(last.pass_start, last.start), pass_end)
            return PassPlan(
                self,
                k,
                topology,
                tuple(windows),
                last.pass_start,
                pass_end,
                last.batches,
                loaded=state,
                exact=True,
                timeline=timeline,
                resumption=Resumption("exact", e, done, last.topology, layout.batches_per_rank),
            )
        old = last.topology
        end = self._pass_end(x, pass_end, old, topology)
        if len(state.segments) == 1 and x == last.start:  # nothing of this epoch consumed: it starts afresh here
            fresh = self.layout(e)
            timeline = Timeline(self.layout, self.batches_per_epoch, e + 1, x + fresh.batches_per_rank, (fresh, x, ()))
            windows = timeline.windows(x, x + fresh.batches_per_rank if self.by_epochs else end)
            return PassPlan(
                self,
                k,
                topology,
                tuple(windows),
                x,
                windows[-1].end if self.by_epochs and windows else end,
                loaded=state,
                exact=False,
                dropped=fresh.dropped,
                repeated=fresh.repeated,
                timeline=timeline,
                resumption=Resumption("fresh", e, done, old, fresh.batches_per_rank),
            )
        rest = self._rest(layout, last, len(state.segments), topology, self.sources.asks)
        timeline = Timeline(self.layout, self.batches_per_epoch, e + 1, x + rest.batches_per_rank, (rest, x, state.segments))
        if self.by_epochs:
            end = x + rest.batches_per_rank
        return PassPlan(
            self,
            k,
            topology,
            tuple(timeline.windows(x, end)),
            x,
            end,
            loaded=state,
            exact=False,
            dropped=rest.dropped,
            repeated=rest.repeated,
            timeline=timeline,
            resumption=Resumption(
                "elastic", e, done, old, rest.batches_per_rank, rest.total + rest.left_out, self._asks_change(last) if changed else ""
            ),
        )

    def _asks_change(self, seg: Segment) -> str:
        before, now = self.asks_of(seg), self.sources.asks
        names = self.sources.names or [str(i) for i in range(len(now))]
        return ", ".join(f"{n}: {a.describe()} -> {b.describe()}" for n, a, b in zip(names, before, now) if a != b)

    def _pass_end(self, x: int, pass_end: int, old: Topology, new: Topology) -> int:
        """Where a resumed pass of a run by steps ends on the new topology: ``steps`` counts steps
        (the same N - k on any topology), ``samples_per_epoch`` samples (the rest, in new steps)."""
        if self.settings.samples_per_epoch is None:
            return pass_end
        return x + (pass_end - x) * old.world_size * old.batch_size // (new.world_size * new.batch_size)
