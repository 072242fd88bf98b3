"""Thread workers: a loader's workers as threads of the loop's own process.

For work that releases the GIL (reading from storage, decompression, PIL/numpy/torch decoding) a
thread does what a worker process does without its costs: nothing is pickled, no memory is shared
or copied between processes, no start method, no process start (the first batch comes as soon as
the first reads do), and a batch reaches the loop as the very tensors the worker made. Pure-Python
work per sample (a transform in Python, tar headers of tiny samples) holds the GIL, and there
processes do better; on a free-threaded Python (3.13t, 3.14t) threads run in parallel for both.

Worker ``w`` of ``K`` iterates its own view of the dataset (``ShardStream.thread_view``: the same
plan, clock and counters; its own place in the pass and its own copies of seeded transforms), so
the plan, the state and resume are the same as with processes. ``get_worker_info()`` (shardstream's)
names the thread's worker; torch's says None, as it does in any thread of the loop's process.
Each pass starts its threads afresh (a thread starts in microseconds); a pass left early tells its
threads to stop and waits for them.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from shardstream.errors import WorkerTimeout
from shardstream.loader.handoff import pin as pin_batch
from shardstream.plan.topology import WorkerInfo, set_worker

_JOIN_S = 10.0  # how long a pass left early waits for its threads to stop
_POLL_S = 0.05  # how often a thread blocked on a full queue looks whether it should stop


class _Stopped(Exception):
    pass


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> None:
    while True:
        try:
            out.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            if stop.is_set():
                raise _Stopped from None


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
            _put(out, ("batch", origin, batch), stop)
            del batch
        _put(out, ("end",), stop)
    except _Stopped:
        pass
    except BaseException as exc:  # noqa: BLE001 - raised in the loop
        try:
            _put(out, ("error", exc), stop)
        except _Stopped:
            pass
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        set_worker(None, thread=True)


class ThreadWorkers:
    """A loader's thread workers: each pass (``run_pass``) runs one thread per worker."""

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
        self.dataset, self.num_workers = dataset, num_workers
        self.prefetch, self.collate_fn, self.init_fn, self.pin = max(1, prefetch), collate_fn, init_fn, pin
        self.timeout, self.first_timeout = timeout, first_timeout
        self.base_seed = random.getrandbits(62)

    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        pass

    def run_pass(self) -> Iterator[tuple[Any, Any]]:
        k = self.num_workers
        stop = threading.Event()
        queues: list[queue.Queue] = [queue.Queue(self.prefetch) for _ in range(k)]
        self.dataset.counters.clear_board()
        threads = []
        for w in range(k):
            view = self.dataset.thread_view()
            info = WorkerInfo(w, k, self.base_seed + w, view)
            args = (view, info, queues[w], stop, self.collate_fn, self.init_fn, self.pin)
            threads.append(threading.Thread(target=_work, args=args, name=f"shardstream-worker-{w}", daemon=True))
        for thread in threads:
            thread.start()
        active = list(range(k))
        turn, first = 0, True
        try:
            while active:
                w = active[turn % len(active)]
                item = self._get(w, queues[w], threads[w], self.first_timeout if first else self.timeout)
                if item[0] == "end":
                    active.remove(w)
                    continue
                if item[0] == "error":
                    exc = item[1]
                    exc.add_note(f"(raised in rank {self.dataset.world.rank}'s thread worker {w})")
                    raise exc
                turn += 1
                first = False
                yield item[1], item[2]
        finally:
            stop.set()
            deadline = time.monotonic() + _JOIN_S
            for thread in threads:  # (one stuck in a read cannot be stopped: it is left, a daemon)
                thread.join(max(0.0, deadline - time.monotonic()))

    def _get(self, w: int, q: queue.Queue, thread: threading.Thread, bound: float | None) -> Any:
        started = time.monotonic()
        while True:
            try:
                return q.get(timeout=_POLL_S if bound is None else min(_POLL_S * 20, max(0.001, bound - (time.monotonic() - started))))
            except queue.Empty:
                pass
            if not thread.is_alive() and q.empty():
                raise RuntimeError(f"thread worker {w} ended without a word")  # (it always says end or error)
            if bound is not None and time.monotonic() - started >= bound:
                line = self.dataset.counters.worker_line(w)
                step = f"made {line[2]} batches this pass; its last step, {line[1]:.0f} s ago: {line[3]}" if line else "has not started its pass"
                raise WorkerTimeout(
                    f"rank {self.dataset.world.rank}: no batch from the thread workers in {bound:g} s; thread worker {w} {step}. "
                    "Raise make_loader's timeout / first_batch_timeout if this is expected (slow storage, huge batches); "
                    "py-spy dump --pid PID shows where it is stuck"
                )
