"""S3 reads through obstore (Apache Arrow's Rust ``object_store``), under shardstream's own policy.

obstore makes the requests: signing, the HTTP client and its connection pool, TLS. What stays
shardstream's is what ``retry.py`` does around it (the deadline, exact resume, the counters) and
the words of an error (``classify.py``). Here an S3 URL and the user's storage options become an
``S3Store`` and a ``Body`` per range:

- **credentials** come from botocore's chain (``AWS_*`` variables, ``profile`` / ``AWS_PROFILE``
  in ``~/.aws/credentials`` and ``~/.aws/config``, SSO, container and instance metadata), the
  same credentials uploads through s3fs use, handed to obstore as a credential provider (taken
  again before they expire); ``key``/``secret``/``token`` in the options are used as given, and
  ``anon=True`` sends unsigned requests. No credentials at all is ``NoCredentials`` at once
  (not a wait on instance metadata). Where the chain would take ``AWS_ACCESS_KEY_ID`` and
  ``AWS_SECRET_ACCESS_KEY`` as they are (no ``profile`` option, no ``AWS_CREDENTIAL_EXPIRATION``)
  and the region is known without a profile (``client_kwargs``, ``AWS_DEFAULT_REGION``), they go
  to obstore as given, with no botocore session (``_environment_credentials``).
- **endpoint and region**: ``endpoint_url`` (or ``client_kwargs``'), else ``AWS_ENDPOINT_URL_S3``
  or ``AWS_ENDPOINT_URL``; the region from ``client_kwargs['region_name']``, the profile or
  ``AWS_DEFAULT_REGION``, else us-east-1. An ``http://`` endpoint is allowed (a local server).
- **TLS**: ``client_kwargs['verify']`` (False: no check; a path: that CA bundle), else
  ``AWS_CA_BUNDLE`` or ``REQUESTS_CA_BUNDLE``: the bundle is added to the trusted roots.
- **timeouts and retries**: obstore's own retries are off (every retry is shardstream's, counted
  and bounded by ``StorageConfig.deadline``); its connect and read timeouts are the config's, cut
  to the deadline, and a try with less time left gets a store whose timeouts are cut to that.

Options obstore has no equivalent for (a custom session, ``s3_additional_kwargs`` such as SSE-C,
``version_aware``, client options other than endpoint, region and verify, proxies in
``config_kwargs``) keep s3fs's path (``options_for`` returns None), and so does a process forked
after obstore ran in its parent: obstore's runtime (tokio) has no threads in a forked child and
its requests would hang there, so a DataLoader worker started by ``fork`` from a process that
read S3 reads through s3fs (forkserver and spawn workers, the default, use obstore), with the
s3fs client the loader made before the fork (``ranges.ready_for_fork``: ``usable_after_fork``
says whether the workers need one).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import re
import socket
import threading
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import urlsplit

from shardstream.errors import ConfigError
from shardstream.redact import mask_options
from shardstream.storage.config import StorageConfig
from shardstream.storage.fs import aws_environment, check_profile

CHUNK = 0  # obstore's stream hands each piece on as it arrives: a break mid-body keeps every byte before it
REFRESH = datetime.timedelta(minutes=5)  # refreshing credentials are asked for again this often

# storage options this path understands (s3fs's names); any other one keeps s3fs's path
_OPTIONS = frozenset(
    {
        "endpoint_url",
        "anon",
        "key",
        "secret",
        "token",
        "profile",
        "client_kwargs",
        "config_kwargs",
        "requester_pays",
        "use_ssl",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_concurrency",
        "cache_regions",
    }
)
_CLIENT_KWARGS = frozenset({"endpoint_url", "region_name", "verify"})
_CONFIG_KWARGS = frozenset({"retries", "connect_timeout", "read_timeout", "s3", "region_name", "signature_version", "max_pool_connections"})

_runtime_pid: int | None = None  # the process whose obstore runtime has run (None: not yet)


def usable_here() -> bool:
    """False in a process forked after obstore ran in its parent (see the module docstring)."""
    return _runtime_pid is None or _runtime_pid == os.getpid()


def usable_after_fork() -> bool:
    """Whether a process forked from this one now could use obstore: not once obstore ran here or
    in a process this one was forked from."""
    return _runtime_pid is None


def options_for(storage_options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The storage options when obstore can honour all of them, else None (s3fs's path)."""
    options = dict(storage_options or {})
    if not set(options) <= _OPTIONS:
        return None
    if set(options.get("client_kwargs") or {}) - _CLIENT_KWARGS:
        return None
    config = options.get("config_kwargs") or {}
    if set(config) - _CONFIG_KWARGS or set(config.get("s3") or {}) - {"addressing_style"}:
        return None
    if config.get("signature_version") not in (None, "s3v4"):
        return None
    return options


class _Credentials:
    """obstore's credential provider over botocore's credentials (refreshing ones stay fresh)."""

    def __init__(self, credentials: Any):
        self._credentials = credentials
        from botocore.credentials import RefreshableCredentials

        self._refreshing = isinstance(credentials, RefreshableCredentials)

    def __repr__(self) -> str:
        return f"_Credentials(refreshing={self._refreshing})"

    def __call__(self) -> dict[str, Any]:
        frozen = self._credentials.get_frozen_credentials()
        expires = datetime.datetime.now(datetime.UTC) + REFRESH if self._refreshing else None
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token, "expires_at": expires}


_sessions: dict[tuple, tuple[Any, str | None]] = {}


def _botocore(profile: str | None) -> tuple[Any, str | None]:
    """(credentials, region) from botocore's chain, once per profile and ``AWS_*`` environment."""
    key = (profile, aws_environment())
    found = _sessions.get(key)
    if found is None:
        import botocore.session
        from botocore.exceptions import NoCredentialsError

        session = botocore.session.Session(profile=profile)
        credentials = session.get_credentials()
        if credentials is None:
            raise NoCredentialsError()
        found = _sessions[key] = (credentials, session.get_config_variable("region"))
    return found


def _environment_credentials() -> dict[str, str] | None:
    """``S3Store``'s credentials from ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` (and
    ``AWS_SECURITY_TOKEN`` or ``AWS_SESSION_TOKEN``), as botocore's environment provider reads
    them, or None where it would not hand them over as they are: a variable missing (its error is
    botocore's), or ``AWS_CREDENTIAL_EXPIRATION`` set (credentials it reads again as they expire).
    The environment comes first in botocore's chain unless a ``profile`` is given, so for the
    caller that gives none these are the credentials the chain would find, without the botocore
    session and chain each new worker made for them (15-60 ms of its first read)."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID", ""), os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    if not key or not secret or os.environ.get("AWS_CREDENTIAL_EXPIRATION"):
        return None
    given = {"access_key_id": key, "secret_access_key": secret}
    token = os.environ.get("AWS_SECURITY_TOKEN") or os.environ.get("AWS_SESSION_TOKEN")
    if token:
        given["session_token"] = token
    return given


def _store_args(options: Mapping[str, Any], bucket: str) -> dict[str, Any]:
    """``S3Store`` keyword arguments for ``options`` (see the module docstring), timeouts aside."""
    client_kwargs = options.get("client_kwargs") or {}
    config_kwargs = options.get("config_kwargs") or {}
    endpoint = (
        options.get("endpoint_url")
        or client_kwargs.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    args: dict[str, Any] = {}
    client: dict[str, Any] = {}
    region = client_kwargs.get("region_name") or config_kwargs.get("region_name")
    if options.get("anon"):
        args["skip_signature"] = True
    elif options.get("key") and options.get("secret"):
        args.update(access_key_id=options["key"], secret_access_key=options["secret"])
        if options.get("token"):
            args["session_token"] = options["token"]
    else:
        check_profile(options.get("profile"))
        given = _environment_credentials() if not options.get("profile") and (region or os.environ.get("AWS_DEFAULT_REGION")) else None
        if given is not None:
            args.update(given)
            region = region or os.environ["AWS_DEFAULT_REGION"]  # (botocore's region: this variable before any profile's)
        else:
            credentials, session_region = _botocore(options.get("profile"))
            args["credential_provider"] = _Credentials(credentials)
            region = region or session_region
    args["region"] = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    if endpoint:
        if options.get("use_ssl") is False and endpoint.startswith("https://"):
            endpoint = "http://" + endpoint[len("https://") :]
        args["endpoint"] = endpoint.rstrip("/")
        client["allow_http"] = urlsplit(endpoint).scheme == "http"
        args["virtual_hosted_style_request"] = (config_kwargs.get("s3") or {}).get("addressing_style") == "virtual"
    elif (config_kwargs.get("s3") or {}).get("addressing_style") == "path":
        args["virtual_hosted_style_request"] = False
    if options.get("requester_pays"):
        args["request_payer"] = True
    verify = client_kwargs.get("verify")
    bundle = verify if isinstance(verify, str) else os.environ.get("AWS_CA_BUNDLE") or os.environ.get("REQUESTS_CA_BUNDLE")
    if verify is False:
        client["allow_invalid_certificates"] = True
    elif bundle:
        try:
            with open(bundle, "rb") as f:
                client["root_certificate"] = f.read()
        except OSError as exc:
            source = "client_kwargs['verify']" if isinstance(verify, str) else "AWS_CA_BUNDLE or REQUESTS_CA_BUNDLE"
            raise ConfigError(f"the CA bundle {bundle} ({source}) cannot be read: {exc.strerror or exc}") from exc
    args["client_options"] = client
    return args


class Client:
    """One bucket's S3Store under one set of options and one StorageConfig (``client_for``), with
    what the readers ask of it: a ranged GET streamed as a ``Body``, an object's size, one range's
    bytes (``cat_file``, as fsspec names it: ``classify.explain_denied`` asks a refused HEAD again)."""

    def __init__(self, bucket: str, options: Mapping[str, Any], config: StorageConfig):
        self.bucket, self.config = bucket, config
        self._args = _store_args(options, bucket)
        self._timeout = min(config.read_timeout, config.deadline)
        self.store = self._make(self._timeout)

    def __repr__(self) -> str:
        return f"Client(bucket={self.bucket!r}, args={mask_options(self._args)!r})"  # (its keys masked)

    def _make(self, read_timeout: float) -> Any:
        from obstore.store import S3Store

        global _runtime_pid
        _runtime_pid = os.getpid()
        args = dict(self._args)
        seconds = datetime.timedelta
        client = dict(args.pop("client_options"))
        client.update(
            connect_timeout=seconds(seconds=min(self.config.connect_timeout, read_timeout)),
            read_timeout=seconds(seconds=read_timeout),
            timeout=seconds(days=1),  # a long body is bounded by its reads' timeout, not as a whole
        )
        retry: Any = {"max_retries": 0, "retry_timeout": seconds(seconds=self.config.deadline)}
        return S3Store(self.bucket, client_options=cast(Any, client), retry_config=retry, **args)

    def store_within(self, timeout: float | None) -> Any:
        """The store, or for a try with less time left than its timeouts one whose timeouts are that."""
        if timeout is None or timeout >= self._timeout:
            return self.store
        return self._make(max(timeout, 0.001))

    def open(self, key: str, a: int, b: int, timeout: float | None = None) -> ObjectBody:
        return ObjectBody(self, key, a, b, timeout)

    def size(self, path: str) -> int:
        import obstore

        try:
            return int(obstore.head(self.store, key_of(path))["size"])
        except Exception as exc:
            raise translate(exc) from exc

    def cat_file(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        import obstore

        try:
            return bytes(obstore.get_range(self.store, key_of(path), start=start, end=end if end is not None else start + 1))
        except Exception as exc:
            raise translate(exc) from exc


def key_of(path: str) -> str:
    return path.split("/", 1)[1] if "/" in path else ""


_clients: dict[tuple, Client] = {}
_clients_lock = threading.Lock()


def client_for(path: str, options: Mapping[str, Any], config: StorageConfig) -> Client:
    """One Client per process, bucket, options and policy (its connections are kept alive)."""
    from fsspec.utils import tokenize

    bucket = path.split("/", 1)[0]
    key = (os.getpid(), bucket, tokenize(dict(options)), aws_environment(), config)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = Client(bucket, options, config)
        return client


_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None


def _requests() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that wait for a GET's answer while the caller goes on (a request sent ahead)."""
    global _pool
    with _clients_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="shardstream-get"))
        return _pool[1]


class ObjectBody:
    """One GET of bytes [a, b) (``retry.Body``). The request goes out when the body is made (on a
    thread of ``_requests``); the first read waits for its answer at most ``timeout`` seconds and
    raises an error answer; later ones hand over the body's pieces as they arrive: copied into the
    caller's buffer (``readinto``), or as they are (``take``: a view of obstore's own buffer, no
    copy, for a reader that keeps pieces rather than a block)."""

    __slots__ = ("_future", "_stream", "_piece", "_path")

    def __init__(self, client: Client, key: str, a: int, b: int, timeout: float | None):
        import obstore

        self._path = f"{client.bucket}/{key}"
        self._stream: Any = None
        self._piece = memoryview(b"")
        store = client.store_within(timeout)
        self._future: concurrent.futures.Future | None = _requests().submit(obstore.get, store, key, options={"range": (a, b)})

    def _next(self, timeout: float | None) -> memoryview:
        """The rest of the piece in hand, else the body's next piece (empty at its end)."""
        piece = self._piece
        if piece:
            return piece
        try:
            if self._stream is None:
                if self._future is None:
                    raise ValueError("read from a closed body")
                try:
                    answer = self._future.result(timeout)
                except concurrent.futures.TimeoutError:
                    raise TimeoutError(f"no answer within the {timeout:.1f} s left for this try") from None
                self._stream = answer.stream(min_chunk_size=CHUNK)
            return memoryview(next(self._stream))
        except StopIteration:
            return piece
        except Exception as exc:
            self.close()
            raise translate(exc) from exc

    def readinto(self, view: memoryview, timeout: float | None = None) -> int:
        piece = self._next(timeout)
        k = min(len(view), len(piece))
        view[:k] = piece[:k]
        self._piece = piece[k:]
        return k

    def take(self, n: int, timeout: float | None = None) -> memoryview:
        """The body's next bytes, at most ``n``, as a read-only view of the piece obstore handed
        over (no copy; empty at the body's end)."""
        piece = self._next(timeout)
        if len(piece) <= n:
            self._piece = memoryview(b"")
            return piece
        self._piece = piece[n:]
        return piece[:n]

    def close(self) -> None:
        future, self._future, self._stream, self._piece = self._future, None, None, memoryview(b"")
        if future is not None:
            future.cancel()  # (an answer on its way is dropped with its stream, closing its connection)


# -- what an obstore error means -------------------------------------------------------------------
class ObjectStoreError(OSError):
    """An error answer or a broken transfer from obstore, shaped like botocore's ClientError for
    ``classify``: ``response["Error"]["Code"]`` and ``response["ResponseMetadata"]["HTTPStatusCode"]``.
    (obstore says the status and S3's error code only in its message: they are read from there.)"""

    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(f"HTTP {status} {code or ''}: {message}".strip())
        self.status = status
        self.response = {"Error": {"Code": code or str(status), "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}


class ObjectStoreDenied(ObjectStoreError, PermissionError):
    """A 401 or 403 answer."""


_STATUS = re.compile(r"status(?: code)?:? (\d{3})")
_CODE = re.compile(r"<Code>(.*?)</Code>", re.S)
_MESSAGE = re.compile(r"<Message>(.*?)</Message>", re.S)


def translate(exc: BaseException) -> BaseException:
    """An obstore exception as the standard library's (or ``ObjectStoreError``), so that ``classify``
    and ``cause`` word it as every other path's: an answer's status and S3 code, a refused
    connection, a timeout, DNS, a body that broke. Anything else is returned as it is."""
    if isinstance(exc, (TimeoutError, ObjectStoreError)) or not type(exc).__module__.startswith(("obstore", "builtins")):
        return exc
    text = str(exc)
    head = text.split("\n\nDebug source:", 1)[0]
    status = _STATUS.search(head)
    if status:
        code, message = _CODE.search(head), _MESSAGE.search(head)
        kind = ObjectStoreDenied if status.group(1) in ("401", "403") else ObjectStoreError
        return kind(int(status.group(1)), code.group(1) if code else None, message.group(1) if message else head[:200])
    if isinstance(exc, FileNotFoundError):  # (a 404 without a body: a HEAD)
        return ObjectStoreError(404, None, head[:200])
    detail = re.sub(r"retry_timeout: [^,]*,", "", text)  # (the Debug source says what happened; not this setting)
    if "ConnectionRefused" in detail or "connection refused" in detail.lower():
        return ConnectionRefusedError(f"connection refused ({_first_line(head)})")
    if "dns error" in detail or "failed to lookup address" in detail:
        return socket.gaierror(f"host name not found ({_first_line(head)})")
    if "kind: Timeout" in detail or "TimedOut" in detail or "timed out" in detail:
        return TimeoutError(f"the store sent nothing within the try's timeout ({_first_line(head)})")
    if "certificate" in detail.lower() or "InvalidCertificate" in detail:
        import ssl

        return ssl.SSLError(_first_line(head))
    if isinstance(exc, (ValueError, TypeError)) and "obstore" not in type(exc).__module__:
        return exc  # a bug or a bad argument, not storage
    return ConnectionError(f"broken transfer ({_first_line(head)})")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else "no detail"
