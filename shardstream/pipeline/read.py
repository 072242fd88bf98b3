"""Read planned shard ranges as samples: byte ranges from the manifest's offsets, parsed as tar.

A range [start, stop) of a shard is bytes [offsets[start], offsets[stop]) of its object (the
manifest's span for a whole shard, else from its offset sidecar, ``Manifest.byte_range``): one
sequential read (a ranged GET on S3) in large blocks, parsed by ``tarformat``, or, for a shard
``shardstream index`` gave a member sidecar (``format/members.py``), sliced at its members'
offsets with no header parsed (every header still checked against its fingerprint). The number of
samples a range yields is checked against the manifest, so a manifest that lies is an error,
not silently lost or repeated data.

Record shape out: lists (one per read block) of ``{"__key__": str, "__url__": str, ext: bytes, ...}``.
Stages after this one pass lists of samples along, so per-sample work is a loop body, not a
generator hop per stage.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any

from shardstream.buffers import BufferPool
from shardstream.errors import ChecksumError, ShardFormatError, StorageError
from shardstream.format.compression import decompressing, shard_compression
from shardstream.format.manifest import Manifest
from shardstream.format.members import iter_member_dicts
from shardstream.format.scan import hashed, skip_exactly
from shardstream.format.tar import DEFAULT_READ_SIZE, iter_sample_dicts
from shardstream.plan.epoch import Range
from shardstream.plan.topology import get_worker_info
from shardstream.policy import ErrorPolicy
from shardstream.storage.cache import ShardCache
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.ranges import FileReader
from shardstream.storage.ranges import open_range as open_object_range
from shardstream.storage.readahead import Budget, PlannedSequence, Prefetcher

logger = logging.getLogger(__name__)

# A range's first read is this small and the next ones double up to read_size, so the first
# samples (and the first batch) are parsed out of a few hundred KiB rather than a full block.
FIRST_READ = 256 << 10
# A local file (or a cached shard) is read this much at a time, whatever read_size says: its reads
# cost no request, and a block this size stays in the CPU's caches while it is parsed and its
# samples are used (format.tar.PARSE_WINDOW has the figures).
LOCAL_READ = 512 << 10


def _is_local(url: str) -> bool:
    """A path or ``file://`` URL: read with no request."""
    return "://" not in url or url.startswith("file://")


def open_range(
    url: str,
    start: int,
    end: int,
    storage_options: Mapping[str, Any] | None = None,
    counters: Any = None,
    *,
    config: StorageConfig = DEFAULT_STORAGE,
    cache: ShardCache | None = None,
    shard_size: int | None = None,
    sha256: str | None = None,
) -> tuple[Callable[[int], bytes], Callable[[], None]]:
    """Return ``(read, close)`` for bytes [start, end) of a shard (``storage.ranges.open_range``:
    retry, resume, cache). For a compressed shard, [start, end) are offsets in its decompressed
    stream: the object is read from its first byte (``shard_size`` bytes) and decompressed, and
    the bytes before ``start`` are dropped."""
    compression = shard_compression(url)
    if not compression:
        return open_object_range(url, start, end, storage_options, counters, config=config, cache=cache, shard_size=shard_size, sha256=sha256)
    if shard_size is None and not _is_local(url):
        raise ValueError(f"{url}: reading a compressed remote shard needs its size (shard_size)")
    raw_read, close = open_object_range(
        url,
        0,
        shard_size if shard_size is not None else end,
        storage_options,
        counters,
        config=config,
        cache=cache,
        shard_size=shard_size,
        sha256=sha256,
    )
    try:
        return decompressing(raw_read, url, compression, skip=start), close
    except BaseException:
        close()
        raise


class RangeSource:
    """Where a worker's ranges come from: storage options, counters, cache, read sizes, whether
    whole-shard ranges are hashed as they stream (``verify_stream``), and the extensions whose
    large members may stay writable buffers (``keep_buffers``: decoders that view them in place)."""

    def __init__(
        self,
        manifest: Manifest,
        *,
        storage_options: Mapping[str, Any] | None = None,
        read_size: int = DEFAULT_READ_SIZE,
        counters: Any = None,
        cache: ShardCache | None = None,
        readahead_bytes: int = 0,
        verify_stream: bool = False,
        config: StorageConfig = DEFAULT_STORAGE,
        keep_buffers: Container[str] = (),
        buffers: BufferPool | None = None,
        readahead_threads: int = 1,
        budget: Budget | None = None,
    ):
        self.manifest = manifest
        self.budget = budget  # the worker's read-ahead budget, shared with its other sources (else one per read)
        self.readahead_threads = readahead_threads
        self.keep_buffers = keep_buffers
        self.buffers = buffers
        self.config = config
        self.storage_options = storage_options
        self.read_size = read_size
        self.counters = counters
        self.cache = cache
        self.readahead_bytes = readahead_bytes
        self.verify_stream = verify_stream

    def verifies(self, rng: Range) -> bool:
        """A range is hashed while streaming when it is the whole shard, the manifest has its
        sha256, and no cache is in the way (cache fills are checked on their own)."""
        m = self.manifest
        return (
            self.verify_stream
            and self.cache is None
            and bool(m._has_sha[rng.shard])
            and rng.start == 0
            and rng.stop == int(m.counts[rng.shard])
            and not shard_compression(m.paths[rng.shard])
        )

    def opener(self, rng: Range):
        """A function that opens the range; a range inside a shard fetches the shard's offset
        sidecar when called (once per process, cached), not when planned."""
        m = self.manifest
        url = m.shard_url(rng.shard)
        size, sha = int(m.sizes[rng.shard]), m.sha256(rng.shard)

        def open_it():
            if self.verifies(rng):  # every byte of the object, so the hash covers the file
                start, end = 0, size
            else:
                start, end = m.byte_range(rng.shard, rng.start, rng.stop, self.storage_options, config=self.config, counters=self.counters)
            return open_range(url, start, end, self.storage_options, self.counters, config=self.config, cache=self.cache, shard_size=size, sha256=sha)

        return open_it


def read_range(
    manifest: Manifest,
    rng: Range,
    *,
    storage_options: Mapping[str, Any] | None = None,
    read_size: int = DEFAULT_READ_SIZE,
    counters: Any = None,
    read: Callable[[int], bytes] | None = None,
    verify: bool = False,
    keep_buffers: Container[str] = (),
    buffers: BufferPool | None = None,
    config: StorageConfig = DEFAULT_STORAGE,
) -> Iterator[list[dict[str, Any]]]:
    """Yield the samples of one planned range, a list per read block; the count is checked
    against the manifest. ``read`` supplies the range's bytes (read-ahead); else it is opened.

    With ``verify`` the range must be the whole shard and ``read`` must give the whole object
    (bytes [0, size)): every byte is hashed, and after the last sample the rest of the object is
    read and the sha256 compared with the manifest's. A mismatch raises ChecksumError once the
    shard's samples have been handed on: streaming cannot take them back (a cache fill, checked
    before use, can).

    Large members (``format.tar.LARGE_MEMBER``) are read into buffers of their own (from
    ``buffers``, a pass's pool, when given); those of the extensions in ``keep_buffers`` stay
    writable memoryviews for decoders that view them in place, all others are ``bytes`` (in a
    DataLoader worker that hands its samples over as stored, ``WorkerInfo.as_stored``, those
    read on their own are ``format.tar.Unjoined``: joined by the hand-off into its segment). Storage
    (the offset sidecar a range inside a shard needs; the range, if ``read`` is not given) is read
    under ``config``."""
    shard = manifest.shards[rng.shard]
    url = manifest.shard_url(rng.shard)
    if rng.stop > shard.samples or rng.start < 0 or rng.start >= rng.stop:
        raise ValueError(f"range {rng} outside shard {url} of {shard.samples} samples")
    start, end = manifest.byte_range(rng.shard, rng.start, rng.stop, storage_options, config=config, counters=counters)
    if verify and shard_compression(url):
        raise ValueError(f"verify while streaming does not cover compressed shards ({url}): use `shardstream verify`")
    if verify and not (rng.start == 0 and rng.stop == shard.samples and shard.sha256):
        raise ValueError(f"verify needs a whole-shard range with a sha256 in the manifest, got {rng} of {url}")
    close = None
    if read is None:
        first, last = (0, shard.bytes) if verify else (start, end)
        read, close = open_range(url, first, last, storage_options, counters, config=config, shard_size=shard.bytes)
    local = isinstance(read, FileReader)
    if local:
        read_size = min(read_size, LOCAL_READ)
    digest = None
    if verify:
        digest = hashlib.sha256()
        read = hashed(read, digest)
        skip_exactly(read, start, url, 0)  # bytes before the first sample (directory entries in others' tars)
    expected = len(rng)
    got = 0
    # A shard with a member sidecar (pack's, or ``shardstream index``'s) is sliced at its members'
    # offsets, not parsed (every member's header still checked against its fingerprint): its
    # sidecar is read once per process (a range inside the shard reads it in place of the offset
    # sidecar). Verify parses every header as well.
    sliced = not verify
    table = manifest.member_table(rng.shard, storage_options, config=config, counters=counters) if sliced else None
    if table is not None:
        if counters is not None:
            counters.add("ranges_sliced")
        chunks = iter_member_dicts(_FirstReadsSmall(read), table, rng.start, rng.stop, url=url, read_size=read_size, reuse_blocks=local)
    else:
        chunks = iter_sample_dicts(
            _FirstReadsSmall(read),
            url=url,
            start=start,
            end=end,
            read_size=read_size,
            keep_buffers=keep_buffers,
            buffers=buffers,
            reuse_blocks=local and not verify,
            join_later=getattr(get_worker_info(), "as_stored", False),
        )
    try:
        for samples in chunks:
            got += len(samples)
            if got > expected:
                break
            yield samples
    finally:
        if close is not None:
            close()
    if got != expected:
        raise ShardFormatError(url, start, f"the manifest lists {expected} samples in bytes [{start}, {end}) but the shard holds {got} there")
    if digest is not None:
        skip_exactly(read, shard.bytes - end, url, end)  # the end-of-archive blocks and padding
        if digest.hexdigest() != shard.sha256:
            if counters is not None:
                counters.add("checksum_failures")
            raise ChecksumError(url, digest.hexdigest(), str(shard.sha256))
        if counters is not None:
            counters.add("shards_verified")


class _FirstReadsSmall:
    """Reads of at most FIRST_READ, doubling each time, until they reach what the parser asks for.
    ``readinto`` (large members filled in place) and ``pieces`` (a large member's rest as the
    read-ahead's pieces, joined once by the parser) pass straight through when the stream has them."""

    __slots__ = ("_read", "_cap", "readinto", "pieces")

    def __init__(self, read: Callable[[int], bytes]):
        self._read = read
        self._cap = FIRST_READ
        for name in ("readinto", "pieces"):
            method = getattr(read, name, None)
            if method is not None:
                setattr(self, name, method)

    def __call__(self, n: int) -> bytes:
        if n <= self._cap:
            return self._read(n)
        self._cap *= 2
        return self._read(self._cap // 2)


class PlannedReads(PlannedSequence[Range]):
    """One source's read-ahead over a whole pass (``PlannedSequence``): one Prefetcher over its
    planned ranges of every window, in order (the shuffle and the mix see windows; storage sees
    one sequence of ranges). Its bytes count against ``source.budget``, shared by the worker's
    sources. ``read_ranges`` takes each window's ranges from it in turn."""

    noun = "range"

    def __init__(self, source: RangeSource, ranges: Sequence[Range]):
        ranges = list(ranges)
        prefetcher = None
        if source.readahead_bytes > 0 and ranges:
            prefetcher = Prefetcher(
                [source.opener(r) for r in ranges],
                block_size=source.read_size,
                max_bytes=source.readahead_bytes,
                budget=source.budget,
                threads=source.readahead_threads,
            )
        super().__init__(ranges, prefetcher)


def read_ranges(
    source: RangeSource, ranges: Sequence[Range], *, policy: ErrorPolicy | None = None, planned: PlannedReads | None = None
) -> Iterator[list[dict[str, Any]]]:
    """Samples of several ranges in order, as lists (one per read block).

    With ``source.readahead_bytes`` background threads fetch ahead, across range boundaries (in
    ``source.budget``, when given); with ``planned`` (a pass's ``PlannedReads``, whose next
    ranges these must be) its Prefetcher does, which runs on into the ranges after these.
    A broken range (missing shard, truncated or corrupt bytes, a manifest that lies) goes to
    ``policy``: raised, or its remaining samples skipped and counted.
    """
    ranges = list(ranges)
    prefetcher, base, own = None, 0, False
    if planned is not None:
        base = planned.take(ranges)
        prefetcher = planned.prefetcher
    elif source.readahead_bytes > 0 and ranges:
        prefetcher, own = (
            Prefetcher(
                [source.opener(r) for r in ranges],
                block_size=source.read_size,
                max_bytes=source.readahead_bytes,
                budget=source.budget,
                threads=source.readahead_threads,
            ),
            True,
        )
    try:
        for index, rng in enumerate(ranges):
            delivered = 0
            if source.counters is not None:  # the watchdog's view of this worker (stats.py)
                source.counters.step(f"reading samples {rng.start}-{rng.stop} of {source.manifest.shard_url(rng.shard)}")
            try:
                if prefetcher is not None:
                    read, close = prefetcher.reader(base + index), None
                else:
                    read, close = source.opener(rng)()
                try:
                    for chunk in read_range(
                        source.manifest,
                        rng,
                        read_size=source.read_size,
                        read=read,
                        storage_options=source.storage_options,
                        verify=source.verifies(rng),
                        counters=source.counters,
                        keep_buffers=source.keep_buffers,
                        buffers=source.buffers,
                        config=source.config,
                    ):
                        delivered += len(chunk)
                        yield chunk
                        if policy is not None:
                            policy.ok()
                finally:
                    if close is not None:
                        close()
            except ChecksumError as exc:
                if policy is None:
                    raise
                policy.failed(exc, lost=0)  # its samples were delivered; under "skip" this is logged and counted
            except (ShardFormatError, StorageError) as exc:
                if policy is None:
                    raise
                policy.failed(exc, lost=max(1, len(rng) - delivered))
    finally:
        if own and prefetcher is not None:
            prefetcher.close()


SHORT_RANGE = 8  # samples: ranges this short are latency-bound, not bandwidth-bound
READ_BACK_THREADS = 16


def read_scattered(
    source: RangeSource, ranges: Sequence[Range], *, policy: ErrorPolicy | None = None, threads: int = READ_BACK_THREADS
) -> Iterator[list[dict[str, Any]]]:
    """Like ``read_ranges`` (same order, same checks), but runs of short ranges are fetched by a
    pool of threads: a resumed epoch reads each worker's shuffle buffer back as single samples
    scattered over the shards, where one request after another would cost a round trip each."""
    from concurrent.futures import ThreadPoolExecutor

    ranges = list(ranges)
    single = copy.copy(source)
    single.readahead_bytes = 0  # each short range is one small request; no read-ahead thread per range

    def fetch(rng: Range) -> list[list[dict[str, Any]]]:
        return list(read_ranges(single, [rng], policy=policy))

    with ThreadPoolExecutor(threads, thread_name_prefix="shardstream-readback") as pool:
        i = 0
        while i < len(ranges):
            short = len(ranges[i]) <= SHORT_RANGE
            j = i
            while j < len(ranges) and (len(ranges[j]) <= SHORT_RANGE) == short:
                j += 1
            if short:
                for chunks in pool.map(fetch, ranges[i:j]):
                    yield from chunks
            else:
                yield from read_ranges(source, ranges[i:j], policy=policy)
            i = j
