"""Read-ahead: fetch the next blocks (and the next ranges) in a background thread while the
worker parses the current ones. Memory is bounded by ``max_bytes`` of fetched, unparsed blocks
(one block may exceed it, so a block larger than the bound cannot stall the stream).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

Opener = Callable[[], tuple[Callable[[int], bytes], Callable[[], None]]]


class Prefetcher:
    """Fetch ``openers`` (one per range, in order) block by block ahead of the consumer."""

    def __init__(self, openers: Sequence[Opener], *, block_size: int, max_bytes: int):
        self._openers = list(openers)
        self._block = block_size
        self._max = max_bytes
        self._items: deque = deque()  # (range index, bytes | None at range end | exception)
        self._bytes = 0
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="shardstream-readahead", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        size = len(item[1]) if isinstance(item[1], (bytes, bytearray)) else 0
        with self._cond:
            while not self._stop and self._items and self._bytes + size > self._max:
                self._cond.wait()
            if self._stop:
                return False
            self._items.append(item)
            self._bytes += size
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        for index, opener in enumerate(self._openers):
            try:
                read, close = opener()
                try:
                    while True:
                        data = read(self._block)
                        if not data:
                            break
                        if not self._put((index, data)):
                            return
                finally:
                    close()
                if not self._put((index, None)):
                    return
            except Exception as exc:  # noqa: BLE001 - handed to the consumer of that range, in order
                if not self._put((index, exc)):
                    return

    def _take(self, index: int):
        with self._cond:
            while True:
                while self._items and self._items[0][0] < index:  # leftovers of an abandoned range
                    self._drop_first()
                if self._items:
                    item = self._items[0]
                    self._drop_first()
                    return item[1]
                self._cond.wait()

    def _drop_first(self) -> None:
        _, value = self._items.popleft()
        if isinstance(value, (bytes, bytearray)):
            self._bytes -= len(value)
        self._cond.notify_all()

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

    def __call__(self, n: int) -> bytes:
        if self._at >= len(self._pending) and not self._next_block():
            return b""
        pending, at = self._pending, self._at
        if at == 0 and n >= len(pending):
            self._at = len(pending)
            return pending
        out = pending[at : at + n]
        self._at = at + len(out)
        return out

    def readinto(self, view: memoryview) -> int:
        if self._at >= len(self._pending) and not self._next_block():
            return 0
        k = min(len(view), len(self._pending) - self._at)
        view[:k] = memoryview(self._pending)[self._at : self._at + k]
        self._at += k
        return k
