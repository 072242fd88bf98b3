"""Read-ahead: fetch the next blocks (and the next ranges) in background threads while the
worker parses the current ones. Memory is bounded by ``max_bytes`` of fetched, unparsed blocks
(one block may exceed it, so a block larger than the bound cannot stall the stream).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

Opener = Callable[[], tuple[Callable[[int], bytes], Callable[[], None]]]


class Prefetcher:
    """Fetch ``openers`` (one per range, in order) block by block ahead of the consumer.

    ``threads`` ranges are fetched at once (each range by one thread, front to back): many small
    ranges (small shards, a resumed epoch's scattered samples) then cost one round trip per
    ``threads`` ranges rather than one each. Memory stays bounded by ``max_bytes`` of fetched,
    unparsed blocks, except that the range the consumer is waiting on may always hand over one
    block (so neither a block larger than the bound nor ranges further ahead can stall it).
    """

    def __init__(self, openers: Sequence[Opener], *, block_size: int, max_bytes: int, threads: int = 1):
        self._openers = list(openers)
        self._block = block_size
        self._max = max_bytes
        self._queues: list[deque] = [deque() for _ in self._openers]  # bytes, None at range end, or exception
        self._bytes = 0
        self._next = 0  # the next range a fetch thread starts
        self._front = 0  # the range the consumer reads (earlier ones are done or abandoned)
        self._cond = threading.Condition()
        self._stop = False
        count = max(1, min(threads, len(self._openers)))
        self._threads = [threading.Thread(target=self._run, name="shardstream-readahead", daemon=True) for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def _put(self, index: int, item) -> bool:
        """Queue a block (or the end, or an error) of range ``index``; False: stop fetching it."""
        size = len(item) if isinstance(item, (bytes, bytearray)) else 0
        queue = self._queues[index]
        with self._cond:
            while (not self._stop and index >= self._front and self._bytes + size > self._max
                   and not (index == self._front and not queue)):
                self._cond.wait()
            if self._stop or index < self._front:  # closed, or the consumer moved past this range
                return False
            queue.append(item)
            self._bytes += size
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stop or self._next >= len(self._openers):
                    return
                index = self._next
                self._next += 1
            try:
                read, close = self._openers[index]()
                wanted = True
                try:
                    while wanted:
                        data = read(self._block)
                        if not data:
                            break
                        wanted = self._put(index, data)
                finally:
                    close()
                if wanted:
                    self._put(index, None)
            except Exception as exc:  # noqa: BLE001 - handed to the consumer of that range, in order
                self._put(index, exc)

    def _take(self, index: int):
        with self._cond:
            if index > self._front:  # ranges abandoned before their end: their blocks are dropped
                for skipped in range(self._front, index):
                    self._drop(skipped)
                self._front = index
                self._cond.notify_all()
            queue = self._queues[index]
            while not queue:
                self._cond.wait()
            value = queue.popleft()
            if isinstance(value, (bytes, bytearray)):
                self._bytes -= len(value)
            else:  # the range's end or its error: the next range is the front now
                self._front = index + 1
            self._cond.notify_all()
            return value

    def _drop(self, index: int) -> None:
        queue = self._queues[index]
        while queue:
            value = queue.popleft()
            if isinstance(value, (bytes, bytearray)):
                self._bytes -= len(value)

    def reader(self, index: int) -> _RangeReader:
        """``read(n)`` over range ``index``'s bytes (and ``readinto(view)``); raises what fetching
        it raised."""
        return _RangeReader(self, index)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()


class _RangeReader:
    """The consumer's side of one range: fetched blocks handed out as they are (no copy when the
    reader asks for a whole block or more), or copied into the caller's buffer (``readinto``)."""

    __slots__ = ("_owner", "_index", "_pending", "_at", "_ended")

    def __init__(self, owner: Prefetcher, index: int):
        self._owner = owner
        self._index = index
        self._pending: bytes = b""
        self._at = 0  # bytes of _pending already handed out
        self._ended = False

    def _next_block(self) -> bool:
        if self._ended:
            return False
        value = self._owner._take(self._index)
        if isinstance(value, BaseException):
            self._ended = True
            raise value
        if value is None:
            self._ended = True
            return False
        self._pending, self._at = value, 0
        return True

    def __call__(self, n: int) -> bytes | memoryview:
        if self._at >= len(self._pending) and not self._next_block():
            return b""
        pending, at = self._pending, self._at
        if at == 0 and n >= len(pending):
            self._at = len(pending)
            return pending
        # A view of the block, not a slice: the caller copies what it keeps (the parser joins a
        # large member's pieces once), so a slice here would be one more copy of every byte.
        out = memoryview(pending)[at : at + n]
        self._at = at + len(out)
        return out

    def readinto(self, view: memoryview) -> int:
        if self._at >= len(self._pending) and not self._next_block():
            return 0
        k = min(len(view), len(self._pending) - self._at)
        view[:k] = memoryview(self._pending)[self._at : self._at + k]
        self._at += k
        return k
