"""What the two kinds of workers share: a pass's batches dealt from the workers in turn (worker
0's first, worker 1's first, ..., as torch's DataLoader does), every wait for one bounded.

A subclass says how a pass starts (``_begin``, which returns what the pass's other calls get: a
pass left early may end after the next one began), how the next batch of worker ``w`` arrives
within a bound (``_next``: ``(origin, batch)``, None at the worker's end) and how a pass ends
(``_end``: ``done`` is False where the loop left it early).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from shardstream.errors import WorkerTimeout


class Workers:
    kind, group = "worker", "DataLoader workers"  # how messages name one worker, and all

    def __init__(
        self,
        dataset: Any,
        num_workers: int,
        *,
        prefetch: int,
        collate_fn: Callable[[Any], Any] | None,
        init_fn: Callable[[int], Any] | None,
        pin: bool,
        timeout: float | None,
        first_timeout: float | None,
    ):
        self.dataset, self.num_workers, self.rank = dataset, num_workers, dataset.world.rank
        self.prefetch, self.collate_fn, self.init_fn, self.pin = max(1, prefetch), collate_fn, init_fn, pin
        self.timeout, self.first_timeout = timeout, first_timeout
        self.passes = 0

    def run_pass(self) -> Iterator[tuple[Any, Any]]:
        """(origin, batch) of every batch of the next pass, dealt from the workers in turn."""
        self.passes += 1
        run = self._begin(self.passes)
        active = list(range(self.num_workers))
        turn, first, done = 0, True, False
        try:
            while active:
                w = active[turn % len(active)]
                got = self._next(run, w, self.first_timeout if first else self.timeout)
                if got is None:
                    active.remove(w)
                    continue
                turn, first = turn + 1, False
                yield got
            done = True
        finally:
            self._end(run, done, active)

    def _begin(self, number: int) -> Any:
        raise NotImplementedError

    def _next(self, run: Any, w: int, bound: float | None) -> tuple[Any, Any] | None:
        raise NotImplementedError

    def _end(self, run: Any, done: bool, active: list[int]) -> None:
        raise NotImplementedError

    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        """End every worker now."""

    def late(self, w: int, bound: float, pid: int | None = None) -> WorkerTimeout:
        """The timeout of a wait for worker ``w``, with its last step on the rank's board (stats.py)."""
        name = f"{self.kind} {w}" + (f" (pid {pid})" if pid is not None else "")
        line = self.dataset.counters.worker_line(w)
        if line is None or (pid is not None and line[0] != pid):
            what = f"{name} has not started its pass: no line of the dataset ran in {bound:.0f} s"
            what += " (a start that hung: an import or worker_init_fn that blocks)"
        else:
            _, ago, made, step = line
            what = f"{name} made {made} batches this pass; its last step, {ago:.0f} s ago: {step}"
        return WorkerTimeout(
            f"rank {self.rank}: no batch from the {self.group} in {bound:g} s; {what}. Raise make_loader's timeout / "
            "first_batch_timeout if this is expected (slow storage, huge batches); py-spy dump --pid PID shows where a worker is stuck"
        )
