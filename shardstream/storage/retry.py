"""Reading byte ranges from storage so that a training run survives the real world.

Through obstore (S3, ``objects.py``) a range is one GET: its request asks for the whole range
[start, end), and each read takes the next block of that one body (``Body.readinto`` into the
block the caller gets); a new request is made only to resume after a failure: a connection that
breaks midway keeps the bytes that arrived and the next request starts at the exact byte where it
broke. So it is through s3fs where obstore cannot serve (``_S3fsBody``). fsspec's other stores
(HTTP, the Hub, ...) have no streamed body: each read is one ranged ``cat_file``
(``fs_opener``), and a try that breaks is asked for its whole block again. Either way a failed
request (reset, timeout, throttling answer) is retried with exponential backoff and full jitter
until ``StorageConfig.deadline`` runs out (``max_attempts``, when set, caps the tries too). The
deadline bounds each try as well: a try is given the time left (obstore's timeouts are cut to it,
an async fsspec call is cancelled at it, a HEAD or a listing is waited for no longer: ``call``),
so a stalled answer or body ends at the deadline. The bytes that come out are those of an
undisturbed read, none lost, none repeated; small whole objects (the manifest, offset sidecars:
``ranges.read_head``) resume at the byte reached too. Permanent failures (missing object, access
denied, missing credentials, an invalid request) fail at once with what to check;
``classify.storage_error`` words every failure.

The jitter is drawn from the operating system's randomness (``random.SystemRandom``), so the
DataLoader workers of every rank, throttled together, sleep different delays and come back spread
out rather than in step (it was once seeded by the URL: every worker slept the same delays).

For S3, shardstream's reader turns off obstore's (``objects.py``), and on s3fs's path botocore's and
s3fs's, own retries (``StorageConfig.fs_options``, ``fs.retries = 1``), so every retry is counted
here (``stats.py``).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import fsspec.asyn
import fsspec.exceptions

from shardstream.buffers import uninitialized_bytearray
from shardstream.errors import StorageError
from shardstream.private import s3_call
from shardstream.redact import get_logger
from shardstream.stats import NullCounters
from shardstream.storage.classify import TRANSIENT, Kind, classify, is_past_end, release_frames, storage_error
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig

logger = get_logger(__name__)

T = TypeVar("T")

JITTER = random.SystemRandom()  # os.urandom per draw: different in every process, forked or not
# A try that would start with less of the deadline left than this is not made: it would meet its
# own timeout rather than the store ("no answer within the 0.0 s left"), and the error would no
# longer name what the tries met (a refused connection, a 503).
LAST_TRY = 0.1
# A streamed range's try budget (its deadline, its count of tries, its backoff) starts again only
# after real progress: this many bytes since the last start, or a sixteenth of the range where
# that is less (at least one byte). A server that cuts every answer after a few bytes once started
# the deadline again with every byte: one request after another, no backoff, without end (335,000
# GETs in 30 minutes). Cut before real progress, a try counts as a failed one: backed off, and
# the read fails at the deadline with a StorageUnavailable naming the cuts.
REAL_PROGRESS = 64 << 10
PROGRESS_FRACTION = 16


def real_progress(start: int, end: int) -> int:
    """The bytes a streamed read of [start, end) must receive to start its try budget again."""
    return max(1, min(REAL_PROGRESS, (end - start) // PROGRESS_FRACTION))


def backoff(attempt: int, config: StorageConfig = DEFAULT_STORAGE) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)]."""
    return JITTER.uniform(0, min(config.backoff_cap, config.backoff_base * 2 ** min(attempt, 64)))


class Body(Protocol):
    """One GET's body, streamed. ``readinto(view, timeout)`` puts its next bytes into ``view`` and
    says how many (0: the body is complete), waiting at most ``timeout`` seconds; the request's
    answer (an error status, a refused connection) is raised by the first call. ``close()`` ends
    it (an unfinished body's connection is not reused)."""

    def readinto(self, view: memoryview, timeout: float | None = None) -> int: ...

    def close(self) -> None: ...


class Fetcher:
    """How one object's bytes are read: ``open(a, b, timeout)`` sends a request for bytes [a, b)
    now and returns its ``Body``. ``kind`` names the path. On S3 ("obstore", "s3fs") a range
    streams through one GET: ``open`` returns at once, the answer is read, and any failure raised,
    by the body's first ``readinto`` (``timeout`` bounds the connect). Elsewhere ("fsspec") each
    read is a request of its own: ``open`` is one try at the read's bytes, or fewer when the object
    ends first, of at most ``timeout`` seconds (None: no bound), its body those bytes
    (``fs_opener``)."""

    __slots__ = ("kind", "open", "streams")

    def __init__(self, kind: str, open_body: Callable[..., Body]):
        self.kind, self.open, self.streams = kind, open_body, kind != "fsspec"


class _S3fsBody:
    """A GET through s3fs's client (aiobotocore on fsspec's event loop). The request goes out when
    the body is made, and a task on the loop reads the body as it arrives, at most ``WINDOW`` bytes
    ahead of the consumer; ``readinto`` copies those pieces into the caller's view (aiohttp hands
    over ``bytes``: that copy is the one this path always made). Reading as the bytes arrive keeps
    them when the connection breaks: aiohttp raises a broken body's error before handing over what
    it buffered, so a body read only when the consumer asks lost every byte of a cut it had not
    asked for yet. The error comes after the pieces that arrived first."""

    WINDOW = 4 << 20
    CHUNK = 1 << 20  # the most one read of the body takes

    def __init__(self, fs: Any, params: dict[str, Any]):
        self._loop = fs.loop
        self._cond = threading.Condition()
        self._pieces: deque[memoryview] = deque()
        self._held = 0  # bytes in _pieces
        self._error: BaseException | None = None
        self._ended = False
        self._room: asyncio.Event | None = None  # set by the consumer when the window has room again
        self._task = asyncio.run_coroutine_threadsafe(self._pump(fs, params), self._loop)

    async def _pump(self, fs: Any, params: dict[str, Any]) -> None:
        room = self._room = asyncio.Event()
        body = None
        try:
            resp = await s3_call(fs, "get_object", **params)
            body = resp["Body"]
            while True:
                while True:
                    room.clear()
                    with self._cond:
                        if self._held < self.WINDOW:
                            break
                    await room.wait()
                chunk = await body.read(self.CHUNK)
                with self._cond:
                    if chunk:
                        self._pieces.append(memoryview(chunk))
                        self._held += len(chunk)
                    else:
                        self._ended = True
                    self._cond.notify_all()
                if not chunk:
                    return
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, after the bytes that arrived
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            if body is not None:
                body.close()

    def readinto(self, view: memoryview, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._pieces and self._error is None and not self._ended:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"the request's deadline ran out ({timeout:.1f} s left for this try)")
                self._cond.wait(left)
            got = 0
            pieces = self._pieces
            while pieces and got < len(view):
                piece = pieces[0]
                k = min(len(piece), len(view) - got)
                view[got : got + k] = piece[:k]
                got += k
                if k == len(piece):
                    pieces.popleft()
                else:
                    pieces[0] = piece[k:]
            self._held -= got
            if got:
                if self._room is not None:
                    self._loop.call_soon_threadsafe(self._room.set)
                return got
            if self._error is not None:
                raise self._error
            return 0

    def close(self) -> None:
        self._task.cancel()  # cancels the task on the loop; its body (not read to the end) closes its connection
        with self._cond:
            self._pieces.clear()
            self._held = 0
            # the error raised from here holds, in its traceback, the frame that caught it, which
            # holds this body: kept here, the pair is a cycle holding every caller's frame
            self._error = None


def s3_opener(fs: Any, path: str) -> Callable[..., Body]:
    """``open(a, b, timeout)`` for S3 through s3fs's client: one streamed GET per range."""
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}

    def open_body(a: int, b: int, timeout: float | None = None) -> Body:
        return _S3fsBody(fs, {"Bucket": bucket, "Key": key, "Range": f"bytes={a}-{b - 1}", **extra})

    return open_body


def fs_opener(fs: Any, path: str) -> Callable[..., Body]:
    """``open(a, b, timeout)`` through an fsspec filesystem other than S3's: one ranged
    ``cat_file`` per call (over HTTP one GET, its body read whole: a break loses that try's bytes,
    and the retry asks for the same block again), its bytes the body (``_Fetched``). On an async
    filesystem (HTTP) the try is cancelled, its connection closed, when ``timeout`` runs out
    (fsspec's ``sync`` with a timeout); elsewhere the filesystem's own timeouts apply.

    An HTTP server that ignores Range (``python -m http.server``) answers 200 with the whole
    object, which fsspec hands over as the range's bytes: more bytes than asked fail at once; fewer
    from an offset (an object that ends before the range does, or the whole of a short object) are
    told apart by the object's size (a HEAD, only then): the whole object taken for bytes from the
    offset was a parse of wrong bytes, and a truncated shard's error named a byte it never had."""

    # HfFileSystem reads through a file object: without a cache it asks for exactly [a, b) (its
    # default read-ahead cache would add a 5 MiB block to every read, fetched and dropped)
    protocol = getattr(fs, "protocol", None)
    extra = {"cache_type": "none"} if protocol == "hf" else {}
    bounded = getattr(fs, "async_impl", False)
    http = "http" in (protocol if isinstance(protocol, tuple) else (protocol,))

    def open_body(a: int, b: int, timeout: float | None = None) -> Body:
        if bounded and timeout is not None:
            try:
                data = fsspec.asyn.sync(fs.loop, fs._cat_file, path, start=a, end=b, timeout=timeout)
            except fsspec.exceptions.FSTimeoutError:
                raise TimeoutError(f"the request's deadline ran out ({timeout:.1f} s left for this try)") from None
        else:
            data = fs.cat_file(path, start=a, end=b, **extra)
        n = len(data)
        if n > b - a or (http and 0 < a and n < b - a and n != max(0, fs.size(path) - a)):
            url = fs.unstrip_protocol(path)
            raise StorageError(
                f"{url}: asked for bytes {a}-{b - 1}, the server sent {n} bytes{'' if n > b - a else ', the whole object'}: "
                "it does not support HTTP Range requests (206 Partial Content), which shardstream needs",
                url=url,
            )
        return _Fetched(data)

    return open_body


class _Fetched:
    """A request's bytes fetched whole (``fs_opener``), handed over by the one read that asked for
    them: copied into its view (``readinto``) or as they came (``take``: no copy)."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes):
        self._data = data

    def readinto(self, view: memoryview, timeout: float | None = None) -> int:
        data, self._data = self._data, b""
        view[: len(data)] = data
        return len(data)

    def take(self, n: int, timeout: float | None = None) -> bytes:
        data, self._data = self._data, b""
        return data

    def close(self) -> None:
        self._data = b""


class _Attempts:
    """One request's tries: counts them, sleeps the backoff, and decides when to give up.

    The deadline is the bound: a transient failure is retried, after a full-jitter backoff, while
    the backoff still ends ``LAST_TRY`` before ``config.deadline`` (counted from ``began``); ``remaining()`` is
    what a try may take (its timeouts are cut to it). ``config.max_attempts``, when set, caps
    the tries as well. Throttling answers back off like any other transient failure.

    The time an error reports (``waited``, "after 8 tries in 7.5 s") is the wall time from
    ``began`` to the moment of giving up: every try (connects, timeouts, bodies), every sleep, and,
    when the caller passes ``began`` (``storage.ranges``), what it did for the request before the
    first try (making the filesystem and its session)."""

    def __init__(
        self,
        url: str,
        config: StorageConfig,
        counters: Any,
        sleep,
        hint: str,
        fs: Any = None,
        path: str | None = None,
        began: float | None = None,
    ):
        self.url, self.config, self.counters, self.sleep, self.hint = url, config, counters, sleep, hint
        self.fs, self.path = fs, path
        self.began = time.monotonic() if began is None else began
        self.attempt = 0
        self.resets = 0  # tries cut after some bytes, before real progress (``RangeReader``)
        self.cut_bytes = 0  # the bytes those tries received

    def restart(self) -> None:
        """Real progress: the deadline, the tries and the backoff start again from now."""
        self.began, self.attempt, self.resets, self.cut_bytes = time.monotonic(), 0, 0, 0

    def remaining(self) -> float:
        """Seconds the next try may take: what is left of the deadline (a little at least, so
        that a try still says what it met rather than failing before it starts)."""
        return max(0.001, self.config.deadline - (time.monotonic() - self.began))

    def failed(self, exc: Exception, *, resumed: bool = False) -> None:
        """Sleep before the next try, or raise the error the failure means."""
        kind = classify(exc)
        if kind is None:
            raise exc  # not a storage failure: a bug, shown with its own traceback
        release_frames(exc)  # (raised through fsspec's sync, it holds the callers' frames in a cycle)
        self.attempt += 1
        if kind not in TRANSIENT:
            raise storage_error(
                self.url, exc, attempts=self.attempt, waited=time.monotonic() - self.began, hint=self.hint, fs=self.fs, path=self.path
            ) from exc
        delay = backoff(self.attempt, self.config)
        cap = self.config.max_attempts
        if (cap is not None and self.attempt >= cap) or time.monotonic() - self.began + delay >= self.config.deadline - LAST_TRY:
            raise storage_error(
                self.url,
                exc,
                attempts=self.attempt,
                waited=time.monotonic() - self.began,
                hint=self.hint,
                resets=self.resets,
                cut_bytes=self.cut_bytes,
            ) from exc
        self.counters.add("retries")
        if resumed:
            self.counters.add("resumes")
        if kind is Kind.THROTTLED:
            self.counters.add("throttles")
        logger.debug("%s: try %d failed (%s), retrying in %.2fs", self.url, self.attempt, exc, delay)
        slept = time.perf_counter()
        try:
            self.sleep(delay)
        finally:  # a backoff is a wait on storage as much as a request is (``storage_wait_us``)
            self.counters.add("storage_wait_us", int((time.perf_counter() - slept) * 1e6))


def call(
    url: str,
    fn: Callable[[], T],
    *,
    config: StorageConfig = DEFAULT_STORAGE,
    counters: Any = None,
    hint: str = "",
    fs: Any = None,
    path: str | None = None,
    began: float | None = None,
    bounded: bool = False,
) -> T:
    """Run one storage call under the retry policy; ``fs``/``path`` let a bare 403 be asked again
    for its reason; ``began`` (``time.monotonic()``): when the request started, if before this call
    (the time an error reports counts from there). Each try is bounded by the filesystem's own
    timeouts, which ``StorageConfig.fs_options`` cuts to the deadline. ``bounded`` (a HEAD, a
    listing: a call that cannot be handed the time left as a GET is) also waits for a try no longer
    than the time left, on a thread of its own: a try that outlives the deadline fails with a
    timeout there (its thread ends at those timeouts; a try started late once ran that long past
    the deadline, about twice the deadline in all). Not for a whole file's read, which may take
    longer than the deadline while its bytes keep coming."""
    counters = counters or NullCounters()
    attempts = _Attempts(url, config, counters, time.sleep, hint, fs, path, began)
    while True:
        tried = time.perf_counter()
        try:
            result = _within(fn, attempts.remaining()) if bounded else fn()
        except Exception as exc:  # noqa: BLE001 - classified: bugs are re-raised untouched
            counters.add("storage_wait_us", int((time.perf_counter() - tried) * 1e6))
            attempts.failed(exc)
            continue
        counters.add("storage_wait_us", int((time.perf_counter() - tried) * 1e6))
        return result


def _within(fn: Callable[[], T], timeout: float) -> T:
    """``fn()`` on a daemon thread, waited for at most ``timeout`` seconds (then a TimeoutError)."""
    done: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            done.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.append((False, exc))

    thread = threading.Thread(target=run, name="shardstream-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if not done:
        raise TimeoutError(f"the request's deadline ran out ({timeout:.1f} s left for this try)")
    ok, value = done.pop()  # (kept in ``done``, the error would hold itself: its traceback holds run's frame, run its closure)
    if ok:
        return value
    try:
        raise value
    finally:
        del value  # (a frame that holds the error it raises is a cycle with it)


class RangeReader:
    """``read(n)``: the next <= n bytes of [start, end) of one object, with retry, exact resume and
        the deadline; ``readinto(view)`` the same into the caller's buffer; ``close()`` when done.

        Where ``fetch`` streams (S3), the range is one GET: the first read sends a request for all of
        [start, end) and every read takes its next bytes from that body, straight into the block it
        returns (no copy but the kernel's). A body that breaks keeps what arrived (returned short; the
        next read sends a new request from the byte reached), and a failure before any byte is retried
        under the policy; ``start()`` sends the request before the first read (read-ahead does, for the
        next range, while this one's last blocks arrive). Elsewhere each read is one request, its bytes
        returned as they came. Real progress starts the deadline, the count of tries and the backoff
    afresh: on S3 ``real_progress`` bytes since they last started (a body cut after fewer is a failed
    try, backed off, and counted as a reset in the error that ends the read); elsewhere a read that
    gets its bytes.

        The range is a promised one (by a manifest, or a HEAD's size), so an HTTP 416 (the read starts
        at or past the object's end) ends the stream, as a short local file does, and so does an fsspec
        store's empty answer to a read (its ``cat_file`` past the end): the caller reports a truncated
        object, not an invalid request."""

    def __init__(
        self,
        fetch: Fetcher,
        *,
        url: str,
        start: int,
        end: int,
        counters: Any = None,
        config: StorageConfig = DEFAULT_STORAGE,
        sleep: Callable[[float], None] = time.sleep,
        hint: str = "",
    ):
        self._open, self._streams = fetch.open, fetch.streams
        self._body: Body | None = None
        self._asked = end  # the end of the last request's bytes
        self.url, self.start_at, self.end, self.pos = url, start, end, start
        self._counters = counters or NullCounters()
        self._config, self._sleep, self._hint = config, sleep, hint
        self._takes = fetch.kind == "obstore"  # its bodies have ``take``
        self._tries: _Attempts | None = None  # the try budget, kept across reads until real progress
        self._since = 0  # bytes received since it started
        self._real = real_progress(start, end)

    def remaining(self) -> int:
        """Bytes of the range not yet handed out."""
        return self.end - self.pos

    def start(self) -> None:
        """Send the request for the rest of the range now (streamed stores only); its answer is
        read, and any failure handled, by the next read."""
        if self._streams and self._body is None and self.pos < self.end:
            self._send(self._config.deadline, self.end)

    def close(self) -> None:
        """End the range's request (a body not read to its end closes its connection)."""
        body, self._body = self._body, None
        if body is not None:
            body.close()

    def _send(self, timeout: float, stop: int) -> Body:
        """Send the request for bytes [pos, stop) (streamed: the rest of the range); ``timeout``:
        what the try may take (its connect is cut to it)."""
        self._counters.add("requests")
        self._asked = stop
        self._body = self._open(self.pos, stop, timeout)
        return self._body

    def __call__(self, n: int) -> bytes:
        stop = min(self.end, self.pos + n)
        if stop <= self.pos:
            self.close()
            return b""
        if not self._streams:  # one request per read: its bytes as they came
            block = self._taken(stop - self.pos)
            return block[0] if block else b""
        out = uninitialized_bytearray(stop - self.pos)
        view = memoryview(out)
        try:
            got = self._fill(view)
        finally:
            view.release()
        if got < len(out):
            try:
                del out[got:]  # in place; the object ended early, a break kept what arrived, or the end of the stream
            except BufferError:  # a view of it still alive somewhere (a traceback): copy the part that arrived
                out = out[:got]
        return out  # a bytearray: no extra copy of a large block

    def readinto(self, view: memoryview) -> int:
        """The next bytes of the range into ``view`` (at most its length); 0 at the range's end."""
        stop = min(self.end, self.pos + len(view))
        if stop <= self.pos:
            self.close()
            return 0
        return self._fill(view[: stop - self.pos])

    def pieces(self, n: int) -> list:
        """The next <= n bytes of the range as the pieces its body handed over (``Body.take``: no
        copy, e.g. views of obstore's buffers), or as one block where the body has no ``take``;
        an empty list at the range's end. Retry, resume and the deadline as for ``read``."""
        stop = min(self.end, self.pos + n)
        if stop <= self.pos:
            self.close()
            return []
        if not self._takes:
            block = self(n)
            return [block] if block else []
        return self._taken(stop - self.pos)

    def _taken(self, size: int) -> list:
        """The next ``size`` bytes (or fewer) as the pieces the body hands over (``take``)."""
        out: list = []

        def take(body: Any, want: int, timeout: float | None) -> int:
            piece = body.take(want, timeout)
            if piece:
                out.append(piece)
            return len(piece)

        self._fill(size, take)
        return out

    def _fill(self, want: int | memoryview, take: Callable[[Any, int, float | None], int] | None = None) -> int:
        """Fill the view ``want`` from the range's body (sending a request when none is open), or
        with ``take`` (body, bytes wanted, timeout) -> bytes taken, take up to ``want`` bytes: as
        many as arrive before the body ends or breaks; 0 only at the end of the stream."""
        attempts = self._tries
        if attempts is None or not self._streams:  # (elsewhere each read is a request of its own: its budget starts afresh)
            attempts = self._tries = _Attempts(self.url, self._config, self._counters, self._sleep, self._hint)
        counters = self._counters
        view = want if isinstance(want, memoryview) else None
        size = len(want) if isinstance(want, memoryview) else want
        got = 0
        while True:
            began = time.perf_counter()
            body = self._body
            sent = body is None
            fresh = False  # real progress during this try
            arrived = got
            try:
                if body is None:
                    body = self._send(attempts.remaining(), self.end if self._streams else self.pos + size)
                while got < size:
                    k = body.readinto(view[got:], attempts.remaining()) if view is not None else take(body, size - got, attempts.remaining())  # type: ignore[misc]
                    if not k:
                        break
                    got += k
                    self._since += k
                    if self._since >= self._real:
                        self._since = 0
                        attempts.restart()
                        fresh = True
            except Exception as exc:  # noqa: BLE001 - classified: permanent ones raised at once, bugs untouched
                counters.add("storage_wait_us", int((time.perf_counter() - began) * 1e6))
                self.close()
                if got > arrived and (fresh or classify(exc) is None):  # keep what arrived; the next read resumes after it
                    counters.add("retries")
                    counters.add("resumes")
                    if classify(exc) is Kind.THROTTLED:
                        counters.add("throttles")
                    # (words, not the exception: a log record that kept it would keep its frames' views of
                    # ``view`` alive, and the block could not be cut to size)
                    logger.debug("%s: connection broke at byte %d, resuming there: %s", self.url, self.pos + got, f"{type(exc).__name__}: {exc}")
                    break
                if got > arrived:  # cut before real progress: a failed try (backed off; at the deadline, the error)
                    attempts.resets += 1
                    attempts.cut_bytes += got - arrived
                    logger.debug(
                        "%s: connection broke at byte %d after %d bytes (reset %d before real progress)",
                        self.url,
                        self.pos + got,
                        got - arrived,
                        attempts.resets,
                    )
                    attempts.failed(exc, resumed=True)
                    break
                if self._failed(attempts, exc):
                    return 0
                continue
            counters.add("storage_wait_us", int((time.perf_counter() - began) * 1e6))
            if got < size:  # the body is complete: the object ended before the range did
                self.close()
                if not got:
                    if not self._streams:
                        # fsspec's cat_file answers a range that starts at or past the object's end
                        # with no bytes (as a slice would: memory://, zip://, any store without HTTP),
                        # where S3 and HTTP answer 416: the same end of the stream, not a failed try
                        # (it was retried as one, an EOFError, until the deadline: 60 s by default)
                        logger.debug("%s: the object ends before byte %d (an empty answer): end of stream", self.url, self.pos)
                        return 0
                    if sent:  # a new request answered with nothing at all
                        self._failed(attempts, EOFError(f"empty body for bytes {self.pos}-{self._asked}"))
                    continue  # ask again from here: the answer says where the object ends (416)
                self.end = self.pos + got  # (no request more to learn it)
            break
        counters.add("bytes_read", got)
        self.pos += got
        if self.pos >= self.end or not self._streams:
            self.close()  # the whole body is in: its connection serves the next request
        return got

    def _failed(self, attempts: _Attempts, exc: Exception) -> bool:
        """A try that got no byte: True when it ends the stream (an HTTP 416: the object ends
        before the byte reached), else the backoff is slept before the next try, or the error the
        failure means raised."""
        if is_past_end(exc):
            logger.debug("%s: the object ends before byte %d (HTTP 416): end of stream", self.url, self.pos)
            return True
        attempts.failed(exc, resumed=self.pos > self.start_at)
        return False
