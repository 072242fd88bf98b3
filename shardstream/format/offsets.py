"""Offset sidecars: where each sample of a shard starts, in a small binary file next to the shard.

A version-2 manifest keeps one line per shard; the per-sample byte offsets live in one sidecar
per shard (``shard-000000.tar.idx``), fetched only when a read starts or ends inside a shard.
Layout (all little-endian):

    bytes 0..8     magic ``b"SSOFFS\\x00\\x01"`` (format 1)
    bytes 8..16    uint64 sample count n
    bytes 16..     n + 1 uint64 offsets: each sample's first tar header, then where the last
                   sample's data ends

So a sidecar is exactly ``16 + 8 * (n + 1)`` bytes. Fetched sidecars are kept in a bounded,
least-recently-used cache per process (``OFFSET_CACHE``), so a worker that starts and ends its
slice inside the same shards reads each sidecar once.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

from shardstream.errors import ManifestError
from shardstream.sidecar import HEADER as HEADER
from shardstream.sidecar import MAGIC as MAGIC
from shardstream.sidecar import SUFFIX as SUFFIX

DEFAULT_CACHE_BYTES = 64 << 20


def sidecar_size(samples: int) -> int:
    return HEADER.size + 8 * (samples + 1)


def encode_offsets(offsets: Sequence[int] | np.ndarray) -> bytes:
    """The sidecar bytes for ``samples + 1`` offsets."""
    arr = np.asarray(offsets, dtype="<u8")
    if arr.ndim != 1 or len(arr) < 1:
        raise ValueError("offsets need samples + 1 >= 1 entries")
    return HEADER.pack(MAGIC, len(arr) - 1) + arr.tobytes()


def check_offsets(offsets: np.ndarray, samples: int, size: int) -> str | None:
    """What is wrong with ``offsets`` for a shard of ``samples`` samples and ``size`` bytes, or None.

    Offsets are byte positions: each must lie in [0, size]. They are compared as what they are
    (unsigned in a sidecar): 2**64 - 512 read as a signed int64 is -512, which the order and the
    end checks alone let through to a seek (EINVAL) or a GET's Range header (HTTP 416)."""
    if len(offsets) != samples + 1:
        return f"holds {len(offsets) - 1} sample offsets, the manifest says {samples} samples"
    outside = _outside(offsets, size)
    if outside is not None:
        index, value = outside
        what = "the end of the last sample" if index == samples else f"offset of sample #{index}"
        return f"{what} is byte {value}, outside the shard's {size} bytes (past the shard's end)"
    if samples and not bool(np.all(offsets[1:] > offsets[:-1])):
        bad = int(np.argmin(offsets[1:] > offsets[:-1]))
        return f"offsets are not strictly increasing (sample #{bad + 1} starts at {int(offsets[bad + 1])})"
    return None


def _outside(offsets: np.ndarray, size: int) -> tuple[int, int] | None:
    """(index, value) of the first offset outside [0, size], compared without sign loss (an
    unsigned array as unsigned, a signed one as signed), or None."""
    if not len(offsets):
        return None
    if offsets.dtype.kind == "u":
        bad = offsets > np.uint64(max(size, 0))
    else:
        bad = (offsets < 0) | (offsets > size)
    if not bool(bad.any()):
        return None
    index = int(np.argmax(bad))
    return index, int(offsets[index])


def decode_offsets(data: bytes, url: str, samples: int, size: int) -> np.ndarray:
    """Parse and check a sidecar (``url`` names it in errors); int64 array of samples + 1 offsets."""
    if len(data) < HEADER.size:
        raise ManifestError(f"{url}: offset sidecar is {len(data)} bytes, too short for its header")
    magic, count = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ManifestError(f"{url}: not a shardstream offset sidecar (bad magic {magic!r})")
    if count != samples:
        raise ManifestError(f"{url}: offset sidecar is for {count} samples, the manifest says {samples}; re-run `shardstream index` to rebuild it")
    if len(data) != sidecar_size(samples):
        raise ManifestError(
            f"{url}: offset sidecar is {len(data)} bytes, expected {sidecar_size(samples)} for {samples} samples (truncated or overwritten)"
        )
    raw = np.frombuffer(data, dtype="<u8", offset=HEADER.size)
    problem = check_offsets(raw, samples, size)  # unsigned, as stored: checked before the cast to int64
    if problem is not None:
        raise ManifestError(f"{url}: offset sidecar: {problem}; re-run `shardstream index` to rebuild it")
    return raw.astype(np.int64)  # every value is within [0, size]: no sign to lose


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


T = TypeVar("T", bound=_Sized)


class OffsetCache(Generic[T]):
    """Least-recently-used sidecars of this process, bounded by the bytes they hold (their ``nbytes``).

    Thread-safe (read-ahead opens ranges from a background thread). ``fetches`` counts sidecars
    read from storage, so tests can prove that whole-shard reads need none.
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.fetches = 0
        self._entries: OrderedDict[str, T] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Event] = {}  # keys being loaded now
        if hasattr(os, "register_at_fork"):  # a forked child has no thread that could finish its parent's loads
            forget = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (m := forget()) is not None and m())

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._loading = {}

    def get(self, key: str, load: Callable[[], T]) -> T:
        """The cached sidecar, else ``load()``'s. One load per key at a time: a thread that asks
        while another loads it (the reader and its read-ahead thread both need a range's bytes)
        waits for that load rather than making a second GET; if that load fails, it tries its own."""
        while True:
            with self._lock:
                hit = self._entries.get(key)
                if hit is not None:
                    self._entries.move_to_end(key)
                    return hit
                loading = self._loading.get(key)
                if loading is None:
                    loading = self._loading[key] = threading.Event()
                    break
            loading.wait()
        try:
            value = load()  # outside the lock: a slow GET must not hold up other shards' hits
            with self._lock:
                self.fetches += 1
                if key not in self._entries:
                    self._entries[key] = value
                    self._bytes += value.nbytes
                while self._bytes > self.max_bytes and len(self._entries) > 1:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old.nbytes
        finally:
            with self._lock:
                del self._loading[key]
            loading.set()
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


OFFSET_CACHE: OffsetCache[np.ndarray] = OffsetCache()
