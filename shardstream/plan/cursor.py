"""Where a consumer stands in a pass: the one owner of a run's position. Pure: no I/O.

A ``Cursor`` holds a pass's plan (plan/run.py's ``PassPlan``) and the batches one consumer has
taken from it; every resume state the loader or the dataset gives is a cursor's ``state()``.

- A producer (the dataset iterated in a DataLoader worker, or in the loop's own process) takes
  its share's batches one by one (``take``): each gets an ``Origin``, where it came from (the
  worker, the pass: its loader epoch and its plan's identity, and which of that worker's
  batches it is). DataLoader worker w of K yields every K-th batch of the pass, the first at ``slot``.
- The loop (make_loader's loader, in the main process) receives batches with their origins
  (``see``): batch n of worker w is batch w + n*K of the pass, and the position is how many of
  the pass's batches arrived without a gap, whatever order they arrived in. A batch of another
  pass or plan, or one received twice, is refused (``StateError``), never counted.

``plan_id`` is a pass plan's identity: the main process computes the plan of each pass once,
tells its workers the identity (clock.py), and every worker checks that the plan it reads by is
that one. ``Place`` is one process's own position in a dataset's run (its cursor, and how the
process came to iterate), which a copy sent to a worker does not take along.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, NamedTuple

from shardstream.errors import StateError

if TYPE_CHECKING:
    from shardstream.plan.run import PassPlan


class Origin(NamedTuple):
    """Where a batch came from: DataLoader worker ``worker`` (0 in the loop's own process) made
    it as batch ``nth`` (from 0) of its share of the pass over loader epoch ``epoch`` planned as
    ``plan`` (``plan_id``)."""

    worker: int
    epoch: int
    plan: int
    nth: int


def plan_id(plan: PassPlan) -> int:
    """A pass plan's identity, the same in every process: 63 bits (never 0) of a digest of what
    decides its reads: the run's settings and sources, the pass, its topology, its windows over
    the timeline and the state it continues."""
    run = plan.run
    what = {
        "settings": repr(run.settings),
        "sources": run.sources.identity,
        "pass": [plan.loader_epoch, plan.pass_start, plan.pass_end, plan.received],
        "topology": plan.topology.to_json(),
        "windows": [[type(w.layout).__name__, w.layout.epoch, w.layout.batches_per_rank, w.lo, w.hi, w.at, len(w.history)] for w in plan.windows],
        "loaded": plan.loaded.to_json() if plan.loaded is not None else None,
    }
    digest = hashlib.blake2b(json.dumps(what, sort_keys=True, default=repr).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) | 1


class Cursor:
    """Where one consumer of a pass stands: the pass's plan and the batches it has taken from it
    (see the module docstring). The loop's cursor has ``slot=0, stride=1``; DataLoader worker w
    of K has ``worker=w``, ``stride=K`` and the slot of the pass's batches it yields: w where DataLoader deals
    the pass out from worker 0, or where the pass resumes mid-round (StatefulDataLoader goes on
    dealing from the worker after the last one it received from) the slot that makes w deliver
    its own next batches. ``received``: batches of this pass (after the plan's own ``received``)
    the loop had received at this cursor's last one; of K workers' states the furthest is the
    loop's."""

    __slots__ = ("_ahead", "_id", "_next", "last", "lost", "plan", "slot", "stride", "taken", "worker")

    def __init__(self, plan: PassPlan, slot: int = 0, stride: int = 1, worker: int = 0):
        self.plan, self.slot, self.stride, self.worker, self.taken = plan, slot, stride, worker, 0
        self.last: Origin | None = None  # the origin of the batch a producer handed over last
        self._id: int | None = None
        self._next = 0  # batches of the pass up to and with this cursor's last one (the loop: without a gap)
        self._ahead: set[int] = set()  # the loop: batches received past a gap (out of order)
        self.lost: str | None = None  # why the loop's position is not known (a stage changed the batches)

    @property
    def id(self) -> int:
        """``plan_id`` of this cursor's plan (computed once)."""
        if self._id is None:
            self._id = plan_id(self.plan)
        return self._id

    @property
    def received(self) -> int:
        """Batches of this pass (after the plan's own ``received``) the loop had received with this consumer's last."""
        return self._next

    def take(self) -> Origin:
        """A producer (DataLoader worker ``worker``, 0 in the loop's process) hands over its next batch: its origin."""
        nth = self.taken
        self.taken += 1
        self._next = self.slot + nth * self.stride + 1
        self.last = Origin(self.worker, self.plan.loader_epoch, self.id, nth)
        return self.last

    def see(self, origin: Origin) -> None:
        """The loop receives a batch of ``origin``: batch ``worker + nth * K`` of this pass."""
        if origin.plan != self.id:
            raise StateError(
                f"the loop received a batch of worker {origin.worker} for loader epoch {origin.epoch} (plan {origin.plan:016x}) "
                f"during loader epoch {self.plan.loader_epoch} (plan {self.id:016x}): that worker read another pass than the "
                "main process planned (its copy of the dataset differs); the batch is refused rather than counted"
            )
        k = self.plan.topology.num_workers
        at = origin.worker + origin.nth * k
        if not 0 <= origin.worker < k or at < self._next or at in self._ahead or at >= self.plan.batches_per_rank:
            raise StateError(
                f"batch {origin.nth} of worker {origin.worker} (batch {at} of loader epoch {origin.epoch}) was received "
                f"twice, or lies past the pass's {self.plan.batches_per_rank} batches"
            )
        self.taken += 1
        if at != self._next:
            self._ahead.add(at)
            return
        self._next += 1
        while self._next in self._ahead:
            self._ahead.discard(self._next)
            self._next += 1

    def state(self, batches: int | None = None) -> dict[str, Any]:
        """The resume state at this cursor (``batches``: the loop's own count of this pass instead)."""
        if self.lost is not None and batches is None:
            raise StateError(f"the loop's position in loader epoch {self.plan.loader_epoch} is not known: {self.lost}")
        return self.plan.state_after(self.received if batches is None else batches)


class Place:
    """One process's own place in a dataset's run: ``cursor``, the pass this process iterates
    (None: none started here since its last ``iter()``, ``set_epoch`` or load); ``iterated``,
    ``iter()`` was called in this process; ``own_state``, the state loaded is a DataLoader
    worker's own (StatefulDataLoader's snapshot of that worker: it goes on with its own batches);
    ``share_over``, and that worker's share of its pass was over. A copy of the dataset (pickled
    to a worker) keeps the loaded state's kind but not this process's iteration. ``loader_workers``:
    the workers of the loader ``make_loader`` built over the dataset (what its plan assumes)."""

    __slots__ = ("cursor", "iterated", "loader_workers", "own_state", "share_over")

    def __init__(self) -> None:
        self.cursor: Cursor | None = None
        self.iterated = False
        self.own_state = False
        self.share_over = False
        self.loader_workers: int | None = None

    def begin(self) -> bool:
        """``iter()`` in this process: no pass yet, and whether this worker's share of the loaded
        pass was over (told once)."""
        self.cursor, self.iterated = None, True
        over, self.share_over = self.share_over, False
        return over

    def __getstate__(self) -> dict[str, Any]:
        return {"own_state": self.own_state, "share_over": self.share_over, "loader_workers": self.loader_workers}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.own_state, self.share_over, self.loader_workers = d["own_state"], d["share_over"], d["loader_workers"]
