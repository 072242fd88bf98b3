"""Reusable large buffers for one pass over the data: large members' own buffers (the tar parser)
and batch buffers (the default collate in the main process).

Fresh memory is not free: the kernel zeroes and maps every page on first touch, which on these
machines costs about as much as copying the bytes once more. A pass over 4 MiB samples allocates
a 4 MiB member buffer per sample and a batch buffer per batch, and drops each soon after; a pool
hands the same memory out again instead.

A buffer is handed out again only when nothing refers to it any more: every array, tensor or
memoryview made from it holds a reference to its numpy array (``torch.from_numpy`` included), so
the array's reference count says whether a view of it is still alive anywhere. The pool never
reuses memory that anything can still read or write.

Bounds: at most ``max_bytes`` of buffers are tracked (larger demands are plain allocations, freed
as usual), and the pool lives as long as the pass that made it.
"""

from __future__ import annotations

import mmap
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

DEFAULT_POOL_BYTES = 1 << 30
# A tracked array is free when the pool's list, the loop variable and getrefcount's argument are
# its only references.
_FREE_REFS = 3


class BufferPool:
    """Byte buffers (numpy uint8 arrays) that are reused once every view of them is gone."""

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES):
        self.max_bytes = max_bytes
        self._arrays: list[np.ndarray] = []
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def take(self, nbytes: int) -> np.ndarray:
        """An uninitialised uint8 array of ``nbytes``: a free tracked one of that size, else a new one
        (tracked while the pool has room; otherwise a free one of another size makes room)."""
        with self._lock:
            victim = -1
            arrays = self._arrays
            for i in range(len(arrays)):  # (no enumerate: its cached tuple would hold a reference)
                arr = arrays[i]
                if sys.getrefcount(arr) == _FREE_REFS:
                    if arr.nbytes == nbytes:
                        self.reused += 1
                        return arr
                    victim = i
                del arr
            self.allocated += 1
            fresh = np.empty(nbytes, np.uint8)
            if self._bytes + nbytes > self.max_bytes and victim >= 0:
                self._bytes -= self._arrays.pop(victim).nbytes  # free, wrong size: dropped
            if self._bytes + nbytes <= self.max_bytes:
                self._arrays.append(fresh)
                self._bytes += nbytes
            return fresh

    @property
    def tracked_bytes(self) -> int:
        return self._bytes


_active = threading.local()


@contextmanager
def batch_buffers(pool: BufferPool | None) -> Iterator[None]:
    """Within this block (one thread), ``active_pool()`` is ``pool``: the default collate takes its
    batch buffers from it."""
    previous = getattr(_active, "pool", None)
    _active.pool = pool
    try:
        yield
    finally:
        _active.pool = previous


def active_pool() -> BufferPool | None:
    return getattr(_active, "pool", None)


def new_shared(nbytes: int) -> Any:
    """A new shared-memory ``torch.UntypedStorage`` of ``nbytes`` (what a DataLoader worker sends
    as a handle), with its pages mapped up front.

    Filling a fresh shared segment takes one page fault per 4 KiB page, and in this VM each is
    dear: 128 MiB took 104-114 ms to fill, against 16 ms once its pages are mapped. One
    ``madvise(MADV_POPULATE_WRITE)`` call maps them all for 52-61 ms (Linux 5.14 and later;
    elsewhere, or if it is refused, the pages fault in as before)."""
    from shardstream.private import new_shared_storage

    storage = new_shared_storage(nbytes)
    populate(storage)
    return storage


def populate(storage: Any) -> None:
    """Map every page of a shared storage in this process with one ``madvise`` call, where one
    page fault each would follow (a new segment; a segment inherited over fork, whose pages exist
    but are not mapped in the child: 52 ms per 128 MiB here, against 66-88 ms of faults)."""
    nbytes = storage.nbytes()
    if nbytes >= _POPULATE_MIN and _madvise is not None:
        start = storage.data_ptr() & ~(PAGE - 1)  # the mapping may start before the data (a header)
        _madvise(start, storage.data_ptr() + nbytes - start, _MADV_POPULATE_WRITE)  # a refusal only costs the faults


def uninitialized_bytearray(nbytes: int) -> bytearray:
    """A ``bytearray`` of ``nbytes`` whose contents are whatever the allocator handed out, for a
    buffer that is about to be filled completely (a GET's body). ``bytearray(n)`` writes n zeros
    first: one more pass over every byte (0.9 ms per 17 MiB here, more on fresh memory)."""
    if _new_bytearray is None:
        return bytearray(nbytes)
    return _new_bytearray(None, nbytes)


def _bytearray_constructor() -> Any:
    import ctypes

    try:  # CPython's C API: a NULL source leaves the new bytearray's bytes as allocated
        fn = ctypes.pythonapi.PyByteArray_FromStringAndSize
    except AttributeError:
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t]
    fn.restype = ctypes.py_object
    return fn


_new_bytearray = _bytearray_constructor()

_POPULATE_MIN = 1 << 20
_MADV_POPULATE_WRITE = 23  # linux/mman.h
PAGE = mmap.PAGESIZE


def _libc_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


# In a DataLoader worker, the loader's segment pool (loader/segments.py) hands out the shared
# storages of batch buffers, so that the main process can hand them back for reuse; it registers
# itself here when the worker starts, and the pipeline asks here (it never imports the loader).
_shared_allocator: Any = None


def set_shared_allocator(take: Any) -> None:
    """Where ``take_shared`` gets storages in this process (None: fresh ones)."""
    global _shared_allocator
    _shared_allocator = take


def take_shared(nbytes: int) -> Any:
    """A shared storage for a batch buffer made in a worker: from the worker's segment pool where
    there is one, else a fresh one (``new_shared``)."""
    return _shared_allocator(nbytes) if _shared_allocator is not None else new_shared(nbytes)


def pooled_shared(nbytes: int) -> Any:
    """A shared storage of at least ``nbytes`` from this worker's segment pool, None where there is
    none (the main process, a worker with no pool): torch's own stacking in a worker asks here
    (``private.worker_new_shared``)."""
    return _shared_allocator(nbytes) if _shared_allocator is not None else None


# In a DataLoader worker under make_loader whose batches are its samples as stored (no decoding,
# no transform, no collate of the user's: nothing between the read and the hand-off sees a field),
# a large member's pieces are joined straight into the batch's shared segment by the hand-off
# (format.tar's ``Unjoined``), not into ``bytes`` first. The worker's start says so here. The
# switch is the worker process's: another dataset with decoders iterated inside such a worker (not
# a use seen) would get ``Unjoined`` values for its large members too.
_as_stored = False


def set_handed_as_stored(flag: bool) -> None:
    """Whether this process's samples go from the read to the hand-off untouched (see above)."""
    global _as_stored
    _as_stored = flag


def handed_as_stored() -> bool:
    return _as_stored
