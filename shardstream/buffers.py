"""Reusable large buffers for one pass over the data: large members' own buffers (the tar parser)
and batch buffers (the default collate outside worker processes, whose batch buffers come from
their hand-off's segments: ``WorkerInfo.take``).

Fresh memory is not free: the kernel zeroes and maps every page on first touch, which on these
machines costs about as much as copying the bytes once more. A pass over 4 MiB samples allocates
a 4 MiB member buffer per sample and a batch buffer per batch, and drops each soon after; a pool
hands the same memory out again instead.

A buffer is handed out again only when nothing refers to it any more: every array, tensor or
memoryview made from it holds a reference to its numpy array (``torch.from_numpy`` included), so
the array's reference count says whether a view of it is still alive anywhere. The pool never
reuses memory that anything can still read or write.

Bounds: at most ``max_bytes`` of buffers are tracked (larger demands are plain allocations, freed
as usual). A dataset keeps one pool for all its passes (its thread workers share it; a copy, as a
worker process receives one, starts empty), so a pass after the first allocates nothing new: fresh
memory, with the page faults of threads that share one memory map, is what slowed a thread
runtime's passes over large samples.
"""

from __future__ import annotations

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

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return BufferPool, (self.max_bytes,)  # (a copy starts empty: memory never travels)

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
