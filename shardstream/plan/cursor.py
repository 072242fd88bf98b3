"""Where a consumer stands in a pass: the one owner of a run's position. Pure: no I/O.

A ``Cursor`` holds a pass's plan (plan/run.py's ``PassPlan``) and the batches one consumer took
from it: the training loop, or one DataLoader worker. Every resume state the loader or the
dataset gives is a cursor's ``state()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardstream.plan.run import PassPlan


class Cursor:
    """Where one consumer of a pass stands: the pass's plan and the batches it has taken from it;
    every resume state is a cursor's ``state()``. The training loop takes every batch
    (``stride=1``); DataLoader worker w of K takes every K-th (``stride=K``), the first at ``slot``:
    w where DataLoader deals the pass out from worker 0, or where the pass resumes mid-round
    (StatefulDataLoader goes on dealing from the worker after the last one it received from)
    the slot that makes w deliver its own next batches. Once the loop received a worker's last
    batch it had received ``received`` batches of the pass at least: a worker's own state is
    that position, and of the K workers' states the furthest is the loop's."""

    __slots__ = ("plan", "slot", "stride", "taken")

    def __init__(self, plan: PassPlan, slot: int = 0, stride: int = 1):
        self.plan, self.slot, self.stride, self.taken = plan, slot, stride, 0

    @property
    def received(self) -> int:
        """Batches of this pass (after the plan's own ``received``) the loop had received with this consumer's last."""
        return self.slot + (self.taken - 1) * self.stride + 1 if self.taken else 0

    def state(self, batches: int | None = None) -> dict[str, Any]:
        """The resume state at this cursor (``batches``: the loop's own count of this pass instead)."""
        return self.plan.state_after(self.received if batches is None else batches)
