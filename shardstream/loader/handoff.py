"""How a batch made in a worker process reaches the loop's process, on public ground only.

A batch travels as one pickled message over the worker's socket. Small CPU tensors (at most
``INLINE_MAX_BYTES``) travel inside it as numpy arrays (``torch.from_numpy`` on arrival, no copy).
Large tensors and large ``bytes`` fields travel in *segments*: anonymous shared memory
(``os.memfd_create`` + ``mmap``) whose descriptors ride along (``socket.send_fds``). No segment has
a name, so nothing is ever left in /dev/shm. The default collate writes large batch fields straight
into a segment (``WorkerInfo.take``): their bytes are copied once; a large tensor
made elsewhere (the user's collate) is copied into one.

A worker writes its segments again once the loop's process lets go: each arrived batch views a
fresh numpy array over the mapping, whose finalizer queues the segment's release, sent back with
the loop's next message. Fresh memory costs a page fault per page; reused segments do not.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardstream.format.tar import Unjoined

INLINE_MAX_BYTES = 64 * 1024
# Undecoded fields at least this large (bytes, bytearray) cross in a segment and are rebuilt as
# the same type on arrival, instead of being pickled into the message.
SHARED_FIELD_MIN_BYTES = 1 << 20
MAX_SEGMENTS = 8  # segments a worker keeps for reuse; more in flight are used once
_FREE_REFS = 2  # a segment's array is free when only its segment and getrefcount's argument hold it
_POPULATE_MIN = 1 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # linux/mman.h


class _Segment:
    __slots__ = ("array", "fd", "map", "number", "out", "sent")

    def __init__(self, number: int, capacity: int):
        self.number = number
        self.fd = os.memfd_create(f"shardstream-{number}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity)
        self.map = mmap.mmap(self.fd, capacity)
        if capacity >= _POPULATE_MIN:
            try:  # every page mapped in one call, where one fault per page would follow (Linux 5.14+)
                self.map.madvise(_MADV_POPULATE_WRITE)
            except (OSError, ValueError):
                pass
        self.array = np.frombuffer(self.map, np.uint8)
        self.out = False  # the loop's process holds views of it
        self.sent = False  # its descriptor went to the loop's process already


class SegmentPool:
    """A worker's segments: handed out for batch buffers (``take``), found again for the tensors
    of a batch being sent (``find``), reused once released by the loop's process."""

    def __init__(self, keep: int = MAX_SEGMENTS):
        self.keep = keep
        self._segments: list[_Segment] = []
        self._next = 0
        self.dropped: list[int] = []  # segments closed here: the loop's process forgets their mappings

    def take(self, nbytes: int) -> np.ndarray:
        """An uninitialised uint8 array of ``nbytes`` on a segment nobody holds."""
        best = None
        for seg in self._segments:
            if not seg.out and seg.array.nbytes >= nbytes and sys.getrefcount(seg.array) == _FREE_REFS:
                if best is None or seg.array.nbytes < best.array.nbytes:
                    best = seg
            del seg
        if best is None or best.array.nbytes > 2 * nbytes:  # (a far larger one stays for a larger batch)
            best = _Segment(self._next, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
            self._next += 1
            self._segments.append(best)
            self._trim()
        return best.array[:nbytes]

    def _trim(self) -> None:
        free = [s for s in self._segments if not s.out and sys.getrefcount(s.array) == _FREE_REFS]
        while len(self._segments) > self.keep and free:
            seg = free.pop(0)
            self._segments.remove(seg)
            os.close(seg.fd)
            if seg.sent:
                self.dropped.append(seg.number)

    def find(self, array_or_tensor: Any) -> tuple[_Segment, int] | None:
        """(segment, byte offset) of the memory a tensor or array starts in, if it is a segment's."""
        ptr = array_or_tensor.data_ptr() if isinstance(array_or_tensor, torch.Tensor) else array_or_tensor.ctypes.data
        for seg in self._segments:
            start = seg.array.ctypes.data
            if start <= ptr < start + seg.array.nbytes:
                return seg, ptr - start
        return None

    def release(self, numbers: list[int]) -> None:
        for seg in self._segments:
            if seg.number in numbers:
                seg.out = False
        self._trim()


def _place(data: Any, nbytes: int, pool: SegmentPool, fds: list[int]) -> tuple[int, int, int]:
    """(segment, offset, index in ``fds`` or -1) of ``data`` (an array, tensor or Unjoined), copied
    into a segment unless it lies on one already; a segment new to the loop's process adds its fd."""
    found = pool.find(data) if isinstance(data, (torch.Tensor, np.ndarray)) else None
    if found is None:
        arena = pool.take(nbytes)
        if isinstance(data, Unjoined):
            data.copy_into(memoryview(arena))  # type: ignore[arg-type]  # ndarray has the buffer protocol
        elif isinstance(data, torch.Tensor):
            torch.from_numpy(arena).view(data.dtype).view(data.shape).copy_(data)
        else:
            arena[:] = np.frombuffer(data, np.uint8)
        found = pool.find(arena)
        assert found is not None
    seg, offset = found
    fd = -1
    if not seg.sent:
        seg.sent, fd = True, len(fds)
        fds.append(seg.fd)
    seg.out = True
    return seg.number, offset, fd


def pack(batch: Any, pool: SegmentPool) -> tuple[Any, list[int], list[int]]:
    """In a worker: (the batch with small tensors as arrays and large ones as segment markers, the
    descriptors of segments the loop's process has not mapped yet, segments closed since the last
    batch)."""
    fds: list[int] = []
    out = rebuild(batch, lambda x: _pack(x, pool, fds))
    dropped, pool.dropped = pool.dropped, []
    return out, fds, dropped


@dataclass(slots=True)
class _OnSegment:
    """A large tensor or bytes field's place: segment, offset, (dtype, shape, stride) or a bytes type."""

    number: int
    offset: int
    fd: int  # the index of its descriptor among the message's, -1 if the loop's process has it
    kind: str
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()


@dataclass(slots=True)
class _Inline:
    """A small tensor travelling as a numpy array."""

    array: np.ndarray


def rebuild(obj: Any, leaf: Any) -> Any:
    """``obj`` with ``leaf`` applied to everything in its dicts, lists and tuples, which are made
    anew as the same types (a dict subclass such as ``Batch``, a namedtuple)."""
    if isinstance(obj, Mapping):
        items = {k: rebuild(v, leaf) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:
            out: Any = type(obj)()
            out.update(items)
            return out
        except TypeError:
            return items
    if isinstance(obj, (list, tuple)) and type(obj) is not Unjoined:
        values = [rebuild(v, leaf) for v in obj]
        if type(obj) is list:
            return values
        if hasattr(obj, "_fields"):
            return type(obj)(*values)
        return tuple(values) if type(obj) is tuple else type(obj)(values)
    return leaf(obj)


def _pack(obj: Any, pool: SegmentPool, fds: list[int]) -> Any:
    if isinstance(obj, (bytes, bytearray)):
        if len(obj) >= SHARED_FIELD_MIN_BYTES:
            number, offset, fd = _place(obj, len(obj), pool, fds)
            return _OnSegment(number, offset, fd, type(obj).__name__, (len(obj),))
        return obj
    if type(obj) is Unjoined:  # a large member's pieces: joined into its segment, bytes on arrival
        number, offset, fd = _place(obj, obj.nbytes, pool, fds)
        return _OnSegment(number, offset, fd, "bytes", (obj.nbytes,))
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.requires_grad:
        if obj.nbytes <= INLINE_MAX_BYTES:
            try:
                return _Inline(obj.numpy())
            except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16), conjugate views
                return obj
        if not obj.is_contiguous() and pool.find(obj) is None:
            obj = obj.contiguous()
        number, offset, fd = _place(obj, obj.nbytes, pool, fds)  # (the offset of its first element)
        return _OnSegment(number, offset, fd, str(obj.dtype).removeprefix("torch."), tuple(obj.shape), tuple(obj.stride()))
    return obj


class Mappings:
    """The loop's process's side: each worker's segments mapped once, each arrived batch viewing
    them through arrays whose end releases the segment back to its worker."""

    def __init__(self, num_workers: int):
        self._maps: list[dict[int, mmap.mmap]] = [{} for _ in range(num_workers)]
        self._released: list[list[int]] = [[] for _ in range(num_workers)]
        self._lock = threading.Lock()

    def take_released(self, worker: int) -> list[int]:
        with self._lock:
            out, self._released[worker] = self._released[worker], []
        return out

    def _release(self, worker: int, number: int) -> None:
        with self._lock:
            self._released[worker].append(number)

    def unpack(self, worker: int, obj: Any, fds: list[int], dropped: list[int], pinned: bool) -> Any:
        maps = self._maps[worker]
        for number in dropped:
            maps.pop(number, None)
        views: dict[int, np.ndarray] = {}
        out = rebuild(obj, lambda x: self._restore(worker, x, fds, maps, views))
        if pinned:
            out = pin(out)
        for fd in fds:
            os.close(fd)  # (the mapping stays)
        for number, view in views.items():
            weakref.finalize(view, self._release, worker, number)
        return out

    def _view(self, worker: int, marker: _OnSegment, fds: list[int], maps: dict[int, mmap.mmap], views: dict[int, np.ndarray]) -> np.ndarray:
        view = views.get(marker.number)
        if view is None:
            mapped = maps.get(marker.number)
            if mapped is None or marker.fd >= 0:
                fd = fds[marker.fd]
                mapped = maps[marker.number] = mmap.mmap(fd, os.fstat(fd).st_size)
            # This batch's own array over the segment, straight over the mapping: numpy makes every
            # slice of it refer to it (not to an array further down), so it lives exactly as long
            # as the batch's tensors and fields do, and its end releases the segment.
            view = views[marker.number] = np.frombuffer(mapped, np.uint8)
        return view

    def _restore(self, worker: int, obj: Any, fds: list[int], maps: dict[int, mmap.mmap], views: dict[int, np.ndarray]) -> Any:
        if type(obj) is _Inline:
            return torch.from_numpy(obj.array)
        if type(obj) is not _OnSegment:
            return obj
        view = self._view(worker, obj, fds, maps, views)
        if obj.kind in ("bytes", "bytearray"):
            data = view[obj.offset : obj.offset + obj.shape[0]]
            return data.tobytes() if obj.kind == "bytes" else bytearray(data)
        dtype = getattr(torch, obj.kind)
        size = (sum((s - 1) * st for s, st in zip(obj.shape, obj.stride)) + 1) if all(obj.shape) else 0
        nbytes = size * torch.empty(0, dtype=dtype).element_size()
        return torch.from_numpy(view[obj.offset : obj.offset + nbytes]).view(dtype).as_strided(obj.shape, obj.stride)


def pin(obj: Any) -> Any:
    """``obj`` with every CPU tensor in it in pinned memory (dicts, lists, tuples, namedtuples)."""
    return rebuild(obj, lambda x: x.pin_memory() if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x)
