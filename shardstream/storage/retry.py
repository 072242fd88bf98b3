"""Reading byte ranges from storage so that a training run survives the real world.

Each read asks for the next block of a range (a ranged GET on S3, its body streamed). A
connection that breaks midway keeps the bytes that arrived and the next request starts at the
exact byte where it broke; a failed request (reset before any data, timeout, throttling answer) is
retried with exponential backoff and jitter, a bounded number of times. The bytes that come out
are those of an undisturbed read, none lost, none repeated. Permanent failures (missing object, access
denied, missing credentials) fail at once with what to check.

For S3, shardstream's reader turns off botocore's own retries unless the user set them and makes
s3fs try once (on the filesystem instance made for reading), so every retry is counted here
(``stats.py``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from shardstream.errors import StorageError
from shardstream.stats import NullCounters
from shardstream.storage.classify import is_permanent, is_throttle, is_transient, permanent_error

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 8
BACKOFF_BASE = 0.05
BACKOFF_CAP = 5.0
def reader_storage_options(options: Mapping[str, Any] | None, protocol: str) -> dict[str, Any]:
    """Storage options for reading: s3fs/botocore retries off (ours count them), bounded timeouts."""
    merged = dict(options or {})
    if protocol in ("s3", "s3a"):
        config = dict(merged.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})  # one try: ours count
        config.setdefault("connect_timeout", 10)
        config.setdefault("read_timeout", 60)
        merged["config_kwargs"] = config
    return merged


def backoff(attempt: int, rng: random.Random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)]."""
    return rng.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt))


class PartialRead(Exception):
    """A read that broke after delivering ``data``: keep it, resume after it."""

    def __init__(self, data: bytes, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.data = data
        self.cause = cause


def s3_fetcher(fs: Any, path: str, chunk_size: int = 1 << 20) -> Callable[[int, int], bytes]:
    """``fetch(a, b)`` for S3 through s3fs's client, streaming the body in ``chunk_size`` pieces so
    that a connection that breaks midway still hands over the pieces that arrived (as PartialRead).
    (64 KiB pieces cost two thirds of the throughput against 1 MiB ones.)"""
    import fsspec.asyn

    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}

    async def get(a: int, b: int, out: bytearray) -> None:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={a}-{b - 1}", **extra)
        body = resp["Body"]
        try:
            while len(out) < b - a:
                chunk = await body.read(chunk_size)
                if not chunk:
                    break
                out += chunk
        finally:
            body.close()

    def fetch(a: int, b: int) -> bytes:
        out = bytearray()
        try:
            fsspec.asyn.sync(fs.loop, get, a, b, out)
        except Exception as exc:  # classified by the caller; the bytes that arrived are kept
            if out and not is_permanent(exc):
                raise PartialRead(bytes(out[: b - a]), exc) from exc
            raise
        if len(out) > b - a:
            del out[b - a :]
        return out  # a bytearray: no extra copy of a large block

    return fetch


def make_range_reader(
    fetch: Callable[[int, int], bytes],
    *,
    url: str,
    start: int,
    end: int,
    counters: Any = None,
    max_attempts: int = MAX_ATTEMPTS,
    sleep: Callable[[float], None] = time.sleep,
    seed: int = 0,
) -> Callable[[int], bytes]:
    """``read(n)`` over bytes [start, end) given ``fetch(a, b)`` -> bytes [a, b) (maybe fewer)."""
    counters = counters or NullCounters()
    rng = random.Random(f"backoff:{url}:{start}:{seed}")
    pos = start

    def read(n: int) -> bytes:
        nonlocal pos
        stop = min(end, pos + n)
        if stop <= pos:
            return b""
        attempt = 0
        while True:
            began = time.perf_counter()
            try:
                data = fetch(pos, stop)
                if not data:
                    raise EOFError(f"empty body for bytes {pos}-{stop}")
            except PartialRead as partial:  # keep what arrived; the next read resumes right after it
                data = partial.data
                counters.add("retries")
                counters.add("resumes")
                if is_throttle(partial.cause):
                    counters.add("throttles")
                logger.debug("%s: connection broke at byte %d, resuming there: %s", url, pos + len(data), partial.cause)
            except Exception as exc:  # classified below: permanent ones re-raised at once
                counters.add("storage_wait_us", int((time.perf_counter() - began) * 1e6))
                if is_permanent(exc):
                    raise permanent_error(url, exc) from exc
                if not is_transient(exc):
                    raise
                attempt += 1
                if attempt >= max_attempts:
                    raise StorageError(
                        f"{url}: reading bytes from {pos} failed {attempt} times, last: {type(exc).__name__}: {exc} "
                        "(check the endpoint and the network)"
                    ) from exc
                counters.add("retries")
                if pos > start:
                    counters.add("resumes")
                if is_throttle(exc):
                    counters.add("throttles")
                delay = backoff(attempt, rng)
                logger.debug("%s: retrying bytes %d-%d in %.2fs after %s", url, pos, stop, delay, exc)
                sleep(delay)
                continue
            counters.add("storage_wait_us", int((time.perf_counter() - began) * 1e6))
            counters.add("bytes_read", len(data))
            pos += len(data)  # a short body is not an error: the next read resumes from here
            return data

    return read
