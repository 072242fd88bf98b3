"""Read-ahead: fetch the next blocks (and the next ranges) in background threads while the
worker parses the current ones. Memory is bounded by a ``Budget`` of fetched, unparsed bytes that
all of a worker's Prefetchers share (one per source of a mix, each over the source's ranges of
the whole pass, window after window): together they hold at most the budget, plus the one block
the parser is waiting for (so a block larger than the budget, or other sources' blocks filling
it, cannot stall the stream).

Requests go out ahead too: once the bytes left of the range being fetched (and of the ranges
already asked for) are within a lead (``SEND_AHEAD_BYTES``, at most ``max_bytes``), the next range
is opened and its request sent
(``RangeReader.start``), so its first byte is on its way while this one's last blocks arrive.
A range's request is one GET for all of it (``storage/retry.py``): on a store with a first-byte
latency, ranges follow each other with no wait between them. A reader says what is left and sends
its request early through optional ``remaining()`` and ``start()``: ``RangeReader`` for a tar
range, ``pipeline.table.RunsReader`` for a Parquet row group (its runs' GETs at once); a reader
without them is read in turn, its request sent by its first read.

A block read through obstore is kept as the pieces obstore handed over (``Pieces``: views of its
own buffers), not copied into a block of ours: the parser joins a large member from them once, so
each byte is copied once between obstore and the sample, not twice.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from shardstream.stats import NullCounters

Opener = Callable[[], tuple[Callable[[int], bytes], Callable[[], None]]]
SENT_AHEAD = 8  # ranges at most whose requests one fetch thread has sent beyond the range it reads (small shards: 9 in flight)
# While a thread fetches its first range, requests go out ahead only once what is left of it is at
# most this much (or twice the block, or the bound if smaller): a new range's answer then does not
# compete with the first blocks of a pass, which its first batch waits for, and still arrives in
# time (16 MiB: 160 ms at 100 MB/s, 40 ms at 400). After that, once what is left fits in the bound.
SEND_AHEAD_BYTES = 16 << 20

T = TypeVar("T")


class Pieces(list):
    """A fetched block as the pieces its body handed over (``RangeReader.pieces``: views of
    obstore's own buffers, not copied into a block of ours); ``nbytes`` in all."""

    __slots__ = ("nbytes",)

    def __init__(self, parts: list):
        super().__init__(parts)
        self.nbytes = sum(len(p) for p in parts)


def _block_bytes(item: Any) -> int:
    """The bytes a queued item holds: a block's (bytes, bytearray or Pieces), else 0 (an end, an error)."""
    if type(item) is Pieces:
        return item.nbytes
    return len(item) if isinstance(item, (bytes, bytearray)) else 0


class Budget:
    """The bytes that a worker's Prefetchers may hold fetched and not yet parsed, all together.

    ``held``: bytes held now; ``peak``: the most held at once; ``fetched``: bytes handed in by
    fetch threads; ``wasted``: bytes fetched and dropped unparsed (ranges abandoned, a pass
    closed). With ``counters`` (stats.WorkerCounters) the last three are counted as
    ``readahead_peak``, ``readahead_fetched`` and ``readahead_wasted`` too. Its lock is the one
    condition all of its Prefetchers wait on."""

    def __init__(self, max_bytes: int, counters: Any = None):
        self.max_bytes = max_bytes
        self.counters = counters or NullCounters()
        self.cond = threading.Condition()
        self.held = self.peak = self.fetched = self.wasted = 0

    def _add(self, held: int, fetched: int = 0, wasted: int = 0) -> None:  # (under cond)
        """``held`` bytes more held (fewer when negative), ``fetched`` more fetched, ``wasted`` more
        dropped unparsed; the peak follows."""
        self.held += held
        self.fetched += fetched
        self.wasted += wasted
        self.counters.add("readahead_fetched", fetched)
        self.counters.add("readahead_wasted", wasted)
        if self.held > self.peak:
            self.counters.add("readahead_peak", self.held - self.peak)
            self.peak = self.held


class Prefetcher:
    """Fetch ``openers`` (one per range, in order) block by block ahead of the consumer.

    ``threads`` ranges are fetched at once (each range by one thread, front to back): many small
    ranges (small shards, a resumed epoch's scattered samples) then cost one round trip per
    ``threads`` ranges rather than one each. Memory stays bounded by ``budget`` (shared with the
    worker's other Prefetchers; else one of ``max_bytes`` of its own) of fetched, unparsed blocks,
    except that the range the consumer is waiting on may always hand over one block (so neither a
    block larger than the budget nor ranges further ahead, here or in another Prefetcher of the
    budget, can stall it).
    """

    def __init__(self, openers: Sequence[Opener], *, block_size: int, max_bytes: int | None = None, budget: Budget | None = None, threads: int = 1):
        if budget is None:
            if max_bytes is None:
                raise TypeError("Prefetcher needs max_bytes or a budget")
            budget = Budget(max_bytes)
        self._openers = list(openers)
        self._block = block_size
        self._budget = budget
        self._max = budget.max_bytes
        self._lead = min(self._max, max(SEND_AHEAD_BYTES, 2 * block_size))
        # Per range being fetched or read: bytes, None at its end, or an exception. Made as ranges
        # start, gone once read or dropped (a pass's thousands of ranges hold no deque each).
        self._queues: dict[int, deque] = {}
        self._next = 0  # the next range a fetch thread starts
        self._front = 0  # the range the consumer reads (earlier ones are done or abandoned)
        self._waiting: int | None = None  # the range the consumer waits on (its queue is empty)
        self._cond = budget.cond
        self._stop = False
        count = max(1, min(threads, len(self._openers)))
        self._threads = [threading.Thread(target=self._run, name="shardstream-readahead", daemon=True) for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def _put(self, index: int, item) -> bool:
        """Queue a block (or the end, or an error) of range ``index``; False: stop fetching it."""
        size = _block_bytes(item)
        budget = self._budget
        with self._cond:
            while not self._stop and index >= self._front and budget.held + size > budget.max_bytes and self._waiting != index:
                self._cond.wait()
            if self._stop or index < self._front:  # closed, or the consumer moved past this range
                budget._add(0, fetched=size, wasted=size)  # (never held: every byte read is counted fetched)
                return False
            self._queue(index).append(item)
            if self._waiting == index:  # one block over the budget for the waiting consumer, no more
                self._waiting = None
            budget._add(size, fetched=size)
            self._cond.notify_all()
            return True

    def _claim(self) -> int | None:
        """The next range no thread has started, or None when there is none (or on close)."""
        with self._cond:
            if self._stop or self._next >= len(self._openers):
                return None
            index = self._next
            self._next += 1
            return index

    def _open(self, index: int) -> tuple[Any, Any, int | None]:
        """Open range ``index`` and send its request: ``(read, close, bytes)``, or ``(error, None, 0)``."""
        try:
            read, close = self._openers[index]()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer of that range, in order
            return exc, None, 0
        start, remaining = getattr(read, "start", None), getattr(read, "remaining", None)
        if start is not None:
            start()
        return read, close, (remaining() if remaining is not None else None)

    def _send_ahead(self, ahead: deque, read: Any, lead: int) -> None:
        """Open the next ranges while what is left to fetch of this one and of those already
        opened is within ``lead`` bytes (sizes from the readers' ``remaining``)."""
        remaining = getattr(read, "remaining", None)
        if remaining is None or len(ahead) >= SENT_AHEAD:
            return
        outstanding = remaining()
        for entry in ahead:
            if entry[3] is None:
                return
            outstanding += entry[3]
        while outstanding <= lead and len(ahead) < SENT_AHEAD:
            index = self._claim()
            if index is None:
                return
            read_next, close_next, size = self._open(index)
            ahead.append((index, read_next, close_next, size))
            if size is None:
                return
            outstanding += size

    def _run(self) -> None:
        ahead: deque = deque()  # (index, read, close, bytes left): ranges opened, requests sent
        lead = self._lead  # for this thread's first range (see SEND_AHEAD_BYTES), then the bound
        try:
            while True:
                if ahead:
                    index, read, close, _ = ahead.popleft()
                else:
                    claimed = self._claim()
                    if claimed is None:
                        return
                    index = claimed
                    read, close, _ = self._open(index)
                if close is None:  # opening it failed
                    self._put(index, read)
                    read = None  # (its traceback holds _open's frame, whose caller is this frame: kept, a cycle)
                    continue
                wanted = index >= self._front  # (a range the consumer passed is not read at all)
                take = getattr(read, "pieces", None)  # the body's own pieces, not copied into a block
                try:
                    while wanted:
                        data = read(self._block) if take is None else Pieces(take(self._block))
                        if not data:
                            break
                        wanted = self._put(index, data)
                        if wanted:  # once this range's answer is in (sent with it, they slowed its first bytes)
                            self._send_ahead(ahead, read, lead)
                except Exception as exc:  # noqa: BLE001 - handed to the consumer of that range, in order
                    self._put(index, exc)
                    wanted = False
                finally:
                    close()
                lead = self._max
                if wanted:
                    self._put(index, None)
        finally:
            for _, _, close, _ in ahead:  # closed before their turn: their requests are ended
                if close is not None:
                    close()

    def _take(self, index: int):
        with self._cond:
            if index > self._front:  # ranges abandoned before their end: their blocks are dropped
                for skipped in range(self._front, index):
                    self._drop(skipped)
                self._front = index
                self._cond.notify_all()
            queue = self._queue(index)
            if not queue:
                self._waiting = index  # its next block may go over the budget
                self._cond.notify_all()
                while not queue:
                    self._cond.wait()
                self._waiting = None  # (already so when a block came)
            value = queue.popleft()
            if isinstance(value, (bytes, bytearray, Pieces)):
                self._budget._add(-_block_bytes(value))
            else:  # the range's end or its error (its last item): the next range is the front now
                self._front = index + 1
                del self._queues[index]
            self._cond.notify_all()
            return value

    def _queue(self, index: int) -> deque:  # (under cond)
        queue = self._queues.get(index)
        if queue is None:
            queue = self._queues[index] = deque()
        return queue

    def _drop(self, index: int) -> None:  # (under cond)
        queue = self._queues.pop(index, None)
        while queue:
            value = queue.popleft()
            if isinstance(value, (bytes, bytearray, Pieces)):
                size = _block_bytes(value)
                self._budget._add(-size, wasted=size)

    def reader(self, index: int) -> _RangeReader:
        """``read(n)`` over range ``index``'s bytes (and ``readinto(view)``); raises what fetching
        it raised."""
        return _RangeReader(self, index)

    def close(self) -> None:
        """Stop fetching: the threads end once a read in progress returns (none waits on the
        budget), and the blocks held are given back to the budget (counted wasted)."""
        with self._cond:
            self._stop = True
            for index in list(self._queues):
                self._drop(index)
            self._cond.notify_all()

    def threads_alive(self) -> int:
        """Fetch threads still running (0 once closed and their reads returned)."""
        return sum(thread.is_alive() for thread in self._threads)


class _RangeReader:
    """The consumer's side of one range: fetched blocks handed out as they are (no copy when the
    reader asks for a whole block or more, or for a part of one piece), joined where a read spans
    a block's pieces, copied into the caller's buffer (``readinto``), or handed out as pieces
    (``pieces``: no copy; the tar parser joins a large member's pieces once, into the member)."""

    __slots__ = ("_owner", "_index", "_parts", "_i", "_at", "_ended")

    def __init__(self, owner: Prefetcher, index: int):
        self._owner = owner
        self._index = index
        self._parts: list = []  # the block being read: one bytes-like, or its pieces (Pieces)
        self._i = 0  # the part being read
        self._at = 0  # bytes of that part already handed out
        self._ended = False

    def _next_block(self) -> bool:
        if self._ended:
            return False
        value = self._owner._take(self._index)
        if isinstance(value, BaseException):
            self._ended = True
            try:
                raise value
            finally:
                del value  # (a frame that holds the error it raises is a cycle with it, and with every caller's frame)
        if value is None:
            self._ended = True
            return False
        self._parts, self._i, self._at = (value if type(value) is Pieces else [value]), 0, 0
        return True

    def _current(self) -> bool:
        """Move to the next part with bytes left (the next block's first when this one is done)."""
        parts = self._parts
        while True:
            i = self._i
            if i < len(parts):
                if self._at < len(parts[i]):
                    return True
                self._i, self._at = i + 1, 0
                continue
            if not self._next_block():
                return False
            parts = self._parts

    def __call__(self, n: int) -> bytes | memoryview:
        if not self._current():
            return b""
        parts, i, at = self._parts, self._i, self._at
        part = parts[i]
        left = len(part) - at
        if n >= left and i + 1 < len(parts):  # more than this piece: the block's pieces up to n, joined once
            return b"".join(self.pieces(n))
        if at == 0 and n >= left:
            self._at = left
            return part
        # A view of the block, not a slice: the caller copies what it keeps (the parser joins a
        # large member's pieces once), so a slice here would be one more copy of every byte.
        out = memoryview(part)[at : at + n]
        self._at = at + len(out)
        return out

    def pieces(self, n: int) -> list:
        """The next <= n bytes, at least one byte unless at the range's end, as views of the
        block's pieces (no copy), from one block."""
        if not self._current():
            return []
        parts, i, at = self._parts, self._i, self._at
        out = []
        while n > 0 and i < len(parts):
            part = parts[i]
            k = min(n, len(part) - at)
            out.append(part if at == 0 and k == len(part) else memoryview(part)[at : at + k])
            n -= k
            at += k
            if at == len(part):
                i, at = i + 1, 0
        self._i, self._at = i, at
        return out

    def readinto(self, view: memoryview) -> int:
        got = 0
        for piece in self.pieces(len(view)):
            view[got : got + len(piece)] = piece
            got += len(piece)
        return got


class PlannedSequence(Generic[T]):
    """A pass's reads in their planned order (tar ranges, a table's row groups) and the read-ahead
    over all of them (``prefetcher``, or None without one), so fetching runs on from one window's
    last read into the next window's first. Each window's reader ``take``s its reads, which must
    be the next planned; ``close`` at the pass's end (or when it is abandoned)."""

    noun = "read"

    def __init__(self, items: list[T], prefetcher: Prefetcher | None):
        self.items = items
        self.next = 0  # the first item the next reader takes
        self.prefetcher = prefetcher

    def take(self, items: Sequence[T]) -> int:
        """The index of ``items``' first in the pass's sequence; they must be the next planned."""
        first = self.next
        if list(self.items[first : first + len(items)]) != list(items):
            raise RuntimeError(f"{self.noun}s read out of their planned order (at planned {self.noun} {first} of {len(self.items)})")
        self.next = first + len(items)
        return first

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
