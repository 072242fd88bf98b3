"""make_loader: a ShardStream's loader, with its workers as threads or processes.

The dataset batches inside its workers; the loader deals a pass's batches from them in turn
(loader/workers.py), counts each by its origin (plan/cursor.py) and hands it to the loop. Workers
are threads (loader/threads.py: work that releases the GIL) or processes (loader/procs.py, started
as start.py says: work that holds it); ``num_workers=0`` iterates in the loop's own thread. Every
runtime runs the same plan and gives the same batches in the same order and the same state.

Position: the loader plans each pass once (``ShardStream.open_pass``: workers check their own plan
against it); the loop's ``Cursor`` counts the batches received without a gap, so batches in flight
at checkpoint time are delivered again after a resume. ``len(loader)`` is the whole pass per rank
(also after ``load_state_dict``), as torch's DataLoader, StatefulDataLoader and Lightning count;
``loader.remaining`` is what is left of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardstream.dataset import ShardStream
from shardstream.errors import ConfigError
from shardstream.loader.handoff import pin as pin_batch
from shardstream.loader.procs import ProcessWorkers
from shardstream.loader.start import check_main_guarded, check_picklable, context, main_without_file, resolve_start_method
from shardstream.loader.threads import ThreadWorkers
from shardstream.plan.cursor import Cursor
from shardstream.plan.run import PassPlan
from shardstream.ranks import WaitMeter, gather
from shardstream.storage.ranges import ready_for_fork as ready_storage_for_fork

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 600.0  # seconds a worker may take for any batch after its first
DEFAULT_FIRST_BATCH_TIMEOUT = 1800.0  # for the first batch of a pass: start, plan, first reads
WORKER_KINDS = ("threads", "processes")
_LOADER_KEYWORDS = ("collate_fn", "worker_init_fn", "multiprocessing_context", "in_order")


class ShardLoader:
    """The loader over ``dataset`` (``make_loader`` builds one, with the same arguments); checks
    that ``num_workers`` leaves every worker something to read. It has ``len`` (the whole pass), ``remaining``,
    ``set_epoch``, ``stats``, ``state_dict``/``load_state_dict`` (the data position, in batches this
    loop received) and ``map(fn)`` (applied to every batch in the loop's process).

    ``workers`` says what a worker is: ``"threads"`` (threads of this process, for reading,
    decompression and decoding, which release the GIL: no pickling, no shared memory, no start) or
    ``"processes"`` (for per-sample Python work that holds the GIL). Default: processes where a
    ``start_method`` or ``multiprocessing_context`` is given, else threads (docs/performance.md has
    the figures behind it). ``num_workers=0`` iterates the dataset in the loop's thread.

    ``pin_memory`` only takes effect where CUDA is present. ``prefetch_factor``: batches each
    worker makes ahead of the loop. ``collate_fn`` (runs in the worker on each batch) and
    ``worker_init_fn`` (called with the worker's id as it starts) are DataLoader's. Every
    ``log_interval`` seconds (None: never) the stream counters of this rank are logged at INFO
    level; ``loader.stats()`` reads them any time. The dataset is not changed.

    Worker processes start as ``start_method`` says: ``"auto"`` (the default) is ``"forkserver"``
    unless the environment variable ``SHARDSTREAM_START_METHOD`` names another; ``"fork"``,
    ``"forkserver"`` or ``"spawn"`` ask for one (so does DataLoader's ``multiprocessing_context``).
    Processes that are not forked receive the dataset pickled: what a worker can import goes by
    reference, and a function it cannot (one defined in a notebook cell, ``python -`` or ``python
    -c``, a lambda, a closure, webdataset's decoders) goes by value with cloudpickle
    (``shardstream.portable``); what cannot travel at all (an open file, a lock) is a ConfigError at
    the first pass. ``persistent_workers`` (default True) keeps worker processes between passes;
    ``set_epoch`` and ``load_state_dict`` still reach them.

    Every wait for a batch is bounded: ``first_batch_timeout`` seconds for the first batch of a
    pass, ``timeout`` for each later one (None: unbounded). Past it the loop raises
    ``WorkerTimeout`` naming the rank, the worker, its pid and its last step. A worker process that
    dies is ``WorkerDied``; a worker's own exception is raised as itself. Worker processes die with
    their rank process, whatever the start method.

    In a worker, ``shardstream.get_worker_info()`` says which it is (torch's ``get_worker_info``
    says None in these workers; it describes torch DataLoader's own).
    """

    def __init__(
        self,
        dataset: ShardStream,
        *,
        num_workers: int = 2,
        workers: str | None = None,
        pin_memory: bool = True,
        prefetch_factor: int | None = 2,
        persistent_workers: bool = True,
        log_interval: float | None = 60.0,
        start_method: str = "auto",
        timeout: float | None = DEFAULT_TIMEOUT,
        first_batch_timeout: float | None = DEFAULT_FIRST_BATCH_TIMEOUT,
        **kwargs: Any,
    ):
        dataset.check_workers(num_workers)  # raises ConfigError naming the numbers
        if workers is None:
            workers = "processes" if start_method != "auto" or kwargs.get("multiprocessing_context") is not None else "threads"
        if workers not in WORKER_KINDS:
            raise ConfigError(f"workers must be one of {', '.join(map(repr, WORKER_KINDS))}, got {workers!r}")
        if "resumed_len" in kwargs:
            raise ConfigError(
                "make_loader has no resumed_len any more: len(loader) is always the whole pass (torch's, StatefulDataLoader's "
                "and Lightning's convention), and loader.remaining is what is left of a resumed one"
            )
        if kwargs.get("in_order", True) is not True:
            raise ConfigError(
                "make_loader keeps DataLoader's in_order=True: resume counts the batches the loop received, from each "
                "batch's origin, as the batches of the pass received without a gap (with in_order=False a fast worker's "
                "batches overtake a slow one's, and a resume would deliver those again)"
            )
        kwargs.pop("reuse_shared_memory", None)  # (segments are always reused now: loader/handoff.py)
        unknown = sorted(set(kwargs) - set(_LOADER_KEYWORDS))
        if unknown:
            raise ConfigError(
                f"make_loader does not take {', '.join(unknown)}: the dataset batches, shuffles and splits itself (give "
                "batch_size, shuffle and world to ShardStream); make_loader takes num_workers, workers, pin_memory, "
                f"prefetch_factor, persistent_workers, log_interval, start_method, timeout, first_batch_timeout and {', '.join(_LOADER_KEYWORDS)}"
            )
        ctx = kwargs.get("multiprocessing_context")
        if ctx is not None:
            if start_method != "auto":
                raise ConfigError("give start_method or multiprocessing_context, not both")
            if isinstance(ctx, str):
                start_method, why = resolve_start_method(ctx)
                ctx = context(start_method)
            else:
                start_method, why = ctx.get_start_method(), "given as multiprocessing_context"
            if workers != "processes":
                raise ConfigError("a multiprocessing_context starts worker processes: it does not go with workers='threads'")
        else:
            start_method, why = resolve_start_method(start_method)  # (refuses unknown names now)
            ctx = context(start_method, remote=bool(dataset.sources.remote_urls())) if workers == "processes" else None
        if num_workers > 0 and workers == "processes":
            logger.info("shardstream: worker processes start with %s (%s)", start_method, why)
        self.dataset = dataset
        self.num_workers, self.workers = num_workers, workers if num_workers > 0 else "none"
        self.pin_memory, self.prefetch_factor = pin_memory and torch.cuda.is_available(), prefetch_factor or 2
        self.persistent_workers = persistent_workers and num_workers > 0
        self.log_interval = log_interval
        self.start_method, self.start_why, self._context = start_method, why, ctx
        self.timeout = timeout if num_workers > 0 else None
        self.first_batch_timeout = first_batch_timeout if num_workers > 0 else None
        self.collate_fn, self.worker_init_fn = kwargs.get("collate_fn"), kwargs.get("worker_init_fn")
        # Batches a client counted in the resumed pass before its checkpoint, for len(): the state
        # counts only those since the pass's last elastic resume, so ShardDataModule saves its own
        # count and sets it here after load_state_dict (which leaves it); None: the state's count.
        self.counted_before: int | None = None
        self._stages: list[Callable[[Any], Any]] = []
        self.rank_meter = WaitMeter(interval_s=log_interval)  # the data wait of each batch, for rank_report()
        self._rank_report: dict[str, Any] | None = None
        self.sampler: Any = None  # (a client's epoch hook: ShardDataModule sets one Lightning calls)
        self._runtime: ProcessWorkers | ThreadWorkers | None = None
        self._checked = False  # the dataset was found picklable for the worker processes
        self._cursor: Cursor | None = None  # the last pass's plan, and the batches the loop received in it
        self._in_pass = False  # a pass of this loader is being iterated (its generator is open)
        dataset.loader_workers = num_workers  # what dataset.plan() and its summary assume

    def map(self, fn: Callable[[Any], Any]) -> ShardLoader:
        """Apply ``fn`` to every batch in the loop's process, after the hand-off; returns the loader."""
        self._stages.append(fn)
        return self

    def __len__(self) -> int:
        """Batches per rank of the pass in progress, else of the next, from the pass's start: a
        resumed pass counts the batches received before its checkpoint too, so a loop that restores
        its own step count and stops at ``len(loader)`` (Lightning's) gets the rest exactly (on
        another topology: those before plus what the elastic pass yields)."""
        plan = self._length_plan()
        if plan is None or plan.loaded is None:
            return len(self.dataset)
        before = plan.loaded.last.batches if self.counted_before is None else self.counted_before
        return before + plan.batches_per_rank

    @property
    def remaining(self) -> int:
        """Batches per rank still to come in the pass in progress (or left mid-way), else in the
        next one (after ``load_state_dict``: the rest of the resumed pass)."""
        current = self._unfinished()
        if current is not None:
            return current.plan.batches_per_rank - current.taken
        plan = self._length_plan()
        return plan.batches_per_rank if plan is not None else len(self.dataset)

    def _unfinished(self) -> Cursor | None:
        current = self._current()
        return current if current is not None and (self._in_pass or current.taken < current.plan.batches_per_rank) else None

    def _length_plan(self) -> PassPlan | None:
        """The plan of the pass in progress (or left mid-way), or of the next one where it resumes a loaded state."""
        current = self._unfinished()
        if current is not None:
            return current.plan
        return self.dataset.pass_plan(self.num_workers) if self.dataset._clock.upcoming_resumed else None

    def _current(self) -> Cursor | None:
        """The loop's cursor in the pass in progress (or just over), None before one starts."""
        cursor = self._cursor
        if cursor is not None and cursor.plan.loader_epoch == self.dataset.epoch and self.dataset._clock.started:
            return cursor
        return None

    def __iter__(self) -> Iterator[Any]:
        interval = self.log_interval
        next_log = time.monotonic() + interval if interval else None
        cursor = self._cursor = self.dataset.open_pass(self.num_workers)
        if cursor.plan.loaded is not None:
            logger.info("%s", cursor.plan.summary())
        self._in_pass = True
        stages = self._stages
        meter = self.rank_meter
        meter.begin()
        try:
            for origin, batch in self._batches():
                meter.arrived()
                if meter.due():  # (a collective at the same batch on every rank, before the yield: none waits for a rank that stopped)
                    self._rank_report = gather(meter, self.dataset.stats(), self.dataset.world, self.num_workers, log=bool(interval))
                if origin is not None:
                    cursor.see(origin)
                for stage in stages:
                    batch = stage(batch)
                yield batch
                meter.ask()
                if next_log is not None and time.monotonic() >= next_log:
                    next_log = time.monotonic() + (interval or 0)
                    logger.info("shardstream: %s", " ".join(f"{k}={v}" for k, v in self.dataset.stats().items()))
        except BaseException:
            self._forget_workers()  # a failed pass leaves no half-dead workers for the next one
            raise
        finally:
            self.dataset.close_pass(cursor)
            if self._cursor is cursor:
                self._in_pass = False
            if not self.persistent_workers:
                self._forget_workers()

    def _batches(self) -> Iterator[tuple[Any, Any]]:
        """(origin, batch) of each batch of the pass, from the loader's workers or from this thread."""
        if self.num_workers == 0:
            dataset, collate, pin = self.dataset, self.collate_fn, self.pin_memory
            for batch in dataset:
                origin = dataset.origin()
                if collate is not None:
                    batch = collate(batch)
                yield origin, pin_batch(batch) if pin else batch
            return
        runtime = self._runtime
        if runtime is None or not runtime.alive():
            self._forget_workers()  # (a persistent worker died between passes: a new set)
            runtime = self._runtime = self._start_workers()
        yield from runtime.run_pass()

    def _start_workers(self) -> ProcessWorkers | ThreadWorkers:
        kw: dict[str, Any] = {
            "prefetch": self.prefetch_factor,
            "collate_fn": self.collate_fn,
            "init_fn": self.worker_init_fn,
            "pin": self.pin_memory,
            "timeout": self.timeout,
            "first_timeout": self.first_batch_timeout,
        }
        if self.workers == "threads":
            return ThreadWorkers(self.dataset, self.num_workers, **kw)
        method = self.start_method
        if method != "fork":
            if not self._checked:
                check_picklable(method, self.start_why, dataset=self.dataset, collate_fn=self.collate_fn, worker_init_fn=self.worker_init_fn)
                self._checked = True
            main_without_file()  # python -: its "<stdin>" is no script for a worker to run
            check_main_guarded(method)  # a worker would run the script's unguarded loop again
        else:  # the storage clients each worker would make at its first read, made once here for all
            for url, options in self.dataset.sources.remote_urls():
                ready_storage_for_fork(url, options, self.dataset.storage)
        runtime = ProcessWorkers(self.dataset, self.num_workers, method=method, as_stored=self.dataset.as_stored and self.collate_fn is None, **kw)
        runtime.start(self._context)
        return runtime

    @property
    def received(self) -> int:
        """Batches the loop received in the current pass (0 before it starts)."""
        current = self._current()
        return current.taken if current is not None else 0

    def state_dict(self, batches: int | None = None) -> dict[str, Any]:
        """The data position (torchdata ``Stateful``): small, JSON-serialisable, versioned. It
        counts the batches this loop received in the current pass; ``batches`` overrides that
        count (``to_device`` passes it, less the batch it holds copied ahead). Every rank receives
        the same count, so rank 0's state is enough for all. See ``ShardStream.load_state_dict``."""
        current = self._current()
        if current is not None:
            return current.state(batches)
        return self.dataset.pass_plan(self.num_workers).state_after(batches or 0)  # the next pass, not started

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``: the next pass over its epoch delivers the rest of it
        (exactly, or elastically on another topology); started workers are replaced."""
        self.dataset.load_state_dict(state)
        self._cursor = None
        self._forget_workers()

    def rank_report(self) -> dict[str, Any] | None:
        """The last report across ranks (shardstream/ranks.py): each rank's data wait (p50, p99,
        share of step time), the slowest rank and what it waited on; a plain dict to log (TensorBoard,
        W&B). None before the first report."""
        return self._rank_report

    def close(self) -> None:
        """Stop the loader's worker processes now (the next pass starts new ones), as dropping it does."""
        self._forget_workers()

    def _forget_workers(self) -> None:
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            runtime.stop()

    def stats(self) -> dict[str, int]:
        """This rank's stream counters summed over its workers (``ShardStream.stats``), live."""
        return self.dataset.stats()

    def set_epoch(self, epoch: int) -> None:
        """The next pass follows epoch ``epoch`` (``ShardStream.set_epoch``; started workers too);
        with the loaded state's epoch it keeps that state: the pass delivers the rest of it."""
        self.dataset.set_epoch(epoch)


def make_loader(
    dataset: ShardStream,
    *,
    num_workers: int = 2,
    workers: str | None = None,
    pin_memory: bool = True,
    prefetch_factor: int | None = 2,
    persistent_workers: bool = True,
    log_interval: float | None = 60.0,
    start_method: str = "auto",
    timeout: float | None = DEFAULT_TIMEOUT,
    first_batch_timeout: float | None = DEFAULT_FIRST_BATCH_TIMEOUT,
    **kwargs: Any,
) -> ShardLoader:
    """The loader over ``dataset``: a ``ShardLoader`` with these arguments (it says what each does)."""
    given = {name: value for name, value in locals().items() if name not in ("dataset", "kwargs")}
    return ShardLoader(dataset, **given, **kwargs)
