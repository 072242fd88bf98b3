"""Stream counters: per DataLoader worker, in shared memory, summed on the rank.

Each worker adds to its own row of a shared array (no locks: one writer per row), so the
training loop can read totals for the whole rank at any time with ``dataset.stats()``.

Beside the counters, each worker keeps a line on a board: its pid, when it last made progress
and what that was ("reading s3://b/train/shard-000003.tar from byte 0"). The loader's watchdog
reads it to say what a worker that sends no batch was doing (loader/watchdog: ``WorkerTimeout``).
"""

from __future__ import annotations

import multiprocessing
import os
import struct
import time
from typing import Any

from shardstream.private import spawning

COUNTERS = (
    "bytes_read",  # bytes received from storage
    "ranges_opened",  # shard ranges started
    "ranges_sliced",  # of those, read at a member sidecar's offsets, no header parsed (format/members.py)
    "retries",  # storage reads retried after a transient failure
    "resumes",  # of those, reads resumed mid-range (from the exact byte reached)
    "throttles",  # of those, throttling answers (503 SlowDown, 429)
    "storage_wait_us",  # time spent waiting on storage reads
    "decode_us",  # time spent decoding samples (the decoders, built-in or the user's)
    "transform_us",  # time spent in the user's per-sample transform
    "samples_skipped",  # samples left out under on_error="skip"
    "samples_filtered",  # samples the transform dropped (returned None)
    "cache_hits",  # shard ranges served from the local cache
    "cache_misses",  # shards downloaded into the cache
    "cache_bypass",  # reads that skipped a full cache (every cached shard in use)
    "cache_corrupt",  # cached shards found damaged on a hit (dropped and fetched again)
    "shards_verified",  # whole shards hashed while streaming (verify_stream) and found intact
    "checksum_failures",  # shards whose bytes did not match the manifest's sha256
    "requests",  # storage requests for shard bytes (on S3 one GET per range, one more per resume)
    "readahead_fetched",  # bytes the read-ahead fetched ahead of the parser
    "readahead_wasted",  # of those, bytes dropped unparsed (ranges abandoned, a pass ended early)
    "readahead_peak",  # the most bytes a worker's read-ahead held at once (summed over workers)
)
MAX_SLOTS = 256  # DataLoader workers per rank that get their own row


# A board line: (pid, time of the step in ms since the epoch, batches made in this pass), then the
# step in UTF-8, cut to fit. Written by one worker, read by the main process for diagnostics only:
# a torn read shows a garbled line, never a wrong count.
_LINE = struct.Struct("<qqq")
LINE_BYTES = 256
_TEXT = LINE_BYTES - _LINE.size


class StreamStats:
    def __init__(self) -> None:
        self._array: Any = multiprocessing.RawArray("q", MAX_SLOTS * len(COUNTERS))
        self._board: Any = multiprocessing.RawArray("b", MAX_SLOTS * LINE_BYTES)

    def counters(self, worker: int) -> WorkerCounters:
        return WorkerCounters(self._array, worker % MAX_SLOTS, self._board)

    def worker_line(self, worker: int) -> tuple[int, float, int, str] | None:
        """(pid, seconds since its last step, batches made this pass, the step) of a worker's last
        report, or None if it never reported (it never started its pass)."""
        base = (worker % MAX_SLOTS) * LINE_BYTES
        raw = bytes(memoryview(self._board).cast("B")[base : base + LINE_BYTES])
        pid, t_ms, batches = _LINE.unpack_from(raw)
        if pid == 0:
            return None
        text = raw[_LINE.size :].split(b"\0", 1)[0].decode("utf-8", "replace")
        return pid, max(0.0, time.time() - t_ms / 1000), batches, text

    def clear_board(self) -> None:
        """Before a new set of workers starts: no line left from the last ones."""
        memoryview(self._board).cast("B")[:] = bytes(len(self._board))

    def totals(self) -> dict[str, int]:
        width = len(COUNTERS)
        values = list(self._array)
        return {name: sum(values[i::width]) for i, name in enumerate(COUNTERS)}

    def __getstate__(self):
        if not spawning():  # a plain copy: counts no longer shared
            return {"_array": list(self._array), "_board": bytes(memoryview(self._board).cast("B"))}
        return {"_array": self._array, "_board": self._board}

    def __setstate__(self, state) -> None:
        self._array, self._board = state["_array"], state["_board"]
        if isinstance(self._board, bytes):
            board = multiprocessing.RawArray("b", len(self._board))
            memoryview(board).cast("B")[:] = self._board
            self._board = board


class WorkerCounters:
    __slots__ = ("_array", "_base", "_board", "_line", "batches")

    def __init__(self, array: Any, slot: int, board: Any = None):
        self._array = array
        self._base = slot * len(COUNTERS)
        self._board = memoryview(board).cast("B") if board is not None else None
        self._line = slot * LINE_BYTES
        self.batches = 0

    def add(self, name: str, value: int = 1) -> None:
        self._array[self._base + _INDEX[name]] += value

    def step(self, what: str, batch: bool = False) -> None:
        """Report progress on this worker's board line (``batch``: one more batch made)."""
        if self._board is None:
            return
        if batch:
            self.batches += 1
        text = what.encode("utf-8", "replace")[: _TEXT - 1] + b"\0"
        line = _LINE.pack(os.getpid(), int(time.time() * 1000), self.batches) + text
        self._board[self._line : self._line + len(line)] = line


class NullCounters:
    def add(self, name: str, value: int = 1) -> None:
        pass

    def step(self, what: str, batch: bool = False) -> None:
        pass


_INDEX = {name: i for i, name in enumerate(COUNTERS)}
