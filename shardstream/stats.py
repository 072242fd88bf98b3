"""Stream counters: per DataLoader worker, in shared memory, summed on the rank.

Each worker adds to its own row of a shared array (no locks: one writer per row), so the
training loop can read totals for the whole rank at any time with ``dataset.stats()``.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

COUNTERS = (
    "bytes_read",       # bytes received from storage
    "ranges_opened",    # shard ranges started
    "retries",          # storage reads retried after a transient failure
    "resumes",          # of those, reads resumed mid-range (from the exact byte reached)
    "throttles",        # of those, throttling answers (503 SlowDown, 429)
    "storage_wait_us",  # time spent waiting on storage reads
    "samples_skipped",  # samples left out under on_error="skip"
    "samples_filtered",  # samples the transform dropped (returned None)
    "cache_hits",       # shard ranges served from the local cache
    "cache_misses",     # shards downloaded into the cache
    "cache_bypass",     # reads that skipped a full cache (every cached shard in use)
    "shards_verified",  # whole shards hashed while streaming (verify_stream) and found intact
    "checksum_failures",  # shards whose bytes did not match the manifest's sha256
)
MAX_SLOTS = 256  # DataLoader workers per rank that get their own row


class StreamStats:
    def __init__(self) -> None:
        self._array: Any = multiprocessing.RawArray("q", MAX_SLOTS * len(COUNTERS))

    def counters(self, worker: int) -> WorkerCounters:
        return WorkerCounters(self._array, worker % MAX_SLOTS)

    def totals(self) -> dict[str, int]:
        width = len(COUNTERS)
        values = list(self._array)
        return {name: sum(values[i::width]) for i, name in enumerate(COUNTERS)}

    def __getstate__(self):
        if multiprocessing.context.get_spawning_popen() is None:
            return {"_array": list(self._array)}  # a plain copy: counts no longer shared
        return {"_array": self._array}


class WorkerCounters:
    __slots__ = ("_array", "_base")

    def __init__(self, array: Any, slot: int):
        self._array = array
        self._base = slot * len(COUNTERS)

    def add(self, name: str, value: int = 1) -> None:
        self._array[self._base + _INDEX[name]] += value


class NullCounters:
    def add(self, name: str, value: int = 1) -> None:
        pass


_INDEX = {name: i for i, name in enumerate(COUNTERS)}
