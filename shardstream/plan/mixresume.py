"""Resume a mixed epoch exactly: from a small state naming the sources, which samples every
(rank, worker) of the same topology still delivers, and in what order. Pure: no I/O.

A mixed worker's output is its slice of the mixed sequence (plan/mix.py): each source's stream
passes through its own buffered shuffle, then the plan's pattern takes from the sources in turn.
After n batches per rank, worker w has consumed c batches (round-robin delivery,
``consumed_batches``), so c * B positions of its slice, and the pattern says how many of those
came from each source. Simulating each source's shuffle over stream positions (``cut_stream``)
gives its buffer, its read position and its RNG state at that point; the resumed worker reads
back the buffered samples and the unread suffix of every source, restores each shuffle, and
continues the pattern where it stopped. DataLoader worker d plays the plan's worker (d + n) % K,
so the round-robin resumes at batch n in the same order (as plan/resume.py does for one dataset).

Only the same topology resumes (world size, workers, batch size, shuffle buffer): a mix refuses
an elastic resume with a StateError saying so.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from shardstream.errors import StateError
from shardstream.plan.epoch import Range
from shardstream.plan.mix import MixPlan
from shardstream.plan.resume import SampleIds, WorkerResume, consumed_batches, cut_stream

FORMAT = "shardstream-mix-resume"
VERSION = 1
TOPOLOGY = ("world_size", "num_workers", "batch_size", "shuffle_buffer", "shuffle_initial")

T = TypeVar("T")


def source_rng(seed: int, epoch: int, rank: int, worker: int, source: int) -> random.Random:
    """The shuffle RNG of one source's stream in one worker (string seeds hash through SHA-512)."""
    return random.Random(f"shardstream:{seed}:{epoch}:{rank}:{worker}:source{source}")


@dataclass(frozen=True)
class MixResumeState:
    sources: tuple[dict[str, Any], ...]  # per source: name, manifest digest, samples, ask
    seed: int
    shuffle: bool
    per_batch: str
    epoch: int
    topology: tuple[int, int, int, int, int]  # TOPOLOGY
    batches: int  # received by every rank in this epoch

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "sources": [dict(s) for s in self.sources], "seed": self.seed,
                "shuffle": self.shuffle, "per_batch": self.per_batch, "epoch": self.epoch,
                **dict(zip(TOPOLOGY, self.topology)), "batches": self.batches}

    @classmethod
    def from_json(cls, doc: Any) -> MixResumeState:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise StateError(f"not a resume state of a mix (no \"format\": \"{FORMAT}\"); pass what "
                             "loader.state_dict() or ShardStream.state_dict() returned for this mix")
        if doc.get("version") != VERSION:
            raise StateError(f"mix resume state version {doc.get('version')!r} is unknown to this shardstream "
                             f"(it reads version {VERSION})")
        try:
            ints = {k: doc[k] for k in (*TOPOLOGY, "batches", "epoch", "seed")}
            if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in ints.values()):
                raise TypeError(f"integers expected, got {ints}")
            sources = tuple(dict(s) for s in doc["sources"])
            return cls(sources=sources, seed=doc["seed"], shuffle=bool(doc["shuffle"]), per_batch=str(doc["per_batch"]),
                       epoch=doc["epoch"], topology=(doc["world_size"], doc["num_workers"], doc["batch_size"], doc["shuffle_buffer"],
                                 doc["shuffle_initial"]),
                       batches=doc["batches"])
        except (KeyError, TypeError) as exc:
            raise StateError(f"mix resume state is missing or mistypes a field ({exc}); it was not written by "
                             "state_dict()") from exc

    def check(self, *, sources: Sequence[dict[str, Any]], seed: int, shuffle: bool, per_batch: str,
              topology: tuple[int, int, int, int, int]) -> None:
        """Refuse a state of other sources, order or topology, naming what differs."""
        if [dict(s) for s in sources] != [dict(s) for s in self.sources]:
            raise StateError(f"the resume state was saved for another mix ({list(self.sources)}) than this one "
                             f"({list(sources)}); resume with the sources, manifests and asks it was trained on")
        for name, mine, theirs in (("seed", self.seed, seed), ("shuffle", self.shuffle, shuffle),
                                   ("per_batch", self.per_batch, per_batch)):
            if mine != theirs:
                raise StateError(f"the resume state was saved with {name}={mine!r} but this ShardStream has "
                                 f"{name}={theirs!r}; construct it with {name}={mine!r} to resume this epoch")
        if topology != self.topology:
            saved = dict(zip(TOPOLOGY, self.topology))
            now = dict(zip(TOPOLOGY, topology))
            raise StateError(f"a mix resumes only on the topology it was saved on ({saved}), this one is {now}; "
                             "elastic resume covers single datasets, or restart the epoch")


@dataclass
class MixWorkerResume:
    """What one DataLoader worker does in a resumed mixed pass."""

    num_batches: int
    sources: list[WorkerResume]  # one per source: its stream's cut
    ids: list[SampleIds]
    pattern: Iterator[int]  # the sources of the positions still to deliver

    def samples(self, read: Callable[[int, list[Range]], Iterable[list[T]]]) -> list[Iterator[list[T]]]:
        """Per source, its shuffled samples for the rest of the slice; ``read(source, ranges)``."""
        def reader(i: int) -> Callable[[list[Range]], Iterable[list[T]]]:
            return lambda ranges: read(i, ranges)

        return [w.samples(self.ids[i], reader(i)) for i, w in enumerate(self.sources)]


class MixResumePlan:
    """The rest of a saved mixed epoch on the same topology."""

    def __init__(self, plan: MixPlan, state: MixResumeState):
        if state.batches > plan.batches_per_rank:
            raise StateError(f"the resume state says {state.batches} batches were received, but this mix has only "
                             f"{plan.batches_per_rank} per rank; the state does not fit this mix")
        self.plan = plan
        self.state = state
        self.start = state.batches
        self.buffer_size, self.initial = state.topology[3], state.topology[4]
        self.ids = [SampleIds(c) for c in plan.counts]

    @property
    def batches_per_rank(self) -> int:
        return self.plan.batches_per_rank - self.start

    def state_after(self, received: int) -> MixResumeState:
        return replace(self.state, batches=self.start + received)

    def worker(self, rank: int, worker: int) -> MixWorkerResume:
        plan = self.plan
        k = plan.num_workers
        plan_worker = (worker + self.start) % k
        consumed = consumed_batches(self.start, [plan.worker_batches(w) for w in range(k)])[plan_worker]
        begin, end = plan.worker_slice(rank, plan_worker)
        cut_at = begin + consumed * plan.batch_size
        first, at, last = plan.used_before(begin), plan.used_before(cut_at), plan.used_before(end)
        resumes = []
        for i in range(len(plan.counts)):
            stream = self.ids[i].of_ranges(plan.source_ranges(i, first[i], last[i]))
            rng = source_rng(plan.seed, plan.epoch, rank, plan_worker, i)
            cut = cut_stream(len(stream), at[i] - first[i], buffer_size=self.buffer_size, initial=self.initial, rng=rng)
            resumes.append(WorkerResume(plan_worker, stream, cut, 0, self.buffer_size, self.initial))
        return MixWorkerResume(plan.worker_batches(plan_worker) - consumed, resumes, self.ids,
                               plan.pattern(cut_at, end))

    def summary(self) -> str:
        return (f"resuming mixed epoch {self.state.epoch} exactly after {self.start} of {self.plan.batches_per_rank} "
                f"batches per rank: {self.batches_per_rank} batches per rank to go")
