"""Shared-memory segments that a DataLoader worker fills again once the main process is done with
them: both ends of the protocol.

A worker hands a large batch to the main process through shared memory. Made fresh for every
batch, a segment costs more than the copy into it: the kernel zeroes and maps every page in the
worker, the main process maps it again, and its file descriptor crosses a socket. Measured with 2
persistent workers handing over 128 MiB batches of 4 MiB ``.npy`` samples from tmpfs
(``benchmarks/bench_handoff.py``): 1.13 GB/s with fresh segments, 2.28 GB/s with reused ones. So each
worker keeps a small pool (``WorkerPool``), and the main process keeps each segment mapped
(``Channels``) once it has seen it. The pool serves shardstream's own batch buffers
(``buffers.take_shared``) and the large storages torch's ``default_collate`` asks for when it
stacks in the worker's main thread (``private.worker_new_shared``): 4 MiB samples stacked by
torch's collate, 2 persistent workers, took 1.50 CPU s/GB with fresh segments and 0.63 from the pool
(``bench_handoff.py --collate torch``).

A segment is written again only when nobody can still read it:

- The main process never gives the user its own mapping. Every batch gets a fresh numpy view of
  it, and every tensor of that batch on that segment holds this view. A finalizer on the view
  fires when the last of those tensors (and every view of them) is gone, or at once after a
  pinned copy. Only then is the segment released.
- A release is a message on a pipe, one per worker, from the main process to the worker. A pipe,
  not a flag in shared memory: writing and reading it are system calls, which order every write
  the main process made to the segment before the worker's next ones (on arm64 a plain flag
  would not).
- In the worker, a released segment is handed out again only if no tensor of the worker still
  uses it (its storage's use count).
- A segment that reached the main process some other way (inside an object the hand-off does
  not walk, so torch sent it by file descriptor as usual) is not seen by the worker's pack step:
  the pool lets go of it and never reuses it.

The first time a segment is sent, its storage goes with the batch (torch passes the file
descriptor). Later, only the worker's token and the segment's number go: the main process has it
mapped, and the release it sent proves that. Tokens are random per worker process, so messages
meant for an earlier worker (non-persistent workers are new every pass; pids are reused) match
nothing.

A batch the main process receives but never hands to the user (DataLoader drops the prefetched
batches when a pass with persistent workers is cut short by ``break``) releases its segments when
its hand-off record is garbage-collected, marked "never mapped" where its storage came with it, so
the worker sends that storage again next time. Without this, each cut-short pass would leave
segments pending for good.

Workers that are new every pass (``persistent_workers=False``) inherit the segments of the pass
before instead of making fresh ones: a fresh segment's pages are allocated and zeroed, an
inherited one is only mapped again (on this VM 52 ms against 147 ms per 128 MiB, and 15-23 ms for
a warm copy). When a pass ends by running out, DataLoader has joined its workers, so nobody writes
their segments any more; the main process keeps them ("retired", at most ``MAX_SEGMENTS`` per
worker). Just before the next workers are forked it hands each of them the retired segments that no
batch view holds any more, under a token it chose for that worker and registered with the segments'
mappings, so the worker sends them by number from its first batch. A pass cut short (``break``)
unmaps its segments as before: its workers may still be running when that is noticed.

A new worker's first batch would wait for its first segment: made, its pages zeroed and mapped
(16 MiB: 11-40 ms here with two workers starting at once). Where the manifests tell a batch's size
(samples handed over as stored: ``make_loader``'s ``_stored_batch_bytes``), each worker that
inherited no segment makes one of that size in a thread as it starts, while its plan, its storage
client and its first GET go on; the first ``take`` that fits it gets it (waiting for the thread if
it is not done). One that does not fit stays in the pool like any other.

Workers that are not forked (forkserver, spawn: see workers.py) receive the read end of their
release pipe as a passed descriptor and the segments set aside for them as shared storages, with
the loader's channels pickled into their ``worker_init_fn``: the same protocol, from the same
first batch. Where a pipe is full, segments are simply fresh.
"""

from __future__ import annotations

import os
import struct
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from shardstream.buffers import PAGE, new_shared, populate, set_handed_as_stored, set_shared_allocator
from shardstream.private import dup_fd, spawning, storage_use_count

_MESSAGE = struct.Struct("<QI")  # (worker token, segment number | _UNMAPPED): 12 bytes, written atomically
_UNMAPPED = 1 << 31  # released without being mapped: send the storage again
# At most this many segments per worker. In flight at once: the batch being built, the prefetched
# ones (2 by default), the ones the main loop holds and a pinned copy; beyond this, fresh segments.
MAX_SEGMENTS = 8


def _use_count(storage: Any) -> int:
    return storage_use_count(storage)


def _capacity(nbytes: int) -> int:
    """``nbytes`` rounded up to a size class (at most 1/8 larger), so fields of varying sizes can
    reuse the same segments."""
    step = max(PAGE, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


class PooledTensor:
    """What replaces a tensor on a pooled segment in a packed batch: where it lies, not its bytes,
    and the batch's Handoff (pickled once with the batch). DataLoader's pin-memory thread calls
    ``pin_memory()`` on it, so pinning still happens in that thread, off the training loop."""

    __slots__ = ("segment", "dtype", "size", "stride", "offset", "handoff")

    def __init__(self, segment: int, dtype: Any, size: tuple[int, ...], stride: tuple[int, ...], offset: int, handoff: Handoff | None = None):
        self.segment, self.dtype, self.size, self.stride, self.offset = segment, dtype, size, stride, offset
        self.handoff = handoff

    def __reduce__(self) -> Any:
        return PooledTensor, (self.segment, self.dtype, self.size, self.stride, self.offset, self.handoff)

    def tensor(self) -> Any:
        """The tensor this stands for, over the batch's own view of the segment (main process)."""
        if self.handoff is None:
            raise RuntimeError("a pooled tensor without its hand-off record")
        return tensor_from(self.handoff.views()[self.segment], self)

    def pin_memory(self, device: Any = None) -> Any:
        t = self.tensor()
        return t.pin_memory(device) if device is not None else t.pin_memory()


class Handoff:
    """A batch's segments: (number, storage on first sending else None), and the numbers the worker
    let go of (the main process unmaps them). In the main process it knows its loader's Channels
    (found by id on arrival), so a batch dropped unseen still releases its segments."""

    __slots__ = ("token", "worker", "segments", "dropped", "channels_id", "channels", "received", "_views")

    def __init__(self, token: int, worker: int, segments: list[tuple[int, Any]], dropped: list[int], channels_id: int = 0):
        self.token, self.worker, self.segments, self.dropped = token, worker, segments, dropped
        self.channels_id = channels_id
        self.channels: Channels | None = None
        self.received = False
        self._views: dict[int, Any] | None = None

    def views(self) -> dict[int, Any]:
        """{segment number: this batch's view of it}, mapped on first use (by the pin thread or by
        unpack_batch, whichever comes first)."""
        if self._views is None:
            if self.channels is None:
                raise RuntimeError("a batch on pooled segments needs the loader's channels to unpack")
            self._views = self.channels.receive(self)
        return self._views

    def done(self) -> None:
        """The batch is unpacked: its views now live only in the tensors made from them."""
        self._views = None

    def __reduce__(self) -> Any:
        return _arrive, (self.token, self.worker, self.segments, self.dropped, self.channels_id)

    def __del__(self) -> None:
        channels = self.channels
        if channels is None or self.received:
            return
        try:
            for number, storage in self.segments:  # never shown to anyone: free to write again
                channels._release(self.worker, self.token, number if storage is None else number | _UNMAPPED)
            for number in self.dropped:
                channels.unmap(self.token, number)
        except Exception:  # noqa: BLE001 - at interpreter exit the module may be half gone
            pass


def _arrive(token: int, worker: int, segments: list[tuple[int, Any]], dropped: list[int], channels_id: int) -> Handoff:
    handoff = Handoff(token, worker, segments, dropped, channels_id)
    handoff.channels = _live.get(channels_id)
    return handoff


class _Segment:
    __slots__ = ("number", "storage", "capacity", "taken", "pending", "known", "inherited", "ahead")

    def __init__(self, number: int, storage: Any, capacity: int):
        self.number, self.storage, self.capacity = number, storage, capacity
        self.taken = False  # handed out since the last pack step
        self.pending = 0  # sendings the main process has not released yet
        self.known = False  # the main process has it mapped (it released it once)
        self.inherited = False  # made before this worker was forked: its pages are not mapped here yet
        self.ahead = False  # made ahead of the first batch and not handed out yet


class WorkerPool:
    """A worker's segments. ``take`` hands one out; the loader's pack step (once per batch) asks
    ``find`` for the marker of each tensor on them, then tells ``sent`` which were sent."""

    def __init__(
        self,
        release_fd: int,
        worker: int,
        max_segments: int = MAX_SEGMENTS,
        channels_id: int = 0,
        token: int | None = None,
        inherited: Sequence[tuple[int, Any, int]] = (),
        ahead: int = 0,
    ):
        self.fd, self.worker, self.max_segments, self.channels_id = release_fd, worker, max_segments, channels_id
        self.token = int.from_bytes(os.urandom(8), "little") if token is None else token
        self.segments: list[_Segment] = []
        for number, storage, capacity in inherited:  # mapped in the main process under this token already
            seg = _Segment(number, storage, capacity)
            seg.known = seg.inherited = True
            self.segments.append(seg)
        self._numbers = max((n for n, _, _ in inherited), default=-1) + 1
        self._dropped: list[int] = []
        self._rest = b""
        self.reused = self.made = self.made_ahead = 0
        self.inherited = len(self.segments)
        self._ahead: tuple[threading.Thread, list[Any], int] | None = None
        self.ahead_capacity = 0  # the size of the segment made ahead (0: none)
        if ahead > 0 and not self.segments:
            self._make_ahead(_capacity(ahead))

    def _make_ahead(self, capacity: int) -> None:
        """Make a segment of ``capacity`` in a thread: the worker's first batch finds it ready."""
        made: list[Any] = []

        def make() -> None:
            try:
                made.append(new_shared(capacity))
            except Exception:  # noqa: BLE001 - (out of shared memory, say): the first batch makes its own, as before
                pass

        thread = threading.Thread(target=make, name="shardstream-segment", daemon=True)
        thread.start()
        self._ahead = (thread, made, capacity)
        self.ahead_capacity = capacity

    def _join_ahead(self) -> None:
        """The segment made ahead joins the pool (waiting for it if it is still being made)."""
        if self._ahead is None:
            return
        thread, made, capacity = self._ahead
        self._ahead = None
        thread.join()
        if made:
            seg = _Segment(self._numbers, made[0], capacity)
            seg.ahead = True
            self.segments.append(seg)
            self._numbers += 1
            self.made_ahead += 1

    def _drain(self) -> None:
        data = self._rest
        while True:
            try:
                chunk = os.read(self.fd, 64 * _MESSAGE.size)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # the pipe is gone: nothing will be released any more
                break
            if not chunk:
                break
            data += chunk
        whole = len(data) - len(data) % _MESSAGE.size
        self._rest = data[whole:]
        if not whole:
            return
        mine = {s.number: s for s in self.segments}
        for token, number in _MESSAGE.iter_unpack(data[:whole]):
            seg = mine.get(number & ~_UNMAPPED) if token == self.token else None
            if seg is not None and seg.pending:
                seg.pending -= 1
                seg.known = seg.known or not number & _UNMAPPED

    def _free(self, seg: _Segment) -> bool:
        return not seg.taken and not seg.pending and _use_count(seg.storage) == 1

    def take(self, nbytes: int) -> Any:
        """A shared ``UntypedStorage`` of at least ``nbytes``, maybe written before."""
        self._join_ahead()
        self._drain()
        best = None
        for seg in self.segments:
            if nbytes <= seg.capacity <= 2 * nbytes and self._free(seg) and (best is None or seg.capacity < best.capacity):
                best = seg
        if best is not None:
            best.taken = True
            self.reused += not best.ahead  # (made ahead: its first use is no reuse)
            best.ahead = False
            if best.inherited:  # first use in this worker: map its pages in one call
                best.inherited = False
                populate(best.storage)
            return best.storage
        if len(self.segments) >= self.max_segments:
            victim = next((s for s in self.segments if self._free(s)), None)
            if victim is None:  # all in use: a fresh one, not kept
                return new_shared(nbytes)
            self._let_go(victim)
        capacity = _capacity(nbytes)
        seg = _Segment(self._numbers, new_shared(capacity), capacity)
        self._numbers += 1
        seg.taken = True
        self.segments.append(seg)
        self.made += 1
        return seg.storage

    def _let_go(self, seg: _Segment) -> None:
        self.segments.remove(seg)
        if seg.known:
            self._dropped.append(seg.number)

    def find(self, tensor: Any) -> PooledTensor | None:
        """The marker for ``tensor`` if it lies on one of this pool's segments."""
        ptr = tensor.untyped_storage().data_ptr()
        for seg in self.segments:
            if seg.storage.data_ptr() == ptr:
                return PooledTensor(seg.number, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        return None

    def sent(self, numbers: set[int]) -> Handoff | None:
        """After a batch was packed: ``numbers`` are the segments its markers name. Segments handed
        out but not named may have left inside something the pack step does not walk: never
        reused."""
        out = []
        for seg in list(self.segments):
            if seg.number in numbers:
                out.append((seg.number, None if seg.known else seg.storage))
                seg.pending += 1
                seg.taken = False
            elif seg.taken:
                seg.taken = False
                self._let_go(seg)
        if not out:  # nothing to tell now: what was let go goes with the next batch that names segments
            return None
        dropped, self._dropped = self._dropped, []
        return Handoff(self.token, self.worker, out, dropped, self.channels_id)


_pool: WorkerPool | None = None
_parents: list[Any] = []  # in a worker: the main process's mappings as forked (see start_worker)


def worker_pool() -> WorkerPool | None:
    """This worker's pool (None in the main process, in spawned workers, or without make_loader)."""
    return _pool


class Channels:
    """One loader's release pipes (one per worker) and, in the main process, the segments it has
    mapped. Made by make_loader; forked workers inherit it with the loader."""

    def __init__(self, num_workers: int, first_batch_bytes: int = 0, as_stored: bool = False):
        self.owner = os.getpid()
        # A batch's bytes in shared memory as the manifest foretells them (0: unknown): each new
        # worker with no inherited segment makes one that size ahead, in a thread (WorkerPool).
        self.first_batch_bytes = first_batch_bytes
        # The workers' batches are their samples as stored (nothing between the read and the
        # hand-off sees a field): a large member's pieces are joined into the batch's segment by
        # the hand-off, not into bytes first (buffers.handed_as_stored).
        self.as_stored = as_stored
        self.id = int.from_bytes(os.urandom(8), "little")
        _live[self.id] = self
        self.pipes: list[tuple[int, int]] = []
        for _ in range(num_workers):
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self.pipes.append((r, w))
        self._close = weakref.finalize(self, _close_all, list(self.pipes))
        self.mapped: dict[int, dict[int, Any]] = {}  # token -> number -> uint8 array over the mapping
        self.views: dict[tuple[int, int], int] = {}  # (token, number) -> batch views alive
        self.retired: dict[tuple[int, int], Any] = {}  # a finished pass's segments: (token, number) -> array
        self.inherit: dict[int, tuple[int, list[tuple[int, Any, int]]]] = {}  # worker -> (token, segments)
        self._lock = threading.Lock()  # views are counted down by finalizers, in any thread
        self.dropped_releases = 0

    def __getstate__(self) -> dict[str, Any]:
        if not spawning() or not self.pipes:  # a plain copy: no pipes, no pool
            return {"owner": -1, "pipes": [], "id": 0, "inherit": {}, "first_batch_bytes": 0, "as_stored": False}
        # A worker started by a forkserver or spawn: the read ends of the release pipes go as passed
        # descriptors, the segments set aside for it as shared storages (torch's reduction: their fds).
        pipes = [(dup_fd(r), -1) for r, _ in self.pipes]
        return {
            "owner": _PASSED,
            "pipes": pipes,
            "id": self.id,
            "inherit": self.inherit,
            "first_batch_bytes": self.first_batch_bytes,
            "as_stored": self.as_stored,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["pipes"] = [(r.detach() if hasattr(r, "detach") else r, w) for r, w in state["pipes"]]
        self.__dict__.update(state)
        self.mapped, self.views, self.retired = {}, {}, {}
        self._lock = threading.Lock()
        self.dropped_releases = 0

    def prepare_workers(self) -> None:
        """In the main process, just before a new set of workers is forked: give each the retired
        segments no batch view holds any more, under a token chosen here for that worker."""
        self.inherit = {}
        if not self.pipes:
            return
        with self._lock:
            free = [key for key in self.retired if not self.views.get(key)]
        shares: list[list[Any]] = [[] for _ in self.pipes]
        for i, key in enumerate(free[: MAX_SEGMENTS * len(self.pipes)]):
            shares[i % len(self.pipes)].append(self.retired.pop(key))
        for worker, share in enumerate(shares):
            token = int.from_bytes(os.urandom(8), "little")
            known = self.mapped.setdefault(token, {})
            segments = []
            for number, array in enumerate(share):
                known[number] = array
                # the array's base is the tensor made over the segment's storage (see receive)
                segments.append((number, array.base.untyped_storage(), array.nbytes))
            self.inherit[worker] = (token, segments)

    def start_worker(self, worker: int) -> None:
        """In a DataLoader worker (its worker_init_fn): this worker's pool, if it was forked by the
        process that made these pipes, with the segments the main process set aside for it."""
        global _pool
        _pool = None
        set_shared_allocator(None)
        set_handed_as_stored(False)
        if (self.owner != _PASSED and os.getppid() != self.owner) or worker >= len(self.pipes):  # a plain copy: no pool
            return
        token, inherited = self.inherit.get(worker, (None, []))
        # The arrays over this worker's inherited segments go, so that a segment's use count is the
        # pool's own (the check before each reuse). The parent's other mappings stay referenced, as
        # a forked child always left them: freeing a copy could count down what the parent holds.
        if token is not None:
            self.mapped.pop(token, None)
        _parents.append((self.mapped, self.retired))
        self.mapped, self.views, self.retired, self.inherit = {}, {}, {}, {}
        _pool = WorkerPool(self.pipes[worker][0], worker, channels_id=self.id, token=token, inherited=inherited, ahead=self.first_batch_bytes)
        set_shared_allocator(_pool.take)  # the pipeline's batch buffers come from this pool
        set_handed_as_stored(self.as_stored)

    def workers_tokens(self) -> set[int]:
        """The tokens chosen for the workers forked last (they may have sent no batch)."""
        return {token for token, _ in self.inherit.values()}

    def receive(self, handoff: Handoff) -> dict[int, Any]:
        """In the main process: {segment number: a fresh uint8 numpy view of it for this batch},
        each releasing its segment when the last tensor made from it is gone."""
        import torch

        handoff.received = True
        known = self.mapped.setdefault(handoff.token, {})
        views = {}
        token = handoff.token
        for number, storage in handoff.segments:
            if storage is not None:
                known[number] = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
            base = known.get(number)
            if base is None:
                raise RuntimeError(
                    f"shardstream hand-off: worker {handoff.worker} sent segment {number} "
                    f"by number, but it was never mapped here (please report this)"
                )
            view = base[:]
            with self._lock:
                self.views[(token, number)] = self.views.get((token, number), 0) + 1
            fin = weakref.finalize(view, self._view_gone, handoff.worker, token, number)
            fin.atexit = False  # type: ignore[misc]  # (a property typeshed lacks)
            views[number] = view
        for number in handoff.dropped:
            self.unmap(token, number)
        return views

    def _view_gone(self, worker: int, token: int, number: int) -> None:
        with self._lock:
            left = self.views.get((token, number), 1) - 1
            if left > 0:
                self.views[(token, number)] = left
            else:
                self.views.pop((token, number), None)
        self._release(worker, token, number)

    def _release(self, worker: int, token: int, number: int) -> None:
        try:
            os.write(self.pipes[worker][1], _MESSAGE.pack(token, number))
        except OSError:  # a full pipe (a worker that stopped reading): it makes fresh segments
            self.dropped_releases += 1

    def unmap(self, token: int, number: int) -> None:
        """A segment its worker let go of: never named again."""
        known = self.mapped.get(token)
        if known is not None:
            known.pop(number, None)

    def forget(self, tokens: set[int], retire: bool = False) -> None:
        """Unmap the segments of workers that are gone (tensors still held keep their own view).
        With ``retire`` (the workers are known to have exited: their pass ran out) they are kept
        for the next workers instead, at most MAX_SEGMENTS per worker."""
        for token in tokens:
            known = self.mapped.pop(token, None) or {}
            if retire:
                self.retired.update(((token, number), array) for number, array in known.items())
        while len(self.retired) > MAX_SEGMENTS * len(self.pipes):  # the oldest first
            del self.retired[next(iter(self.retired))]


_live: weakref.WeakValueDictionary[int, Channels] = weakref.WeakValueDictionary()
_PASSED = -2  # Channels.owner of a copy made for a worker that was not forked: its pipes came with it


def _close_all(pipes: list[tuple[int, int]]) -> None:
    for r, w in pipes:
        for fd in (r, w):
            try:
                os.close(fd)
            except OSError:
                pass


def tensor_from(view: Any, marker: PooledTensor) -> Any:
    """The tensor a marker stands for, over this batch's view of its segment."""
    import torch

    flat = torch.from_numpy(view)
    if marker.dtype != torch.uint8:
        flat = flat.view(marker.dtype)
    return flat.as_strided(marker.size, marker.stride, marker.offset)
