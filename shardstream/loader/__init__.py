"""make_loader: the DataLoader around a ShardStream, as a webdataset.WebLoader with the right defaults,
and the worker -> main process hand-off of batches.

The dataset batches inside its workers, so the loader's batch_size is None; ``len(loader)`` is the
number of batches per rank in a whole pass (an epoch, also after ``load_state_dict``). The loader never changes the dataset: a worker learns its
number and index from ``get_worker_info``, and the hand-off packing runs in the loader's
``collate_fn``, which DataLoader calls in the worker on each batch the dataset yields.

Hand-off: DataLoader workers send every torch tensor through a new shared-memory segment, a fixed
cost of tens of microseconds per tensor that dominates for small fields (labels, ids). Small CPU
tensors therefore travel inline as numpy arrays, anywhere in the batch (dict, tuple, list,
namedtuple, nested, or a bare tensor), and become tensors again on arrival (``torch.from_numpy``,
no copy); large ones (images) keep the shared-memory path. Large undecoded ``bytes`` fields
(``SHARED_FIELD_MIN_BYTES`` and up) cross in shared memory too, and are ``bytes`` again on arrival.
Where a worker's batches are its samples as stored (no decoding, transform or collate of the
user's: ``_as_stored``), such a member read on its own reaches the hand-off as the pieces the
stream handed over (``format.tar.Unjoined``), which are joined straight into the batch's segment:
each byte is copied once in the worker, not joined into ``bytes`` and copied again. The main
process's copy out of the segment stays: the user gets ``bytes``, which own their memory (a
``bytes`` cannot be made over the segment), so that a segment written again changes nothing the
user holds.
Under make_loader a worker writes its large batches into segments it used before, once the main
process is done with them, and sends those by number (segments.py).

Position: the loader plans each pass once, in the main process, and announces it to its workers
(``ShardStream.open_pass``: they join that pass and check their own plan against it). Each batch
a worker packs carries its origin (plan/cursor.py's ``Origin``: worker, pass, which of its
batches) beside it, under ``ORIGIN``; the unpack stage takes it off and the loop's ``Cursor``
counts the batch from it, so the user's batch is what the dataset made and the state is the
pass's batches received without a gap.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import webdataset

from shardstream.buffers import new_shared
from shardstream.dataset import ShardStream
from shardstream.errors import ConfigError
from shardstream.format.parquet import TableManifest
from shardstream.format.tar import Unjoined
from shardstream.loader.segments import Channels, Handoff, PooledTensor, WorkerPool, worker_pool
from shardstream.loader.workers import (
    DEFAULT_FIRST_BATCH_TIMEOUT,
    DEFAULT_TIMEOUT,
    WorkerStart,
    check_main_guarded,
    check_picklable,
    context,
    main_without_file,
    preload_remote,
    resolve_start_method,
    warm_forkserver,
    watched,
)
from shardstream.pipeline.batch import default_collate
from shardstream.plan.cursor import Cursor, Origin
from shardstream.plan.requests import is_remote
from shardstream.plan.run import PassPlan
from shardstream.portable import reduce_portable
from shardstream.private import drop_loader_iterator, iterator_workers, loader_iterator, pin_memory, shutdown_workers
from shardstream.ranks import WaitMeter, gather
from shardstream.shared import isolate_resource_tracker
from shardstream.storage.ranges import ready_for_fork as ready_storage_for_fork

logger = logging.getLogger(__name__)

INLINE_MAX_BYTES = 64 * 1024
# Undecoded fields at least this large (bytes, bytearray) cross in shared memory and are rebuilt as
# the same type on arrival: pickling them through the worker's pipe copies every byte four times
# and measured 4x slower for 4 MB fields (0.16 against 0.5-0.7 GB/s, 2 workers).
SHARED_FIELD_MIN_BYTES = 1 << 20
# A packed batch is {PACKED: spec, "batch": structure}: a plain dict, so DataLoader's pin-memory
# thread still walks into it and pins the large tensors. ``spec`` mirrors the structure only where
# tensors were turned into arrays: {key or index: sub-spec}, True at an inlined tensor.
PACKED = "__shardstream_inline__"
SHARED = "__shardstream_shared__"  # the batch's SharedFields, if it has large bytes fields
SEGMENTS = "__shardstream_segments__"  # the batch's segments.Handoff, if tensors lie on pooled segments
ORIGIN = "__shardstream_origin__"  # where the batch came from (plan/cursor.py's Origin), under make_loader
_ON_SEGMENT = "segment"  # the spec of a tensor replaced by a segments.PooledTensor
_SCALARS = (str, bytes, int, float, bool, type(None))


class SharedFields:
    """Every large bytes field of one batch, end to end in one new shared-memory uint8 tensor.
    DataLoader sends the tensor's handle, not its bytes: one handle per batch (each is a file
    descriptor that the worker's resource-sharer thread passes over a socket). Not a tensor in
    the batch structure itself, so the pin-memory thread leaves it alone: these fields become
    ``bytes`` again, never device tensors."""

    def __init__(self, fields: list[bytes | bytearray | Unjoined], take: Callable[[int], Any] = new_shared):
        self.ends = np.cumsum([len(f) for f in fields]).tolist()
        storage = take(self.ends[-1])  # maybe larger: a pooled segment
        self.tensor: Any = torch.empty(0, dtype=torch.uint8).set_(storage)[: self.ends[-1]]
        arena = self.tensor.numpy()
        start = 0
        for data, end in zip(fields, self.ends):
            if isinstance(data, Unjoined):  # a member's pieces, joined here, in their place: copied once
                data.copy_into(memoryview(arena[start:end]))  # type: ignore[arg-type]  # ndarray has the buffer protocol
            else:
                arena[start:end] = np.frombuffer(data, np.uint8)
            start = end

    def view(self, index: int) -> np.ndarray:
        return self.tensor.numpy()[self.ends[index - 1] if index else 0 : self.ends[index]]


class _Packing:
    """One batch's pack step: the large bytes fields met, and the worker's segment pool (if any)
    with the markers made for tensors on its segments."""

    __slots__ = ("max_bytes", "large", "pool", "markers")

    def __init__(self, max_bytes: int, pool: WorkerPool | None):
        self.max_bytes, self.pool = max_bytes, pool
        self.large: list[bytes | bytearray | Unjoined] = []
        self.markers: list[PooledTensor] = []


def _pack(obj: Any, ctx: _Packing) -> tuple[Any, Any]:
    """(structure with small CPU tensors as numpy arrays, spec or None if nothing changed). Large
    bytes fields are appended to ``ctx.large`` and leave None behind; their spec is (type, index in
    ``ctx.large``). Tensors on the worker's pooled segments become PooledTensor markers."""
    if isinstance(obj, (bytes, bytearray)):
        if len(obj) >= SHARED_FIELD_MIN_BYTES:
            ctx.large.append(obj)
            return None, ("bytes" if isinstance(obj, bytes) else "bytearray", len(ctx.large) - 1)
        return obj, None
    if type(obj) is Unjoined:  # a large member's pieces (samples handed over as stored): bytes on arrival
        ctx.large.append(obj)
        return None, ("bytes", len(ctx.large) - 1)
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or obj.requires_grad:
            return obj, None
        if obj.nbytes <= ctx.max_bytes:
            try:
                return obj.numpy(), True
            except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16), conjugate views
                return obj, None
        marker = ctx.pool.find(obj) if ctx.pool is not None else None
        if marker is None:
            return obj, None
        ctx.markers.append(marker)
        return marker, _ON_SEGMENT
    if isinstance(obj, _SCALARS):
        return obj, None
    if isinstance(obj, Mapping):
        spec: dict[Any, Any] = {}
        changed: dict[Any, Any] = {}
        for k, v in obj.items():
            if isinstance(v, _SCALARS) and (type(v) is not bytes or len(v) < SHARED_FIELD_MIN_BYTES):  # nothing to pack
                continue
            nv, s = _pack(v, ctx)
            if s is not None:
                spec[k] = s
                changed[k] = nv
        if not spec:
            return obj, None
        out = dict(obj) if type(obj) is dict else _copy_mapping(obj)
        out.update(changed)
        return out, spec
    if isinstance(obj, (list, tuple)):
        spec = {}
        items: list[Any] | None = None
        for i, v in enumerate(obj):
            if isinstance(v, _SCALARS) and (type(v) is not bytes or len(v) < SHARED_FIELD_MIN_BYTES):  # nothing to pack
                continue
            nv, s = _pack(v, ctx)
            if s is not None:
                if items is None:
                    items = list(obj)
                items[i] = nv
                spec[i] = s
        if items is None:
            return obj, None
        return _rebuild(obj, items), spec
    return obj, None


def _copy_mapping(obj: Mapping) -> Any:
    import copy

    try:
        return copy.copy(obj)
    except TypeError:
        return dict(obj)


def _rebuild(obj: list | tuple, items: list[Any]) -> Any:
    if isinstance(obj, list):
        return items if type(obj) is list else type(obj)(items)
    if hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*items)
    return tuple(items) if type(obj) is tuple else type(obj)(items)


def pack_batch(batch: Any, max_bytes: int = INLINE_MAX_BYTES, pool: WorkerPool | None = None, origin: Origin | None = None) -> Any:
    """In a worker: small CPU tensors anywhere in ``batch`` become numpy arrays, large bytes
    shared-memory tensors, and tensors on ``pool``'s segments markers; all marked for
    unpack_batch. ``origin`` (where the batch came from) travels beside it, never in it."""
    ctx = _Packing(max_bytes, pool)
    packed, spec = _pack(batch, ctx)
    shared = None
    if ctx.large:
        shared = SharedFields(ctx.large, pool.take if pool is not None else new_shared)
        marker = pool.find(shared.tensor) if pool is not None else None
        if marker is not None:
            shared.tensor = marker
            ctx.markers.append(marker)
    handoff = pool.sent({m.segment for m in ctx.markers}) if pool is not None else None
    for m in ctx.markers:
        m.handoff = handoff
    if spec is None and origin is None:
        return batch
    out = {PACKED: spec, "batch": packed}
    if origin is not None:
        out[ORIGIN] = origin
    if shared is not None:
        out[SHARED] = shared
    if handoff is not None:
        out[SEGMENTS] = handoff
    return out


def _restore(obj: Any, spec: Any, pin: bool, shared: SharedFields | None) -> Any:
    if spec is True:
        t = torch.from_numpy(obj)
        return t.pin_memory() if pin else t
    if type(spec) is str:  # _ON_SEGMENT (a string after pickling: compared by type, not identity)
        if isinstance(obj, torch.Tensor):  # pinned already, by DataLoader's pin-memory thread
            return obj
        t = obj.tensor()
        return t.pin_memory() if pin else t
    if type(spec) is tuple:  # (type, index) in the batch's SharedFields
        assert shared is not None
        view = shared.view(spec[1])
        return view.tobytes() if spec[0] == "bytes" else bytearray(view)
    if isinstance(obj, (list, tuple)):
        items = list(obj)
        for i, s in spec.items():
            items[i] = _restore(items[i], s, pin, shared)
        return _rebuild(obj, items)
    for k, s in spec.items():  # a mapping: the worker's copy, ours to change
        obj[k] = _restore(obj[k], s, pin, shared)
    return obj


def unpack_batch(batch: Any, pin: bool = False, channels: Channels | None = None) -> Any:
    """In the main process: undo pack_batch (numpy -> tensor without a copy; pinned if asked).
    ``channels`` maps the batch's pooled segments (see segments.py)."""
    if type(batch) is not dict or PACKED not in batch:
        return batch
    if batch[PACKED] is None:  # nothing packed: only its origin travelled beside it
        return batch["batch"]
    handoff: Handoff | None = batch.get(SEGMENTS)
    if handoff is not None and handoff.channels is None:
        handoff.channels = channels  # (a batch that was not pickled: tests)
    shared = batch.get(SHARED)
    if shared is not None and isinstance(shared.tensor, PooledTensor):
        shared.tensor = shared.tensor.tensor()
    out = _restore(batch["batch"], batch[PACKED], pin, shared)
    if handoff is not None:
        handoff.done()
    return out


class PackInWorker:
    """The loader's collate_fn: the user's (or pass-through) function, then pack_batch; DataLoader
    runs it in the worker. A class, not a closure, so it pickles for spawned workers."""

    def __init__(self, fn: Callable[[Any], Any] | None = None, max_bytes: int = INLINE_MAX_BYTES):
        self.fn = fn
        self.max_bytes = max_bytes

    def __reduce__(self) -> Any:
        return reduce_portable(self)  # the user's collate by value where a worker could not import it

    def __call__(self, batch: Any) -> Any:
        if self.fn is not None:
            batch = self.fn(batch)
        return pack_batch(batch, self.max_bytes, worker_pool(), _origin_here())


def _origin_here() -> Origin | None:
    """In a DataLoader worker over a ShardStream: the origin of the batch its dataset just yielded
    (DataLoader calls the collate_fn on each batch right after taking it from the dataset)."""
    info = torch.utils.data.get_worker_info()
    dataset = info.dataset if info is not None else None
    return dataset.origin() if isinstance(dataset, ShardStream) else None


def _passthrough(batch: Any) -> Any:
    """The dataset already collated: skip DataLoader's default_convert walk over every element."""
    return batch


class UnpackStage:
    """The loader's first pipeline stage: unpack_batch on every batch, so stages added later
    (``loader.map(...)``) see the batches as the dataset made them. Every wait for a batch is
    bounded (``watch``: workers.watched's keywords). When a pass ends, the segments of its workers
    are unmapped, unless the workers persist into the next pass. Each batch's origin goes to
    ``arrived``, for the loop's cursor; the batch goes on without it."""

    def __init__(
        self,
        pin: bool,
        channels: Channels | None = None,
        persistent: bool = False,
        watch: dict[str, Any] | None = None,
        arrived: deque[Origin] | None = None,
    ):
        self.pin, self.channels, self.persistent, self.watch, self.arrived = pin, channels, persistent, watch, arrived

    def __call__(self, batches):
        pin, channels = self.pin, self.channels
        if self.watch is not None:
            batches = watched(batches, **self.watch)
        tokens: set[int] = set()
        if channels is not None:
            tokens |= channels.workers_tokens()  # this pass's workers (forked as it starts), batches or not
        ran_out = False
        try:
            arrived = self.arrived
            for batch in batches:
                if type(batch) is dict and PACKED in batch:
                    if SEGMENTS in batch:
                        tokens.add(batch[SEGMENTS].token)
                    origin = batch.get(ORIGIN)
                    if origin is not None and arrived is not None:
                        arrived.append(Origin(*origin))  # (pinning turns a tuple into a list)
                yield unpack_batch(batch, pin, channels)
            ran_out = True  # DataLoader has joined the pass's workers: their segments can be inherited
        finally:
            if channels is not None and not self.persistent:
                channels.forget(tokens, retire=ran_out)


def _in_process(dataset: ShardStream, collate: Callable[[Any], Any], pin: bool, pin_device: str, arrived: deque[Origin]) -> Any:
    """Batches of ``dataset`` iterated in this process: what DataLoader does with no workers
    (each batch's origin to ``arrived``, as UnpackStage does for workers' batches)."""
    for batch in dataset:
        origin = dataset.origin()
        if origin is not None:
            arrived.append(origin)
        batch = collate(batch)
        yield pin_memory(batch, pin_device) if pin else batch


class ShardLoader(webdataset.WebLoader):
    """The loader ``make_loader`` returns: a ``webdataset.WebLoader`` (a DataLoader with
    ``.map(...)`` and the other fluid stages) around a ``ShardStream``; build it with
    ``make_loader``, which sets its defaults.

    - ``len(loader)``: the batches each rank gets in a whole pass, the same on every rank, before
      and after ``load_state_dict``; ``remaining``: what is left of the pass (of a resumed one, the rest).
    - ``set_epoch(n)``, ``stats()``: the dataset's, reached from here.
    - ``state_dict()`` / ``load_state_dict(state)``: the data position, counted in batches this
      loop received (``to_device`` subtracts the one it holds copied ahead); see Resume.
    - Each pass starts its workers safely (``start_method``), checks they can be sent the dataset,
      bounds every wait for a batch (``timeout``, ``first_batch_timeout``: ``WorkerTimeout``), and
      unpacks the workers' hand-off (small tensors inline, large ones on reused shared memory).
    - With ``num_workers=0`` the dataset is iterated in the loop's own process.
    """

    def __init__(
        self,
        dataset: ShardStream,
        *,
        log_interval: float | None = None,
        channels: Channels | None = None,
        start_method: str = "forkserver",
        start_why: str = "asked for",
        timeout: float | None = None,
        first_batch_timeout: float | None = None,
        **kwargs: Any,
    ):
        super().__init__(dataset, **kwargs)
        self.dataset = dataset
        # Batches a client counted in the resumed pass before its checkpoint, for len(): the state
        # counts only those since the pass's last elastic resume, so ShardDataModule saves its own
        # count and sets it here after load_state_dict (which leaves it); None: the state's count.
        self.counted_before: int | None = None
        self.log_interval = log_interval
        self.num_workers = int(kwargs.get("num_workers") or 0)
        self.persistent_workers = bool(kwargs.get("persistent_workers"))
        self.channels = channels
        self.start_method = start_method  # fork, forkserver or spawn (make_loader resolved "auto"), or "given"
        self.start_why = start_why
        self.worker_start = kwargs.get("worker_init_fn") if isinstance(kwargs.get("worker_init_fn"), WorkerStart) else None
        self._checked: set[str] = set()  # start methods the dataset was found picklable for
        self._watch = {
            "stats": dataset.counters,
            "rank": dataset.world.rank,
            "timeout": timeout,
            "first_timeout": first_batch_timeout,
            "semaphores": False,
            "method": None,  # how this pass's workers start, for WorkerDied's message
        }
        # Where each batch the loop is about to receive came from, oldest first (UnpackStage, or
        # _in_process with no workers, put them; __iter__ gives each to the loop's cursor).
        self._arrived: deque[Origin] = deque()
        self.append(UnpackStage(bool(kwargs.get("pin_memory")), channels, self.persistent_workers, self._watch, self._arrived))
        self._cursor: Cursor | None = None  # the last pass's plan, and the batches the loop received in it
        self._in_pass = False  # a pass of this loader is being iterated (its generator is open)
        dataset.loader_workers = self.num_workers  # what dataset.plan() and its summary assume
        self.rank_meter = WaitMeter(interval_s=log_interval)  # every rank's data wait, gathered (ranks.py)
        self._rank_report: dict[str, Any] | None = None

    def __len__(self) -> int:
        """Batches per rank of the pass in progress, else of the next, counted from the pass's
        start, as torch's DataLoader, StatefulDataLoader and Lightning count: a whole pass, before
        and after ``load_state_dict``. A resumed pass's length includes the batches received
        before its checkpoint (the state's count), so a loop that restores its own step count and
        stops at ``len(loader)`` (Lightning's fit loop) gets the rest exactly; on another topology
        that is the batches received before plus those the elastic pass yields. What is left to
        yield: ``remaining``."""
        plan = self._length_plan()
        if plan is None or plan.loaded is None:
            return len(self.dataset)
        before = plan.loaded.last.batches if self.counted_before is None else self.counted_before  # (exact: plan.received)
        return before + plan.batches_per_rank

    @property
    def remaining(self) -> int:
        """Batches per rank still to come in the pass in progress (or the one the loop left
        mid-way, as ``state_dict`` counts), else in the next one: after ``load_state_dict``, what
        the resumed pass yields (the rest of it); else a whole pass."""
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

    def __iter__(self):
        interval = self.log_interval
        next_log = time.monotonic() + interval if interval else None
        # Counted here, in the main process, as the loop receives them, from where each came:
        # batches still in worker queues at checkpoint time are not counted, so they are
        # delivered again after a resume. The pass is planned here, once, and its workers told.
        cursor = self._cursor = self.dataset.open_pass(self.num_workers)
        if cursor.plan.loaded is not None:
            logger.info("%s", cursor.plan.summary())
        arrived = self._arrived
        arrived.clear()
        self._in_pass = True
        if self.persistent_workers and not self._workers_alive():
            self._forget_workers()  # a persistent worker died (killed, out of memory): start a new set
        self._watch["semaphores"] = False
        if self.num_workers > 0 and (not self.persistent_workers or loader_iterator(self.pipeline[0]) is None):
            self._start_workers()
        meter = self.rank_meter
        meter.begin()
        try:
            for batch in super().__iter__():
                meter.arrived()
                if meter.due():  # at the same batch count on every rank: a collective they all join
                    self._rank_report = gather(meter, self.dataset.stats(), self.dataset.world, self.num_workers, log=bool(interval))
                if arrived:
                    cursor.see(arrived.popleft())
                elif cursor.lost is None:
                    cursor.lost = (
                        "a stage added to the loader yields more items than the batches it receives (unbatched, ...); "
                        "take state_dict(batches=...) with your own count, or resume from a loader without such stages"
                    )
                yield batch
                meter.ask()
                if interval and next_log is not None and time.monotonic() >= next_log:
                    next_log = time.monotonic() + interval
                    logger.info("shardstream: %s", " ".join(f"{k}={v}" for k, v in self.dataset.stats().items()))
        except BaseException:
            if self.persistent_workers:
                self._forget_workers()  # a failed pass leaves no half-dead workers for the next one
            raise
        finally:
            self.dataset.close_pass(cursor)
            if self._cursor is cursor:
                self._in_pass = False

    def iterator1(self):
        """One pass through the pipeline (webdataset's DataPipeline calls this). With no workers the
        dataset is iterated here, in the loop's process, as DataLoader would (the loader's collate_fn
        on each batch, then pinned if asked), without DataLoader's single-process iterator around it:
        it adds nothing here (the dataset batches itself) but its cost per batch, about 0.6 µs per
        small sample. The stages after the DataLoader (unpacking, ``loader.map(...)``) run as ever."""
        if self.num_workers > 0:
            return super().iterator1()
        loader = self.pipeline[0]
        source = _in_process(self.dataset, loader.collate_fn, bool(loader.pin_memory), loader.pin_memory_device, self._arrived)
        for step in self.pipeline[1:]:
            source = self.invoke(step, source)
        return source

    def _start_workers(self) -> None:
        """Just before a new set of workers starts: how (fork only where it is safe, see workers.py),
        with the dataset checked picklable where it will be pickled, and a clean board."""
        loader = self.pipeline[0]
        if self.start_method == "given":  # DataLoader's multiprocessing_context, as the user gave it
            ctx = loader.multiprocessing_context
            method = ctx.get_start_method() if ctx is not None else multiprocessing.get_start_method()
        else:
            method = self.start_method  # chosen once, by make_loader: the same every pass
            loader.multiprocessing_context = context(method, start=True)  # (a forkserver's server from this sys.path)
            if method != "fork" and method not in self._checked:
                check_picklable(method, self.start_why, dataset=self.dataset, collate_fn=loader.collate_fn, worker_init_fn=loader.worker_init_fn)
                self._checked.add(method)
        self._watch["method"] = method
        if method != "fork":
            main_without_file()  # python -: its "<stdin>" is no script for a worker to run
            check_main_guarded(method)  # a worker would run the script's unguarded loop again
        else:
            ready_for_fork(self.dataset)  # what each worker would make at its first read, made once here
        if self.worker_start is not None:
            self.worker_start.start(method)
            if method != "fork":  # its queues' semaphores are named: unlinked once every worker opened them
                self._watch["semaphores"] = True
        self.dataset.counters.clear_board()
        if self.channels is not None:
            self.channels.prepare_workers()  # new workers inherit the last pass's segments

    def _workers_alive(self) -> bool:
        it = loader_iterator(self.pipeline[0])
        if it is None:
            return True
        return all(w.is_alive() for w in iterator_workers(it) or [])  # (statuses are all down between passes)

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
        (exactly, or elastically on another topology). Persistent workers already started are
        replaced, so they see the state."""
        self.dataset.load_state_dict(state)
        self._cursor = None
        self._forget_workers()

    def _forget_workers(self) -> None:
        # The wrapped DataLoader keeps persistent workers in ``_iterator``; shutting it down here, in
        # the process that started them, stops them now (and leaves its ``__del__`` nothing to do,
        # wherever it runs), and the next pass starts workers holding the dataset as it is now.
        it = drop_loader_iterator(self.pipeline[0])
        if it is not None:
            shutdown_workers(it)
        if self.channels is not None:
            self.channels.forget(set(self.channels.mapped))

    def rank_report(self) -> dict[str, Any] | None:
        """The last report of every rank's data wait (``shardstream.ranks.report``: per rank p50/p99
        wait, its share of step time, what it waited on; the slowest rank), None before the first;
        the same dict on every rank. A plain dict to log (TensorBoard, W&B)."""
        return self._rank_report

    def stats(self) -> dict[str, int]:
        """This rank's stream counters, summed over its workers since the dataset was built (the
        dataset's ``stats()``): counter name -> count, such as ``bytes_read``, ``requests``,
        ``retries``, ``samples_skipped``, ``cache_hits`` (all of them: ``shardstream.stats.COUNTERS``).
        Workers add to them as they read, so they can be read during an epoch."""
        return self.dataset.stats()

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass over the loader follow epoch ``epoch`` (its shard order and shuffle;
        the same on every rank); later passes go on from it (``epoch + 1``, ...). Without it, every
        new pass advances the epoch by one by itself. It reaches workers already started
        (``persistent_workers``) too. After ``load_state_dict``, ``set_epoch`` with the state's epoch
        (``dataset.epoch`` once loaded) keeps the loaded state: that epoch's pass delivers the rest
        of it."""
        self.dataset.set_epoch(epoch)


_readying: list[threading.Thread] = []  # ready_for_fork(ahead=True) threads no fork has waited for yet
_readying_lock = threading.Lock()


def ready_for_fork(dataset: ShardStream, *, ahead: bool = False) -> None:
    """Before ``fork`` starts workers: the storage clients they read remote sources with, made here
    (``storage.ranges.ready_for_fork``), so every worker inherits them instead of making its own.

    ``ahead``: in a background thread, which ``make_loader`` starts, so that the script's own set-up
    before its first pass (the model, DDP) hides it (in a fresh process 0.6 s, most of it importing
    s3fs). A loader's fork first waits for every such thread: none forks while one imports or holds
    a lock."""
    if ahead:
        thread = threading.Thread(target=_ready_quietly, args=(dataset,), name="shardstream-fork-ready", daemon=True)
        with _readying_lock:
            _readying.append(thread)
        thread.start()
        return
    with _readying_lock:
        pending = _readying[:]
        _readying.clear()
    for thread in pending:
        thread.join()
    _ready(dataset)  # (after a thread did it: found made, at once)


def _ready(dataset: ShardStream) -> None:
    for manifest, options in zip(dataset.sources.manifests, dataset.sources.storage_options):
        if is_remote(manifest):
            url = manifest.base_url or (manifest.file_url(0) if isinstance(manifest, TableManifest) else manifest.shard_url(0))
            ready_storage_for_fork(url, options, dataset.storage)


def _ready_quietly(dataset: ShardStream) -> None:
    try:
        _ready(dataset)
    except Exception:  # noqa: BLE001 - the fork readies again, and a failure there is the workers' to report
        logger.debug("shardstream: storage not readied ahead of the fork", exc_info=True)


def _as_stored(dataset: ShardStream) -> bool:
    """Whether ``dataset``'s batches are its samples as stored, batched by the default collate: no
    decoding, no transform, nothing between the read and the batch that sees a field."""
    return not (dataset.per_sample or dataset.decode.defaults or not dataset.batch_size or dataset.tables or dataset.collate is not default_collate)


def _stored_batch_bytes(dataset: ShardStream) -> int:
    """Shared-memory bytes for a batch of samples handed over as they are stored (no decoding, no
    transform, the default collate), from the manifests' mean sample size, with a quarter more
    room (a segment serves batches of half its size and up); 0 where a batch's size is not known
    from the manifests, or its fields travel inline."""
    if not _as_stored(dataset):
        return 0
    manifests = dataset.sources.manifests
    samples = sum(m.total_samples for m in manifests)
    mean = sum(m.total_bytes for m in manifests) // max(samples, 1)
    if mean < SHARED_FIELD_MIN_BYTES:
        return 0
    return mean * dataset.batch_size * 5 // 4


def make_loader(
    dataset: ShardStream,
    *,
    num_workers: int = 2,
    pin_memory: bool = True,
    prefetch_factor: int | None = 2,
    persistent_workers: bool = True,
    log_interval: float | None = 60.0,
    reuse_shared_memory: bool = True,
    start_method: str = "auto",
    timeout: float | None = DEFAULT_TIMEOUT,
    first_batch_timeout: float | None = DEFAULT_FIRST_BATCH_TIMEOUT,
    **kwargs: Any,
) -> ShardLoader:
    """Wrap ``dataset`` in a loader; checks that ``num_workers`` leaves every worker something to read.

    ``pin_memory`` only takes effect where an accelerator is present. Extra keyword arguments go
    to ``torch.utils.data.DataLoader`` (a ``collate_fn`` runs in the worker on each batch; ``in_order``
    must stay True: a state counts the pass's batches received without a gap, from the origin
    each batch carries). Every
    ``log_interval`` seconds (None: never) the stream counters of this rank are logged at INFO
    level; ``loader.stats()`` reads them any time. The dataset is not changed.

    With ``reuse_shared_memory`` (forked workers), each worker keeps up to
    ``segments.MAX_SEGMENTS`` shared-memory segments for its large batches and writes a segment
    again only once the main process no longer holds any tensor on it; a fresh segment per batch
    measured 2x slower. Pass False to give each batch a fresh segment (memory returned as soon as
    batches are dropped, at that cost).

    ``start_method`` says how workers start, one way for the whole process: ``"auto"`` (the
    default) is ``"forkserver"`` unless the environment variable ``SHARDSTREAM_START_METHOD`` names
    another, and the first "auto" loader of a process fixes it for every later one (see
    ``shardstream.loader.workers``: ``fork()`` copies one thread of a process that has many, and
    can deadlock the child). ``"fork"``, ``"forkserver"`` or ``"spawn"`` ask for one (so does
    DataLoader's ``multiprocessing_context``). Workers that are not forked receive the dataset
    pickled: what a worker can import goes by reference, and a function it cannot (one defined in a
    notebook cell, ``python -`` or ``python -c``, a lambda, a closure, webdataset's decoders) goes
    by value with cloudpickle (``shardstream.portable``); what cannot travel at all (an open file,
    a lock) is a ConfigError at the first pass. Where workers will start from a forkserver, its server
    (1.4-2.1 s to start) is started here, in the background.

    ``persistent_workers`` (default True) keeps the workers between passes, so a new epoch starts
    without starting workers again (under forkserver that took 1.3-2.4 s per epoch); ``set_epoch``
    and ``load_state_dict`` still reach them (``load_state_dict`` starts new ones).

    Every wait for a batch is bounded: ``first_batch_timeout`` seconds for the first batch of a
    pass (workers start, plan and open their first shards), ``timeout`` for each later one (None:
    unbounded). Past it the loop raises ``WorkerTimeout`` naming the rank, the worker, its pid and
    its last step. Workers die with their rank process, whatever the start method.

    ``len(loader)`` is the whole pass per rank, before and after ``load_state_dict`` (torch's
    convention); ``loader.remaining`` is what is left of it.
    """
    dataset.check_workers(num_workers)  # raises ConfigError naming the numbers
    if "resumed_len" in kwargs:
        raise ConfigError(
            "make_loader has no resumed_len any more: len(loader) is always the whole pass (torch's, StatefulDataLoader's "
            "and Lightning's convention), and loader.remaining is what is left of a resumed one"
        )
    if kwargs.pop("timeout", None):
        raise ConfigError(
            "make_loader bounds waits with timeout= (each batch) and first_batch_timeout= (its own "
            "keywords, in seconds); DataLoader's timeout is set from them"
        )
    if kwargs.get("in_order", True) is not True:
        raise ConfigError(
            "make_loader keeps DataLoader's in_order=True: resume counts the batches the loop received, from each "
            "batch's origin, as the batches of the pass received without a gap (with in_order=False a fast worker's "
            "batches overtake a slow one's, and a resume would deliver those again)"
        )
    why = "given as multiprocessing_context"
    if kwargs.get("multiprocessing_context") is not None:
        if start_method != "auto":
            raise ConfigError("give start_method or multiprocessing_context, not both")
        start_method = "given"
    else:
        start_method, why = resolve_start_method(start_method)  # once per process for "auto"; refuses unknown names now
        if num_workers > 0 and start_method != "fork":
            logger.info("shardstream: DataLoader workers start with %s (%s)", start_method, why)
        if num_workers > 0 and start_method != "fork":
            isolate_resource_tracker()  # before the forkserver, which inherits it: a kill of the job leaves no semaphore
        if num_workers > 0 and start_method == "forkserver":
            if any(is_remote(m) for m in dataset.sources.manifests):
                preload_remote()
            warm_forkserver()  # its 1.4-2.1 s start overlaps the script's own set-up, not the first batch
        if num_workers > 0 and start_method == "fork" and any(is_remote(m) for m in dataset.sources.manifests):
            ready_for_fork(dataset, ahead=True)  # the workers' storage clients, made while the script sets up
    collate_fn = kwargs.pop("collate_fn", None)
    channels = None
    if num_workers > 0:
        collate_fn = PackInWorker(collate_fn)
        if reuse_shared_memory:
            plain = collate_fn.fn is None  # (a collate_fn of the user's sees the batch before the hand-off)
            channels = Channels(num_workers, first_batch_bytes=_stored_batch_bytes(dataset) if plain else 0, as_stored=plain and _as_stored(dataset))
        kwargs["worker_init_fn"] = WorkerStart(channels, kwargs.get("worker_init_fn"), inline_bytes=collate_fn.max_bytes)
    return ShardLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        collate_fn=collate_fn or _passthrough,
        pin_memory=pin_memory and torch.cuda.is_available(),
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
        log_interval=log_interval,
        channels=channels,
        start_method=start_method,
        start_why=why,
        timeout=timeout if num_workers > 0 else None,
        first_batch_timeout=first_batch_timeout if num_workers > 0 else None,
        **kwargs,
    )
