"""The one way shardstream reads an object: "bytes [a, b) of this URL", as ``read(n)`` calls.

Layers, inside out (like fsspec's ``fetcher(start, end)`` under its caches):

    fetch.open(a, b, timeout)     on S3 one GET streamed as a body (``objects.ObjectBody`` through
                                  obstore, ``retry._S3fsBody`` through s3fs where obstore cannot serve);
                                  elsewhere one try: fsspec's ranged cat_file (``retry.fs_opener``)
    RangeReader                   a range's reads: on S3 one GET for all of it, read block by block;
                                  retry with backoff, exact resume after a broken body, deadline
    ShardCache                    optional: whole shards kept on local disk across epochs
    Prefetcher (readahead.py)     optional: the next blocks fetched in a background thread, the
                                  next ranges' GETs sent before this one's last block

Local files skip the network layers: ``read`` is the file's own ``read`` (no per-read overhead),
and opening them goes through the same error translation (``classify.storage_error``).
Whole-object reads (the manifest, scans, verify) use the same layers via ``open_object``; a
small object's first bytes (``read_head``, the manifest's first read) are one ``RangeReader``'s.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import fsspec

from shardstream.errors import ConfigError
from shardstream.stats import NullCounters
from shardstream.storage import fs as storage
from shardstream.storage import objects
from shardstream.storage.cache import ShardCache
from shardstream.storage.classify import classify, storage_error
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.retry import Fetcher, RangeReader, call, fs_opener, s3_opener

DOWNLOAD_BLOCK = 8 << 20  # block size of whole-shard downloads into the cache
FIRST_READ_OBJECT = 8 << 20  # read_object's first request on remote storage
THROUGH_TAIL = 64 << 10  # a range this close to its S3 object's end is fetched to the end
SHARD_HINT = " (it is listed in the manifest: was it deleted or moved?)"

ReadFn = Callable[[int], bytes]  # read(n): the next <= n bytes (not options.Read, the option value)


def resolve(url: str, storage_options: Mapping[str, Any] | None, config: StorageConfig) -> tuple[Any, str, Fetcher | None]:
    """``(fs, path, fetch)`` for a URL under ``config``; ``fetch`` is None for local files. On S3
    ``fs`` is an ``objects.Client`` (obstore) where it can serve the options (``objects.options_for``)
    and this process (``objects.usable_here``), else an s3fs filesystem."""
    protocol = fsspec.utils.get_protocol(url)
    if protocol in ("s3", "s3a") and config.s3_client == "obstore" and objects.usable_here():
        options = objects.options_for(storage_options)
        if options is not None:
            path = url.split("://", 1)[1]
            try:
                client = objects.client_for(path, options, config)
            except Exception as exc:  # no credentials, an unreadable CA bundle: the error tree's words
                if isinstance(exc, ConfigError) or classify(exc) is None:
                    raise
                raise storage_error(url, exc) from exc
            key = objects.key_of(path)
            return client, path, Fetcher("obstore", open_body=functools.partial(client.open, key))
    fs, path = storage.get_fs(url, config.fs_options(storage_options, protocol))
    if storage.is_local(fs):
        return fs, path, None
    if protocol in ("s3", "s3a"):  # (s3fs's instance is keyed by the reader's own options: one try per call, retried in retry.py)
        return fs, path, Fetcher("s3fs", open_body=s3_opener(fs, path))
    return fs, path, Fetcher("fsspec", fs_opener(fs, path))


def ready_for_fork(url: str, storage_options: Mapping[str, Any] | None, config: StorageConfig = DEFAULT_STORAGE) -> None:
    """Before ``fork`` starts processes that read ``url`` (DataLoader workers): make here what they
    would each make at their first read, so they inherit it. That is s3fs's client where they read
    S3 through s3fs (``storage.ready_s3_client``): a child forked after obstore ran here cannot use
    obstore (``objects.usable_here``), and ``s3_client="s3fs"`` or options obstore cannot serve
    take that path too. Anything else: nothing."""
    protocol = fsspec.utils.get_protocol(url)
    if protocol not in ("s3", "s3a"):
        return
    if config.s3_client == "obstore" and objects.options_for(storage_options) is not None and objects.usable_after_fork():
        return  # (they start obstore afresh)
    storage.ready_s3_client(url, config.fs_options(storage_options, protocol))


def _open_local(url: str, path: str, start: int, hint: str):
    try:
        f = open(path, "rb", buffering=0)
    except OSError as exc:
        raise storage_error(url, exc, hint=hint) from exc
    f.seek(start)
    return f


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
    hint: str = SHARD_HINT,
) -> tuple[ReadFn, Callable[[], None]]:
    """Return ``(read, close)`` for bytes [start, end) of ``url``; ``read(n)`` gives the next <= n bytes.

    Local files are read directly; remote objects through the cache when one is given (the
    whole shard is fetched once), else with a ``RangeReader`` (ranged reads with retry and exact
    resume)."""
    counters = counters or NullCounters()
    counters.add("ranges_opened")
    fs, path, fetch = resolve(url, storage_options, config)
    if fetch is None:
        f = _open_local(url, path, start, hint)
        # A raw read(n) allocates n bytes before reading: cap n at the file's real size, so a manifest
        # and a header that lie about sizes end in the parser's ShardFormatError, not a MemoryError.
        return FileReader(f, counters, os.fstat(f.fileno()).st_size), f.close

    if cache is not None and shard_size is not None:

        def download(write: Callable[[bytes], None]) -> None:
            read_all = RangeReader(fetch, url=url, start=0, end=shard_size, counters=counters, config=config, hint=hint)
            try:
                while chunk := read_all(DOWNLOAD_BLOCK):
                    write(chunk)
            finally:
                read_all.close()

        handle = cache.open(url, sha256, shard_size, download, counters)
        if handle is not None:
            f, lock = handle
            f.seek(start)
            return FileReader(f, None, None), lambda: ShardCache.release(f, lock)
    tail = (shard_size or 0) - end
    if not (0 < tail <= THROUGH_TAIL and fetch.streams):
        tail = 0
    # On S3 a whole shard's samples end just before the tar's end-of-archive blocks (``tail``): ask
    # for the object through its end, so the GET is the whole object (a server or cache then serves
    # it as it is; moto copies every range that stops short of the end) and drop those few bytes.
    # A 416 for a range asked here means the object is shorter than the manifest (or its HEAD)
    # said: the stream ends there, as a short local file's does, and the parser reports a truncated
    # shard naming the URL, the byte reached and the end expected, as it does on local disk.
    reader = RangeReader(fetch, url=url, start=start, end=end + tail, counters=counters, config=config, hint=hint)
    return (_EndsBefore(reader, end - start, tail) if tail else reader), reader.close


class _EndsBefore:
    """``read(n)`` over the first ``length`` bytes of a reader that goes ``tail`` bytes further:
    the read that reaches ``length`` asks for the tail too (no request of its own: on S3 the range's
    one GET already runs to the object's end) and the tail is cut off the block it arrives in.
    ``readinto``, ``pieces``, ``remaining`` and ``start`` pass through (``RangeReader``)."""

    __slots__ = ("_read", "_left", "_tail")

    def __init__(self, read: RangeReader, length: int, tail: int):
        self._read, self._left, self._tail = read, length, tail

    def readinto(self, view: memoryview) -> int:
        left = self._left
        if left <= 0:
            return 0
        n = self._read.readinto(view[:left] if len(view) > left else view)
        self._left = left - n
        return n

    def remaining(self) -> int:
        return self._read.remaining()

    def start(self) -> None:
        self._read.start()

    def pieces(self, n: int) -> list:
        """``RangeReader.pieces`` over the first ``length`` bytes: the tail is cut off the pieces."""
        left = self._left
        out: list = []
        for piece in self._read.pieces(n if n < left else left + self._tail) if left > 0 else ():
            out.append(piece if len(piece) <= left else memoryview(piece)[:left])
            left -= len(out[-1])
            if not left:
                break
        self._left = left
        return out

    def __call__(self, n: int) -> bytes:
        left = self._left
        if left <= 0:
            return b""
        data = self._read(n if n < left else left + self._tail)
        if len(data) > left:
            if isinstance(data, bytearray):
                try:
                    del data[left:]  # in place: a few KiB off the end move nothing
                except BufferError:  # a view of the block still alive somewhere: cut a copy
                    data = data[:left]
            else:
                data = data[:left]
        self._left = left - len(data)
        return data


def read_head(
    url: str,
    n: int,
    storage_options: Mapping[str, Any] | None = None,
    *,
    config: StorageConfig = DEFAULT_STORAGE,
    counters: Any = None,
    hint: str = "",
) -> bytes:
    """The first ``n`` bytes of an object, or all of it when it is shorter: one request (a ranged
    GET on S3, no HEAD first) under the retry policy, each try bounded by the deadline's time
    left; a try that breaks midway keeps what arrived and the next asks from the byte reached
    (this is for small objects: offset sidecars, the manifest's first read). Only its retries are
    counted, not as a stream's requests and bytes."""
    fs, path, fetch = resolve(url, storage_options, config)
    if fetch is None:
        with _open_local(url, path, 0, hint) as f:
            return f.read(n)
    reader = RangeReader(fetch, url=url, start=0, end=n, counters=_RetriesOnly(counters), config=config, hint=hint)
    return bytes(_read_whole(reader, reader.close, n, n))


class _RetriesOnly:
    """Counters that pass on retries, resumes, throttles and waits only."""

    def __init__(self, counters: Any):
        self._counters = counters or NullCounters()

    def add(self, name: str, n: int = 1) -> None:
        if name in ("retries", "resumes", "throttles", "storage_wait_us"):
            self._counters.add(name, n)


def _read_whole(read: ReadFn, close: Callable[[], None], size: int, block: int = DOWNLOAD_BLOCK) -> bytes:
    """The next ``size`` bytes of ``read``, or fewer when it ends first, in reads of at most
    ``block`` bytes; then ``close()``."""
    parts = []
    try:
        while size > 0 and (chunk := read(min(size, block))):
            parts.append(chunk)
            size -= len(chunk)
    finally:
        close()
    return parts[0] if len(parts) == 1 else b"".join(parts)


def object_size(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    config: StorageConfig = DEFAULT_STORAGE,
    counters: Any = None,
    hint: str = "",
    began: float | None = None,
) -> int:
    """The object's size in bytes (a HEAD on S3), under the retry policy, each try waited for no
    longer than the deadline's time left (an error's time counts from ``began``, else from this call)."""
    began = time.monotonic() if began is None else began
    fs, path, fetch = resolve(url, storage_options, config)
    if fetch is None:
        try:
            return fs.size(path)
        except OSError as exc:
            raise storage_error(url, exc, hint=hint) from exc
    return call(url, lambda: fs.size(path), config=config, counters=counters, hint=hint, fs=fs, path=path, began=began, bounded=True)


class TooLarge(Exception):
    """``read_object``'s (or ``open_object``'s) object is larger than the limit it was given
    (``size`` bytes, at least)."""

    def __init__(self, url: str, size: int, limit: int):
        super().__init__(f"{url}: {size} bytes, more than the {limit} allowed")
        self.url, self.size, self.limit = url, size, limit


def open_object(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    config: StorageConfig = DEFAULT_STORAGE,
    counters: Any = None,
    hint: str = "",
    began: float | None = None,
    limit: int | None = None,
) -> tuple[int, ReadFn, Callable[[], None]]:
    """``(size, read, close)`` over a whole object, read front to back with retry and resume; an
    object larger than ``limit`` bytes raises ``TooLarge`` once its size is known."""
    size = object_size(url, storage_options, config=config, counters=counters, hint=hint, began=began)
    if limit is not None and size > limit:
        raise TooLarge(url, size, limit)
    read, close = open_range(url, 0, size, storage_options, counters, config=config, hint=hint)
    return size, read, close


def read_object(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    config: StorageConfig = DEFAULT_STORAGE,
    counters: Any = None,
    hint: str = "",
    limit: int | None = None,
) -> bytes:
    """A whole (small) object's bytes, e.g. the manifest. On S3 the first ``FIRST_READ_OBJECT``
    bytes come in one ranged GET with no HEAD first (S3 answers a range past the end with what
    there is: one round trip less before the first batch). An object that fills that read, or on
    other stores any object, is read by its size in blocks. On S3 a connection that breaks midway
    resumes at the byte reached, in either read (on other stores, at the start of its block). An
    object larger than ``limit`` bytes raises ``TooLarge`` once its size is known, before the rest
    of it is read."""
    began = time.monotonic()  # an error's time counts from here: making the filesystem is part of the request
    first = FIRST_READ_OBJECT if limit is None else min(FIRST_READ_OBJECT, limit + 1)
    if url.startswith(("s3://", "s3a://")):
        head = read_head(url, first, storage_options, config=config, counters=counters, hint=hint)
        if len(head) < first:
            return head
        if limit is not None and len(head) > limit:
            raise TooLarge(url, len(head), limit)
        began = time.monotonic()  # a new request: the HEAD of a manifest larger than the first read
    size, read, close = open_object(url, storage_options, config=config, counters=counters, hint=hint, began=began, limit=limit)
    return bytes(_read_whole(read, close, size))


class FileReader:
    """``read(n)`` over an open local file, plus ``readinto(view)`` (the tar parser fills large
    members straight from the file with it: one copy). ``cap`` limits n to the file's real size
    (a raw read(n) allocates n bytes first); reads are counted as ``bytes_read`` when given
    counters."""

    __slots__ = ("_file", "_counters", "_cap")

    def __init__(self, file: Any, counters: Any, cap: int | None):
        self._file = file
        self._counters = counters
        self._cap = cap

    def __call__(self, n: int) -> bytes:
        cap = self._cap
        data = self._file.read(n if cap is None or n <= cap else cap)
        if self._counters is not None:
            self._counters.add("bytes_read", len(data))
        return data

    def readinto(self, view: memoryview) -> int:
        n = self._file.readinto(view) or 0
        if self._counters is not None:
            self._counters.add("bytes_read", n)
        return n
