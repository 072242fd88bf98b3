"""S3 range GETs read straight into shardstream's buffer, with the standard library's HTTP client.

The bytes of a shard are most of what a training job moves. s3fs's path (aiobotocore on aiohttp,
on an event-loop thread) copies each of them twice before shardstream sees it and cost 3.8-5.1 ms
of CPU per 4 MB on this VM, more than the rest of the reader. Here a range GET is one
``http.client`` request whose body is read with ``readinto1`` into the block the parser reads, so
the kernel's copy is the only one (``benchmarks/bench_s3_cpu.py``), and each receive is counted as it
lands: a connection reset mid-body keeps every byte that arrived.

How to talk to S3 is not decided here but by the s3fs client the other path uses: the object's
URL is what that client presigns (endpoint, addressing style, version id; the signature is
dropped), and each request is signed with botocore's S3 SigV4 signer over that client's current
credentials (taken again every minute, and at once after a 403, so refreshing credentials stay
fresh), or not at all for anonymous access. Answers other than 200/206 become ``S3ResponseError``,
which carries S3's error code and HTTP status as botocore's ClientError does, so ``classify`` and
the retry policy treat them as before; a body cut short raises a ConnectionError that says how many
bytes arrived (``partial``), and the fetcher hands those on as ``PartialRead``.

``usable`` keeps s3fs's path wherever this one could behave differently: a proxy for the endpoint,
per-request extras (requester pays, SSE-C, ``s3_additional_kwargs``), client options beyond
``endpoint_url``/``verify``/``region_name``, proxies in ``config_kwargs``, or
``StorageConfig(direct_get=False)``. A range is one GET whose body many reads take in turn
(``DirectBody``): its request goes out when the body is made (read-ahead makes the next range's
before this one ends), its answer is read by the first read. Connections are kept alive per
thread, taken by a body while it streams and given back once it is read to its end (a body closed
before, or broken, closes its connection); a forked DataLoader worker opens its own.
"""

from __future__ import annotations

import http.client
import inspect
import os
import re
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

from shardstream.buffers import uninitialized_bytearray
from shardstream.private import client_signer
from shardstream.storage.classify import TRANSIENT, classify
from shardstream.storage.config import StorageConfig
from shardstream.storage.retry import OpenBody, PartialRead

URL_LIFETIME = 3600  # (the presigned URL only shows where the object is; requests are signed anew)
CREDENTIALS_TTL = 60.0  # seconds between looks at the client's (maybe refreshing) credentials
BODY_BLOCK = 1 << 20  # a chunked body's reads (a Content-Length body is read as it arrives)
IDLE_CONNECTIONS = 16  # kept-alive idle connections per thread and endpoint (read-ahead keeps up to 9 requests in flight)

# query parameters of a presigned URL's signature, SigV4 or SigV2 (what remains names the object)
_AUTH_PARAM = re.compile(r"(?i)(x-amz-[^=]*|awsaccesskeyid|signature|expires)=")
# client_kwargs this path understands; any other one (a proxy config, a custom session) keeps s3fs's path
_CLIENT_KWARGS = frozenset({"endpoint_url", "verify", "region_name"})


class S3ResponseError(OSError):
    """An error answer to a direct GET, shaped like botocore's ClientError for ``classify``:
    ``response["Error"]["Code"]`` and ``response["ResponseMetadata"]["HTTPStatusCode"]``."""

    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(f"HTTP {status} {code or ''}: {message}".strip())
        self.status = status
        self.response = {"Error": {"Code": code or str(status), "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}


def _xml_field(body: bytes, name: str) -> str | None:
    match = re.search(rb"<%s>(.*?)</%s>" % (name.encode(), name.encode()), body, re.S)
    return match.group(1).decode("utf-8", "replace") if match else None


def usable(fs: Any, config: StorageConfig) -> bool:
    """Whether ``fs`` (an s3fs filesystem) can have its range GETs made here without changing
    what they do."""
    if not getattr(config, "direct_get", True):
        return False
    if getattr(fs, "req_kw", None) or getattr(fs, "s3_additional_kwargs", None):
        return False
    if set(getattr(fs, "client_kwargs", None) or {}) - _CLIENT_KWARGS:
        return False
    if (getattr(fs, "config_kwargs", None) or {}).get("proxies"):
        return False
    endpoint = getattr(fs, "endpoint_url", None) or (fs.client_kwargs or {}).get("endpoint_url")
    if endpoint is not None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        if _proxied(parts.scheme, parts.hostname):
            return False
    elif _proxied("https", "s3.amazonaws.com"):
        return False
    return True


def _proxied(scheme: str, host: str) -> bool:
    proxies = urllib.request.getproxies()
    return scheme in proxies and not urllib.request.proxy_bypass(host)


def _ssl_context(fs: Any) -> ssl.SSLContext:
    verify = (fs.client_kwargs or {}).get("verify", None)
    if verify is False:
        context = ssl.create_default_context()  # verify=False: no hostname check, no certificate check
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    bundle = os.environ.get("AWS_CA_BUNDLE")
    if bundle:
        return ssl.create_default_context(cafile=bundle)
    from botocore.httpsession import get_cert_path  # botocore's default: certifi's bundle where installed

    path = get_cert_path(True)
    return ssl.create_default_context(cafile=path) if isinstance(path, str) else ssl.create_default_context()


def _read_some(resp: http.client.HTTPResponse, view: memoryview) -> int:
    """The next bytes of ``resp``'s body into ``view``: what one receive brings (``readinto1``, as
    ``HTTPResponse.read1`` reads, with its bookkeeping), straight into ``view`` but for what the
    response's buffer already holds. Each call's count reaches the caller before the next receive,
    so a connection reset mid-body loses no byte that arrived: a single ``readinto`` over the whole
    range raised with the count of the bytes it had copied lost, and every retry restarted from the
    range's first byte. A chunked body (not S3's) is read in ``BODY_BLOCK`` pieces."""
    fp = resp.fp
    if fp is None:
        return 0
    if resp.chunked or resp.length is None:
        return resp.readinto(view[:BODY_BLOCK])
    if len(view) > resp.length:
        view = view[: resp.length]
    n = fp.readinto1(view)
    if not n:
        if len(view):
            resp.close()  # the connection ended before the Content-Length
        return 0
    resp.length -= n
    if not resp.length:
        resp.close()  # the whole body is in: the connection may serve the next request
    return n


Where = tuple[str, str, "int | None"]  # (scheme, host, port)


class _Connections(threading.local):
    """Idle keep-alive connections of one thread, by (scheme, host, port); a forked child starts
    afresh. A connection is taken out while a body streams on it and put back once that body is
    read to its end, so two bodies never share one."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.open: dict[Where, list[http.client.HTTPConnection]] = {}


class DirectS3:
    """Range GETs of one s3fs filesystem's objects (see the module docstring)."""

    def __init__(self, fs: Any, config: StorageConfig):
        self.fs = fs
        self.config = config
        self._templates: dict[str, tuple[str, str]] = {}  # bucket -> (URL before the key, after it)
        self._auth: tuple[Any, float] | None = None
        self._connections = _Connections()
        self._context: ssl.SSLContext | None = None

    # -- URLs and signatures -------------------------------------------------------------------
    def _sync(self, coro_fn: Callable[[], Any]) -> Any:
        import fsspec.asyn

        return fsspec.asyn.sync(self.fs.loop, coro_fn)

    def url(self, bucket: str, key: str, version: str | None) -> str:
        """The object's URL as s3fs's client addresses it (endpoint, addressing style, version).

        The client presigns one key per bucket; its URL without the signature, with the key's
        place found, serves every other key of the bucket (quoted as botocore quotes keys). So a
        forked worker that inherits this object needs no client of its own to find its shards."""
        template = self._templates.get(bucket)
        if template is None:
            template = self._templates[bucket] = self._template(bucket)
        prefix, suffix = template
        url = prefix + quote(key, safe="/~") + suffix
        if version:
            url += ("&" if "?" in url else "?") + "versionId=" + quote(version, safe="")
        return url

    def _template(self, bucket: str) -> tuple[str, str]:
        probe = "shardstream-probe/k"

        async def presign() -> str:
            client = await self.fs.set_session()
            return await client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": probe}, ExpiresIn=URL_LIFETIME)

        parts = urlsplit(self._sync(presign))
        query = "&".join(q for q in parts.query.split("&") if q and not _AUTH_PARAM.match(q))
        url = parts._replace(query=query).geturl()
        where = url.find("/" + probe)
        if where < 0 or url.find("/" + probe, where + 1) >= 0:
            raise ValueError(f"cannot tell where the key goes in {url!r}")
        return url[: where + 1], url[where + 1 + len(probe) :]

    def _signer(self, fresh: bool = False) -> Any:
        """botocore's S3 SigV4 signer over the client's current credentials (None: unsigned
        requests, as s3fs's ``anon=True``); credentials are taken again every CREDENTIALS_TTL
        seconds, so botocore's refreshing credentials stay fresh here too."""
        now = time.monotonic()
        if self._auth is not None and not fresh and now - self._auth[1] < CREDENTIALS_TTL:
            return self._auth[0]

        async def frozen() -> tuple[Any, str | None, Any]:
            client = await self.fs.set_session()
            signer, credentials = client_signer(client)
            if credentials is None:
                return None, None, signer
            got = credentials.get_frozen_credentials()
            if inspect.isawaitable(got):
                got = await got
            return got, client.meta.region_name, signer

        credentials, region, signer = self._sync(frozen)
        from botocore import UNSIGNED
        from botocore.auth import S3SigV4Auth

        if credentials is None or getattr(signer, "signature_version", None) is UNSIGNED:
            auth = None
        else:
            auth = S3SigV4Auth(credentials, "s3", region or "us-east-1")
        self._auth = (auth, now)
        return auth

    def _headers(self, url: str, a: int, b: int, fresh: bool) -> dict[str, str]:
        headers = {"Range": f"bytes={a}-{b - 1}"}
        auth = self._signer(fresh)
        if auth is None:
            return headers
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method="GET", url=url, headers=headers)
        auth.add_auth(request)
        return dict(request.headers.items())

    # -- connections --------------------------------------------------------------------------
    def _take(self, where: Where) -> http.client.HTTPConnection:
        """An idle kept-alive connection to ``where`` of this thread, else a new one."""
        pool = self._connections
        if pool.pid != os.getpid():  # inherited over fork: the parent's sockets are not ours to use
            pool.pid, pool.open = os.getpid(), {}
        idle = pool.open.get(where)
        if idle:
            conn = idle.pop()
            if not idle:
                del pool.open[where]
            return conn
        scheme, host, port = where
        if scheme == "https":
            if self._context is None:
                self._context = _ssl_context(self.fs)
            return http.client.HTTPSConnection(host, port, timeout=self.config.connect_timeout, context=self._context)
        return http.client.HTTPConnection(host, port, timeout=self.config.connect_timeout)

    def _give_back(self, where: Where, conn: http.client.HTTPConnection) -> None:
        """A connection whose last answer was read to its end serves the next request."""
        pool = self._connections
        if pool.pid != os.getpid():
            conn.close()
            return
        idle = pool.open.setdefault(where, [])
        if len(idle) < IDLE_CONNECTIONS:
            idle.append(conn)
        else:
            conn.close()

    # -- one GET ------------------------------------------------------------------------------
    def open(self, bucket: str, key: str, version: str | None, a: int, b: int, timeout: float | None = None) -> DirectBody:
        """Send a GET for bytes [a, b) now and return its body (``retry.Body``): the answer is read,
        and an error answer or a broken connection raised, by the body's first ``readinto``."""
        return DirectBody(self, self.url(bucket, key, version), a, b, timeout)

    def get(self, bucket: str, key: str, version: str | None, a: int, b: int, out: memoryview, timeout: float | None) -> int:
        """Bytes [a, b) into ``out``; returns how many arrived (fewer when the object is shorter).
        Raises S3ResponseError for an error answer, TimeoutError or OSError for the transport;
        ``got`` in the exception's ``partial`` attribute says how many bytes arrived first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        body = self.open(bucket, key, version, a, b, timeout)
        got = 0
        try:
            while got < b - a:
                n = body.readinto(out[got : b - a], None if deadline is None else deadline - time.monotonic())
                if not n:
                    break
                got += n
            return got
        except BaseException as exc:
            exc.partial = got  # type: ignore[attr-defined]
            raise
        finally:
            body.close()


class DirectBody:
    """One direct GET's body (``retry.Body``). The request goes out when the body is made (a
    failure to connect or send is kept and raised by the first ``readinto``); the answer is read by
    the first ``readinto`` (a 403 is asked once more with fresh credentials), and every call after
    it reads what one receive brings, straight into the caller's view (``_read_some``). A body read
    to its end gives its connection back for the next request; one closed before, or broken, closes
    it."""

    __slots__ = ("_owner", "_url", "_a", "_b", "_where", "_conn", "_resp", "_left", "_got", "_failed", "_target", "_answered")

    def __init__(self, owner: DirectS3, url: str, a: int, b: int, timeout: float | None):
        parts = urlsplit(url)
        self._owner, self._url, self._a, self._b = owner, url, a, b
        self._where: Where = (parts.scheme, parts.hostname or "", parts.port)
        self._target = parts.path + ("?" + parts.query if parts.query else "")
        self._conn: http.client.HTTPConnection | None = None
        self._resp: http.client.HTTPResponse | None = None
        self._left = 0  # body bytes still to read, of those asked for
        self._got = 0
        self._answered = False
        self._failed: BaseException | None = None
        try:
            self._send(fresh=False, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - raised by the first readinto, where the caller's policy sees it
            self._failed = exc

    def _send(self, fresh: bool, timeout: float | None) -> None:
        owner = self._owner
        headers = owner._headers(self._url, self._a, self._b, fresh)
        conn = self._conn = owner._take(self._where)
        try:
            conn.timeout = _bounded(owner.config.connect_timeout, timeout)
            if conn.sock is not None:
                conn.sock.settimeout(_bounded(owner.config.read_timeout, timeout))
            conn.request("GET", self._target, headers=headers)
        except http.client.HTTPException as exc:
            self._drop()
            raise ConnectionError(f"broken HTTP exchange ({type(exc).__name__}: {exc})") from exc
        except BaseException:
            self._drop()
            raise

    def _answer(self, timeout: float | None) -> None:
        owner = self._owner
        for attempt in (0, 1):
            if self._failed is not None:
                failed, self._failed = self._failed, None
                raise failed
            conn = self._conn
            if conn is None:
                raise ValueError("read from a closed body")
            if conn.sock is not None:
                conn.sock.settimeout(_bounded(owner.config.read_timeout, timeout))
            resp = conn.getresponse()
            if resp.status not in (200, 206):
                body = resp.read()
                error = S3ResponseError(resp.status, _xml_field(body, "Code"), _xml_field(body, "Message") or resp.reason)
                self._drop()
                if resp.status == 403 and not attempt:  # maybe credentials that changed: once more with fresh ones
                    try:
                        self._send(fresh=True, timeout=timeout)
                    except Exception as exc:  # noqa: BLE001 - raised at the top of the loop
                        self._failed = exc
                    continue
                raise error
            if resp.status == 200 and self._a:  # the server ignored the Range header: never hand over the wrong bytes
                self._drop()
                raise S3ResponseError(416, "RangeIgnored", f"asked for bytes {self._a}-{self._b - 1}, got the whole object")
            self._resp = resp
            self._answered = True
            self._left = min(self._b - self._a, resp.length if resp.length is not None else self._b - self._a)
            return
        raise AssertionError("unreachable")

    def readinto(self, view: memoryview, timeout: float | None = None) -> int:
        try:
            if not self._answered:
                self._answer(timeout)
            if self._left <= 0:
                self._done()
                return 0
            resp, conn = self._resp, self._conn
            assert resp is not None and conn is not None
            if conn.sock is not None:
                conn.sock.settimeout(_bounded(self._owner.config.read_timeout, timeout))
            n = _read_some(resp, view[: self._left] if len(view) > self._left else view)
            if not n:  # the connection closed before the body's Content-Length
                raise ConnectionError(f"connection closed after {self._got} of {self._got + self._left} bytes of the body")
            self._got += n
            self._left -= n
            if self._left <= 0:
                self._done()
            return n
        except http.client.HTTPException as exc:  # IncompleteRead, BadStatusLine...: a broken exchange
            self._drop()
            raise ConnectionError(f"broken HTTP response ({type(exc).__name__}: {exc})") from exc
        except BaseException:
            self._drop()
            raise

    def _done(self) -> None:
        """All asked for is in: the connection serves the next request if its answer is over."""
        conn, resp = self._conn, self._resp
        self._conn = self._resp = None
        if conn is None:
            return
        if resp is not None and resp.isclosed() and not resp.will_close:
            self._owner._give_back(self._where, conn)
        else:  # more than asked for (a Range ignored from byte 0), or a server that closes: not reusable
            conn.close()

    def _drop(self) -> None:
        conn, self._conn, self._resp = self._conn, None, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        if self._conn is not None:
            if self._answered and self._left <= 0:
                self._done()
            else:
                self._drop()
        self._failed = None


def _bounded(limit: float, timeout: float | None) -> float:
    """A socket timeout: ``limit``, or less when the request's try has less time left."""
    if timeout is None:
        return limit
    if timeout <= 0:
        raise TimeoutError("the request's deadline ran out")
    return min(limit, timeout)


_direct: dict[tuple[type, str, StorageConfig], DirectS3] = {}
_direct_lock = threading.Lock()


def direct_for(fs: Any, config: StorageConfig) -> DirectS3:
    """One DirectS3 per filesystem options and policy. A forked DataLoader worker finds the one
    its parent used (fsspec makes the worker a filesystem of its own), with the URL templates and
    credentials it holds, and gives it the worker's filesystem for what it still asks the client."""
    from fsspec.utils import tokenize

    key = (type(fs), tokenize(getattr(fs, "storage_args", ()), getattr(fs, "storage_options", {})), config)
    with _direct_lock:
        found = _direct.get(key)
        if found is None:
            found = _direct[key] = DirectS3(fs, config)
        elif found.fs is not fs:
            found.fs = fs
        return found


def direct_fetcher(fs: Any, path: str, config: StorageConfig) -> Callable[..., bytearray]:
    """``fetch(a, b, timeout)`` for one S3 object, as ``retry.s3_fetcher`` but through DirectS3."""
    direct = direct_for(fs, config)
    bucket, key, version = fs.split_path(path)

    def fetch(a: int, b: int, timeout: float | None = None) -> bytearray:
        out = uninitialized_bytearray(b - a)  # every byte is written by the GET (or cut off below)
        view = memoryview(out)
        try:
            got = direct.get(bucket, key, version or None, a, b, view, timeout)
        except OSError as exc:  # (TimeoutError, ConnectionError, S3ResponseError are OSErrors)
            got = getattr(exc, "partial", 0)
            view.release()
            if got and classify(exc) in TRANSIENT:
                raise PartialRead(bytes(out[:got]), exc) from exc
            raise
        view.release()
        if got < b - a:  # the object ended early (the caller reports a short read)
            del out[got:]
        return out

    return fetch


def direct_opener(fs: Any, path: str, config: StorageConfig) -> OpenBody:
    """``open(a, b, timeout)`` for one S3 object: a range streamed through one DirectS3 GET."""
    direct = direct_for(fs, config)
    bucket, key, version = fs.split_path(path)

    def open_body(a: int, b: int, timeout: float | None = None) -> DirectBody:
        return direct.open(bucket, key, version or None, a, b, timeout)

    return open_body
