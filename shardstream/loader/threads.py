"""Thread workers: a loader's workers as threads of the loop's own process.

For work that releases the GIL (reading, decompression, PIL/numpy/torch decoding) a thread does what
a worker process does without its costs: nothing pickled, no shared memory, no start method, no
process start, and a batch reaches the loop as the very tensors the worker made. Pure-Python work per
sample holds the GIL, and there processes do better (on a free-threaded Python threads run in
parallel for both). Worker ``w`` iterates its own view of the dataset (``ShardStream.thread_view``:
the same plan, clock and counters; its own place in the pass and its own seeded transforms), so plan,
state and resume are those of processes. Each pass starts its threads afresh; a pass left early tells
them to stop and waits for them.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from shardstream.loader.handoff import pin as pin_batch
from shardstream.loader.workers import Workers
from shardstream.plan.topology import WorkerInfo, set_worker

_JOIN_S = 10.0  # how long a pass left early waits for its threads to stop
_POLL_S = 0.05  # how often a thread blocked on a full queue looks whether it should stop


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` once the queue has room; False where the pass was left first."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False


def _work(
    view: Any,
    info: WorkerInfo,
    out: queue.Queue,
    stop: threading.Event,
    collate: Callable[[Any], Any] | None,
    init_fn: Callable[[int], Any] | None,
    pin: bool,
) -> None:
    set_worker(info, thread=True)
    batches = None
    try:
        view.counters.counters(info.id).step("started (thread), running worker_init_fn")
        if init_fn is not None:
            init_fn(info.id)
        batches = iter(view)
        for batch in batches:
            if stop.is_set():
                return
            origin = view.origin()
            if collate is not None:
                batch = collate(batch)
            if pin:
                batch = pin_batch(batch)
            if not _put(out, ("batch", origin, batch), stop):
                return
            del batch
        _put(out, ("end",), stop)
    except BaseException as exc:  # noqa: BLE001 - raised in the loop
        _put(out, ("error", exc), stop)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        set_worker(None, thread=True)


class ThreadWorkers(Workers):
    """A loader's thread workers: each pass runs one thread per worker."""

    kind, group = "thread worker", "thread workers"

    def __init__(self, dataset: Any, num_workers: int, **kw: Any):
        super().__init__(dataset, num_workers, **kw)
        self.base_seed = random.getrandbits(62)

    def _begin(self, number: int) -> tuple[threading.Event, list[queue.Queue], list[threading.Thread]]:
        k, stop = self.num_workers, threading.Event()
        queues: list[queue.Queue] = [queue.Queue(self.prefetch) for _ in range(k)]
        self.dataset.counters.clear_board()
        threads = []
        for w in range(k):
            view = self.dataset.thread_view()
            args = (view, WorkerInfo(w, k, self.base_seed + w, view), queues[w], stop, self.collate_fn, self.init_fn, self.pin)
            threads.append(threading.Thread(target=_work, args=args, name=f"shardstream-worker-{w}", daemon=True))
        for thread in threads:
            thread.start()
        return stop, queues, threads

    def _next(self, run: Any, w: int, bound: float | None) -> tuple[Any, Any] | None:
        q, thread = run[1][w], run[2][w]
        started = time.monotonic()
        while True:
            try:
                item = q.get(timeout=_POLL_S if bound is None else min(_POLL_S * 20, max(0.001, bound - (time.monotonic() - started))))
            except queue.Empty:
                if not thread.is_alive() and q.empty():
                    raise RuntimeError(f"thread worker {w} ended without a word") from None  # (it always says end or error)
                if bound is not None and time.monotonic() - started >= bound:
                    raise self.late(w, bound) from None
                continue
            if item[0] == "error":
                item[1].add_note(f"(raised in rank {self.rank}'s thread worker {w})")
                raise item[1]
            return None if item[0] == "end" else (item[1], item[2])

    def _end(self, run: Any, done: bool, active: list[int]) -> None:
        run[0].set()
        deadline = time.monotonic() + _JOIN_S
        for thread in run[2]:  # (one stuck in a read cannot be stopped: it is left, a daemon)
            thread.join(max(0.0, deadline - time.monotonic()))
