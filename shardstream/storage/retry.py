"""Reading byte ranges from storage so that a training run survives the real world.

Each read asks for the next block of a range (a ranged GET on S3, its body streamed). A
connection that breaks midway keeps the bytes that arrived and the next request starts at the
exact byte where it broke; a failed request (reset before any data, timeout, throttling answer) is
retried with exponential backoff and jitter, while ``StorageConfig.max_attempts`` and its
``deadline`` allow. The bytes that come out are those of an undisturbed read, none lost, none
repeated. Permanent failures (missing object, access denied, missing credentials, an invalid
request) fail at once with what to check; ``classify.storage_error`` words every failure.

For S3, shardstream's reader turns off botocore's and s3fs's own retries (``StorageConfig.fs_options``,
``fs.retries = 1``), so every retry is counted here (``stats.py``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from shardstream.buffers import uninitialized_bytearray
from shardstream.stats import NullCounters
from shardstream.storage.classify import TRANSIENT, Kind, classify, is_past_end, storage_error
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Fetch(Protocol):
    """Bytes [a, b) of one object, or fewer (a short body); at most ``timeout`` seconds (None: no bound)."""

    def __call__(self, a: int, b: int, timeout: float | None = None) -> bytes: ...


def reader_storage_options(options: Mapping[str, Any] | None, protocol: str,
                           config: StorageConfig = DEFAULT_STORAGE) -> dict[str, Any]:
    """Storage options for reading under ``config`` (kept for callers of the old name)."""
    return config.fs_options(options, protocol)


def backoff(attempt: int, rng: random.Random, config: StorageConfig = DEFAULT_STORAGE) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)]."""
    return rng.uniform(0, min(config.backoff_cap, config.backoff_base * 2**attempt))


class PartialRead(Exception):
    """A read that broke after delivering ``data``: keep it, resume after it."""

    def __init__(self, data: bytes, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.data = data
        self.cause = cause


def s3_fetcher(fs: Any, path: str, chunk_size: int = 1 << 20) -> Fetch:
    """``fetch(a, b)`` for S3 through s3fs's client, streaming the body in ``chunk_size`` pieces so
    that a connection that breaks midway still hands over the pieces that arrived (as PartialRead).
    (64 KiB pieces cost two thirds of the throughput against 1 MiB ones.) A try that outlives
    ``timeout`` is cancelled on the event loop (its connection is closed, not leaked)."""
    import fsspec.asyn

    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}

    async def get(a: int, b: int, out: bytearray, got: list[int]) -> None:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={a}-{b - 1}", **extra)
        body = resp["Body"]
        view = memoryview(out)
        try:
            while got[0] < b - a:
                n = await body.readinto(view[got[0] : got[0] + chunk_size])
                if not n:
                    break
                got[0] += n
        finally:
            view.release()
            body.close()

    async def get_bounded(a: int, b: int, out: bytearray, got: list[int], timeout: float | None) -> None:
        if timeout is None:
            await get(a, b, out, got)
            return
        try:
            await asyncio.wait_for(get(a, b, out, got), timeout)
        except TimeoutError as exc:
            if exc.args:  # botocore/aiohttp's own read or connect timeout
                raise
            raise TimeoutError(f"the request's deadline ran out ({timeout:.1f} s left for this try)") from None

    def fetch(a: int, b: int, timeout: float | None = None) -> bytes:
        # The body is read into one buffer of the range's size: appending to a growing bytearray
        # copied the block again at each of its reallocations (about 1/8 growth each).
        out = uninitialized_bytearray(b - a)  # every byte is written by the GET (or cut off below)
        got = [0]
        try:
            fsspec.asyn.sync(fs.loop, get_bounded, a, b, out, got, timeout)
        except Exception as exc:  # classified by the caller; the bytes that arrived are kept
            if got[0] and classify(exc) in TRANSIENT:
                raise PartialRead(bytes(out[: got[0]]), exc) from exc
            raise
        if got[0] < b - a:  # the object ended early (the caller reports a short read)
            del out[got[0] :]
        return out  # a bytearray: no extra copy of a large block

    return fetch


def fs_fetcher(fs: Any, path: str) -> Fetch:
    """``fetch(a, b)`` for any other fsspec filesystem (its own timeouts apply)."""

    def fetch(a: int, b: int, timeout: float | None = None) -> bytes:
        return fs.cat_file(path, start=a, end=b)

    return fetch


class _Attempts:
    """One request's tries: counts them, sleeps the backoff, and decides when to give up.

    The time an error reports (``waited``, "after 8 tries in 7.5 s") is the wall time from
    ``began`` to the moment of giving up: every try (connects, timeouts, bodies), every sleep, and,
    when the caller passes ``began`` (``storage.ranges``), what it did for the request before the
    first try (making the filesystem and its session)."""

    def __init__(self, url: str, config: StorageConfig, rng: random.Random, counters: Any, sleep, hint: str,
                 fs: Any = None, path: str | None = None, began: float | None = None):
        self.url, self.config, self.rng, self.counters, self.sleep, self.hint = url, config, rng, counters, sleep, hint
        self.fs, self.path = fs, path
        self.began = time.monotonic() if began is None else began
        self.attempt = 0

    def remaining(self) -> float:
        return max(0.001, self.config.deadline - (time.monotonic() - self.began))

    def failed(self, exc: Exception, *, resumed: bool = False) -> None:
        """Sleep before the next try, or raise the error the failure means."""
        kind = classify(exc)
        if kind is None:
            raise exc  # not a storage failure: a bug, shown with its own traceback
        self.attempt += 1
        if kind not in TRANSIENT:
            raise storage_error(self.url, exc, attempts=self.attempt, waited=time.monotonic() - self.began,
                                hint=self.hint, fs=self.fs, path=self.path) from exc
        delay = backoff(self.attempt, self.rng, self.config)
        if self.attempt >= self.config.max_attempts or time.monotonic() - self.began + delay >= self.config.deadline:
            raise storage_error(self.url, exc, attempts=self.attempt, waited=time.monotonic() - self.began,
                                hint=self.hint) from exc
        self.counters.add("retries")
        if resumed:
            self.counters.add("resumes")
        if kind is Kind.THROTTLED:
            self.counters.add("throttles")
        logger.debug("%s: try %d failed (%s), retrying in %.2fs", self.url, self.attempt, exc, delay)
        self.sleep(delay)


def call(url: str, fn: Callable[[], T], *, config: StorageConfig = DEFAULT_STORAGE, counters: Any = None,
         sleep: Callable[[float], None] = time.sleep, hint: str = "", fs: Any = None, path: str | None = None,
         began: float | None = None) -> T:
    """Run one storage call (a HEAD, a listing, an upload) under the retry policy; ``fs``/``path``
    let a bare 403 be asked again for its reason; ``began`` (``time.monotonic()``): when the
    request started, if before this call (the time an error reports counts from there)."""
    attempts = _Attempts(url, config, random.Random(f"call:{url}"), counters or NullCounters(), sleep, hint, fs, path,
                         began)
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified: bugs are re-raised untouched
            attempts.failed(exc)


def make_range_reader(
    fetch: Fetch,
    *,
    url: str,
    start: int,
    end: int,
    counters: Any = None,
    config: StorageConfig = DEFAULT_STORAGE,
    sleep: Callable[[float], None] = time.sleep,
    seed: int = 0,
    hint: str = "",
    short_object_ends: bool = False,
) -> Callable[[int], bytes]:
    """``read(n)`` over bytes [start, end) given ``fetch(a, b)`` -> bytes [a, b) (maybe fewer).

    ``short_object_ends``: the range was promised (by a manifest, or a HEAD's size), so an HTTP 416
    (the read starts at or past the object's end) ends the stream, as a short local file does: the
    caller reports a truncated object, not an invalid request."""
    counters = counters or NullCounters()
    rng = random.Random(f"backoff:{url}:{start}:{seed}")
    pos = start

    def read(n: int) -> bytes:
        nonlocal pos
        stop = min(end, pos + n)
        if stop <= pos:
            return b""
        attempts = _Attempts(url, config, rng, counters, sleep, hint)
        while True:
            began = time.perf_counter()
            try:
                data = fetch(pos, stop, attempts.remaining())
                if not data:
                    raise EOFError(f"empty body for bytes {pos}-{stop}")
            except PartialRead as partial:  # keep what arrived; the next read resumes right after it
                data = partial.data
                counters.add("retries")
                counters.add("resumes")
                if classify(partial.cause) is Kind.THROTTLED:
                    counters.add("throttles")
                logger.debug("%s: connection broke at byte %d, resuming there: %s", url, pos + len(data), partial.cause)
            except Exception as exc:  # noqa: BLE001 - classified: permanent ones raised at once, bugs untouched
                counters.add("storage_wait_us", int((time.perf_counter() - began) * 1e6))
                if short_object_ends and is_past_end(exc):
                    logger.debug("%s: the object ends before byte %d (HTTP 416): end of stream", url, pos)
                    return b""
                attempts.failed(exc, resumed=pos > start)
                continue
            counters.add("storage_wait_us", int((time.perf_counter() - began) * 1e6))
            counters.add("bytes_read", len(data))
            pos += len(data)  # a short body is not an error: the next read resumes from here
            return data

    return read
