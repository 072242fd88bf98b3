"""Resume an epoch after preemption: from a small state, which samples every old (rank, worker)
consumed, which remain, and how each new (rank, worker) reads the rest. Pure: no I/O.

The state (``ResumeState``, JSON, versioned, a few hundred bytes) names the dataset (manifest
digest, sample count), the seed, shuffle and mode, the epoch, and its *segments*: a segment is a
stretch of the epoch run under one topology (world size, workers, batch size, shuffle buffer)
with the number of batches every rank received in it. Segment 0 follows ``plan_epoch``; each
later segment lays out again what the earlier ones left unconsumed (an elastic resume).

1. Every rank receives the same number n of batches. DataLoader hands out worker batches
   round-robin in order, and the plan gives the uneven tail to the first workers, so worker i's
   k-th batch is the (k*K + i)-th the loop received: worker i has consumed #{k : k*K + i < n}.
2. A worker's outputs are its stream (the samples it reads, in read order) passed through the
   buffered shuffle, whose decisions depend only on item counts. Running the same
   ``BufferShuffler`` over stream positions (ints) up to b = consumed * batch_size outputs tells
   exactly which positions were output, which sit in the buffer (in buffer order), where the
   read stopped, and leaves the RNG in the state the real worker had: linear in the positions
   read, no sample bytes.
3. Exact resume (same topology as the last segment): each worker reads back only its buffered
   samples (single-sample ranges from the manifest offsets, at most one buffer's worth) and its
   unread suffix, restores the buffer and RNG and continues. DataLoader worker d plays the
   segment's worker (d + n) % K, so the round-robin resumes at batch n, in the same order.
4. Elastic resume (any of world size, workers, batch size, buffer changed): the unconsumed
   samples of every old worker (buffered ones sorted by position in the dataset, then the
   unread suffix), old (rank, worker) by old (rank, worker), form one sequence U. It is split
   like ``plan_epoch`` steps 3-5: equal batches per rank, floor(|U| / (W*B)) dropping the
   leftover (counted) or ceil() padding by wrapping around (counted), contiguous per rank, then
   per worker; each new worker shuffles its part with a segment-specific seed.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from shardstream.errors import StateError
from shardstream.pipeline.shuffle import BufferShuffler, shuffle_samples, worker_rng
from shardstream.plan.epoch import MODES, Range, plan_epoch

FORMAT = "shardstream-resume"
VERSION = 1

T = TypeVar("T")


def dataset_digest(shards: Iterable[tuple[str, int, int, str | None]]) -> str:
    """A short fingerprint of (path, samples, bytes, sha256) of every shard, in manifest order."""
    text = json.dumps([list(s) for s in shards], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Segment:
    """A stretch of an epoch run under one topology, and the batches every rank received in it."""

    world_size: int
    num_workers: int
    batch_size: int
    shuffle_buffer: int
    shuffle_initial: int
    batches: int = 0

    def topology(self) -> tuple[int, int, int, int, int]:
        return (self.world_size, self.num_workers, self.batch_size, self.shuffle_buffer, self.shuffle_initial)

    def describe(self) -> str:
        return f"{self.world_size} ranks x {self.num_workers} workers x batch {self.batch_size}"


@dataclass(frozen=True)
class ResumeState:
    manifest: str
    samples: int
    seed: int
    shuffle: bool
    mode: str
    epoch: int
    segments: tuple[Segment, ...]

    @property
    def batches(self) -> int:
        """Batches received in the current segment (the one a checkpoint was taken in)."""
        return self.segments[-1].batches

    def advanced(self, batches: int) -> ResumeState:
        """The same state with the current segment at ``batches`` received."""
        return replace(self, segments=self.segments[:-1] + (replace(self.segments[-1], batches=batches),))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "manifest": self.manifest, "samples": self.samples,
            "seed": self.seed, "shuffle": self.shuffle, "mode": self.mode, "epoch": self.epoch,
            "segments": [
                {"world_size": s.world_size, "num_workers": s.num_workers, "batch_size": s.batch_size,
                 "shuffle_buffer": s.shuffle_buffer, "shuffle_initial": s.shuffle_initial, "batches": s.batches}
                for s in self.segments
            ],
        }

    @classmethod
    def from_json(cls, doc: Any) -> ResumeState:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise StateError(f"not a shardstream resume state (no \"format\": \"{FORMAT}\"); "
                             "pass what loader.state_dict() or ShardStream.state_dict() returned")
        if doc.get("version") != VERSION:
            raise StateError(f"resume state version {doc.get('version')!r} is unknown to this shardstream "
                             f"(it reads version {VERSION}); resume with the shardstream version that saved it")
        try:
            segments = tuple(
                Segment(**{k: _int(s[k], k) for k in ("world_size", "num_workers", "batch_size",
                                                       "shuffle_buffer", "shuffle_initial", "batches")})
                for s in doc["segments"]
            )
            state = cls(manifest=str(doc["manifest"]), samples=_int(doc["samples"], "samples"),
                        seed=_int(doc["seed"], "seed"), shuffle=bool(doc["shuffle"]), mode=str(doc["mode"]),
                        epoch=_int(doc["epoch"], "epoch"), segments=segments)
        except (KeyError, TypeError) as exc:
            raise StateError(f"resume state is missing or mistypes a field ({exc}); it was not written by state_dict()") from exc
        if not segments or state.mode not in MODES or any(
            s.world_size < 1 or s.num_workers < 1 or s.batch_size < 1 or s.batches < 0 for s in segments
        ):
            raise StateError(f"resume state holds impossible values: mode {state.mode!r}, segments {doc['segments']}")
        return state

    def check(self, *, manifest: str, samples: int, seed: int, shuffle: bool, mode: str) -> None:
        """Refuse a state saved for another dataset or order, naming what differs."""
        if manifest != self.manifest or samples != self.samples:
            raise StateError(f"the resume state was saved for another dataset ({self.samples} samples, manifest digest "
                             f"{self.manifest}) than this one ({samples} samples, digest {manifest}); "
                             "resume with the manifest the checkpoint was trained on")
        for name, mine, theirs in (("seed", self.seed, seed), ("shuffle", self.shuffle, shuffle), ("mode", self.mode, mode)):
            if mine != theirs:
                raise StateError(f"the resume state was saved with {name}={mine!r} but this ShardStream has "
                                 f"{name}={theirs!r}; construct it with {name}={mine!r} to resume this epoch")


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


# -- which worker consumed what ------------------------------------------------------------------
def consumed_batches(received: int, worker_batches: Sequence[int]) -> list[int]:
    """Per worker, batches among the first ``received`` of a rank (round-robin delivery)."""
    k = len(worker_batches)
    return [min(wb, max(0, -(-(received - i) // k))) for i, wb in enumerate(worker_batches)]


@dataclass
class WorkerCut:
    """Where a worker's shuffle stood after its consumed outputs."""

    taken: int  # stream positions [0, taken) went into the shuffle
    buffered: list[int]  # positions sitting in the buffer, in buffer order
    grow: bool
    rng: random.Random | None
    drained: bool  # the input had ended: ``buffered`` is the final output order, no randomness left

    def unconsumed(self, length: int) -> np.ndarray:
        return np.concatenate([np.asarray(self.buffered, dtype=np.int64), np.arange(self.taken, length, dtype=np.int64)])


def cut_stream(length: int, outputs: int, *, buffer_size: int, initial: int, rng: random.Random) -> WorkerCut:
    """Simulate the shuffle over ``length`` stream positions until ``outputs`` have come out."""
    if buffer_size <= 1:
        return WorkerCut(outputs, [], False, None, False)
    if outputs == 0:
        return WorkerCut(0, [], False, rng, False)
    shuffler: BufferShuffler[int] = BufferShuffler(buffer_size, initial, rng)
    out: list[int] = []
    taken = shuffler.push(range(length), out, outputs)
    if len(out) == outputs:
        return WorkerCut(taken, shuffler.buffer, shuffler.grow, rng, False)
    rest = shuffler.drain()
    return WorkerCut(length, rest[outputs - len(out):], False, None, True)


# -- sample ids <-> shard ranges -------------------------------------------------------------------
class SampleIds:
    """Global sample ids: sample i of shard s is ``base[s] + i``."""

    def __init__(self, counts: Sequence[int]):
        self.base = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)

    def of_ranges(self, ranges: Sequence[Range]) -> np.ndarray:
        if not ranges:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(self.base[r.shard] + r.start, self.base[r.shard] + r.stop, dtype=np.int64)
                               for r in ranges])

    def ranges(self, ids: np.ndarray) -> list[Range]:
        """Ids (in read order) as shard ranges; consecutive ids of one shard become one range."""
        if len(ids) == 0:
            return []
        shards = np.searchsorted(self.base, ids, side="right") - 1
        breaks = np.flatnonzero((np.diff(ids) != 1) | (np.diff(shards) != 0)) + 1
        starts = np.concatenate([[0], breaks])
        stops = np.concatenate([breaks, [len(ids)]])
        return [Range(int(shards[a]), int(ids[a] - self.base[shards[a]]), int(ids[b - 1] - self.base[shards[a]] + 1))
                for a, b in zip(starts, stops)]


# -- segment layouts -------------------------------------------------------------------------------
@dataclass
class Layout:
    """Which sample ids each (rank, worker) reads in one segment."""

    index: int
    segment: Segment  # topology (its ``batches`` is what was received, when known)
    batches_per_rank: int
    laid_out: int  # samples the segment lays out (its U, or the epoch's total)
    dropped: int
    repeated: int
    stream_of: Callable[[int, int], np.ndarray]

    def worker_batches(self, worker: int) -> int:
        base, extra = divmod(self.batches_per_rank, self.segment.num_workers)
        return base + (1 if worker < extra else 0)

    def rng(self, seed: int, epoch: int, rank: int, worker: int) -> random.Random:
        return worker_rng(seed, epoch, rank, worker, self.index)

    def cut(self, seed: int, epoch: int, rank: int, worker: int, received: int) -> tuple[np.ndarray, WorkerCut]:
        seg = self.segment
        mine = consumed_batches(received, [self.worker_batches(w) for w in range(seg.num_workers)])[worker]
        stream = self.stream_of(rank, worker)
        return stream, cut_stream(len(stream), mine * seg.batch_size, buffer_size=seg.shuffle_buffer,
                                  initial=seg.shuffle_initial, rng=self.rng(seed, epoch, rank, worker))

    def unconsumed(self, seed: int, epoch: int, received: int) -> np.ndarray:
        """What every (rank, worker) left after ``received`` batches per rank, as one sequence."""
        parts = []
        for rank in range(self.segment.world_size):
            for worker in range(self.segment.num_workers):
                stream, cut = self.cut(seed, epoch, rank, worker, received)
                buffered = np.sort(stream[np.asarray(cut.buffered, dtype=np.int64)])
                parts += [buffered, stream[cut.taken:]]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def first_layout(counts: Sequence[int], ids: SampleIds, seg: Segment, *, seed: int, epoch: int, shuffle: bool, mode: str) -> Layout:
    plan = plan_epoch(counts, world_size=seg.world_size, num_workers=seg.num_workers, batch_size=seg.batch_size,
                      seed=seed, epoch=epoch, shuffle=shuffle, mode=mode)
    return Layout(0, seg, plan.batches_per_rank, plan.total_samples, plan.dropped, plan.repeated,
                  lambda rank, worker: ids.of_ranges(plan.ranges(rank, worker, counts)))


def next_layout(index: int, rest: np.ndarray, seg: Segment, mode: str) -> Layout:
    """Lay ``rest`` out over a new topology (plan_epoch steps 3-5 over a sequence of ids)."""
    n = len(rest)
    per_step = seg.world_size * seg.batch_size
    batches = n // per_step if mode == "drop" else -(-n // per_step)
    per_rank = batches * seg.batch_size

    def stream_of(rank: int, worker: int) -> np.ndarray:
        base, extra = divmod(batches, seg.num_workers)
        before = worker * base + min(worker, extra)
        begin = rank * per_rank + before * seg.batch_size
        size = (base + (1 if worker < extra else 0)) * seg.batch_size
        return rest[np.arange(begin, begin + size) % n] if size else np.zeros(0, dtype=np.int64)

    return Layout(index, seg, batches, n, max(0, n - seg.world_size * per_rank), max(0, seg.world_size * per_rank - n),
                  stream_of)


# -- the resumed pass --------------------------------------------------------------------------------
@dataclass
class WorkerResume:
    """What one DataLoader worker of one rank does in the resumed pass."""

    plan_worker: int  # the segment's worker this DataLoader worker continues
    stream: np.ndarray  # sample ids of that worker's stream
    cut: WorkerCut
    num_batches: int  # batches still to yield
    buffer_size: int
    initial: int

    def reads(self, ids: SampleIds) -> tuple[list[Range], list[Range]]:
        """(buffered samples to read back, sorted by id; the unread suffix)."""
        buffered = self.stream[np.asarray(self.cut.buffered, dtype=np.int64)]
        return ids.ranges(np.sort(buffered)), ids.ranges(self.stream[self.cut.taken:])

    def samples(self, ids: SampleIds, read: Callable[[list[Range]], Iterable[list[T]]]) -> Iterator[list[T]]:
        """This worker's shuffled samples for the rest of the segment; ``read`` turns ranges into
        lists of samples (in range order)."""
        back, suffix = self.reads(ids)
        buffer: list[T] = []
        if self.cut.buffered:
            got = [s for chunk in read(back) for s in chunk]
            order = np.argsort(self.stream[np.asarray(self.cut.buffered, dtype=np.int64)], kind="stable")
            if len(got) == len(order):  # fewer only when reads were skipped under on_error="skip"
                placed: list[Any] = [None] * len(order)
                for i, j in enumerate(order):
                    placed[j] = got[i]
                buffer = placed
            else:
                buffer = got
        if self.cut.drained:
            if buffer:
                yield buffer
            return
        rest = read(suffix) if suffix else iter(())
        if self.buffer_size <= 1:
            yield from rest
            return
        assert self.cut.rng is not None  # a cut that is neither drained nor unshuffled keeps its RNG
        yield from shuffle_samples(rest, buffer_size=self.buffer_size, initial=self.initial, rng=self.cut.rng,
                                   buffer=buffer, grow=self.cut.grow)


class ResumePlan:
    """The rest of a saved epoch under a (possibly different) topology."""

    def __init__(self, counts: Sequence[int], state: ResumeState, now: Segment):
        self.counts = list(counts)
        self.state = state
        self.ids = SampleIds(counts)
        now = replace(now, num_workers=max(1, now.num_workers), batches=0)
        segs = state.segments
        layouts = [first_layout(counts, self.ids, segs[0], seed=state.seed, epoch=state.epoch,
                                shuffle=state.shuffle, mode=state.mode)]
        for i, seg in enumerate(segs[1:], start=1):
            prev = layouts[-1]
            self._check_received(prev, segs[i - 1].batches)
            rest = prev.unconsumed(state.seed, state.epoch, segs[i - 1].batches)
            layouts.append(next_layout(i, rest, seg, state.mode))
        last = layouts[-1]
        self._check_received(last, segs[-1].batches)
        self.exact = segs[-1].topology() == now.topology()
        if self.exact:
            self.layout = last
            self.start = segs[-1].batches
            self.history = segs[:-1]
        else:
            rest = last.unconsumed(state.seed, state.epoch, segs[-1].batches)
            self.layout = next_layout(len(layouts), rest, now, state.mode)
            self.start = 0
            self.history = segs
        self.segment = replace(self.layout.segment, batches=self.start)

    @staticmethod
    def _check_received(layout: Layout, received: int) -> None:
        if received > layout.batches_per_rank:
            raise StateError(f"the resume state says {received} batches were received in segment {layout.index}, "
                             f"which has only {layout.batches_per_rank} per rank; the state does not fit this dataset")

    @property
    def batches_per_rank(self) -> int:
        """Batches every rank yields in the resumed pass."""
        return self.layout.batches_per_rank - self.start

    @property
    def dropped(self) -> int:
        return 0 if self.exact else self.layout.dropped

    @property
    def repeated(self) -> int:
        return 0 if self.exact else self.layout.repeated

    def state_after(self, received: int) -> ResumeState:
        """The state once the loop has received ``received`` batches of the resumed pass."""
        return replace(self.state, segments=self.history + (replace(self.segment, batches=self.start + received),))

    def worker(self, rank: int, worker: int) -> WorkerResume:
        seg = self.layout.segment
        if not 0 <= rank < seg.world_size or not 0 <= worker < seg.num_workers:
            raise ValueError(f"(rank {rank}, worker {worker}) outside {seg.world_size} ranks x {seg.num_workers} workers")
        plan_worker = (worker + self.start) % seg.num_workers
        stream, cut = self.layout.cut(self.state.seed, self.state.epoch, rank, plan_worker, self.start)
        left = self.layout.worker_batches(plan_worker) - consumed_batches(
            self.start, [self.layout.worker_batches(w) for w in range(seg.num_workers)])[plan_worker]
        return WorkerResume(plan_worker, stream, cut, left, seg.shuffle_buffer, seg.shuffle_initial)

    def summary(self) -> str:
        seg = self.layout.segment
        head = f"resuming epoch {self.state.epoch}"
        if self.exact:
            return (f"{head} exactly after {self.start} of {self.layout.batches_per_rank} batches per rank "
                    f"({seg.describe()}): {self.batches_per_rank} batches per rank to go")
        before = self.history[-1]
        extra = f"{self.layout.dropped} dropped" if self.state.mode == "drop" else f"{self.layout.repeated} repeated"
        return (f"{head} elastically: {self.layout.laid_out} samples not yet consumed after {before.batches} batches "
                f"per rank on {before.describe()} -> {seg.describe()}: {self.batches_per_rank} batches per rank ({extra})")


def merge_round_robin(per_worker: Sequence[Sequence[T]]) -> list[T]:
    """The order DataLoader delivers worker batches in: one from each worker in turn, skipping
    exhausted ones (used by tests and tools to model a rank in one process)."""
    out: list[T] = []
    longest = max((len(b) for b in per_worker), default=0)
    for k in range(longest):
        for batches in per_worker:
            if k < len(batches):
                out.append(batches[k])
    return out
