"""What a storage failure means, decided in one place: ``classify`` names its kind from the S3
error code or the exception type, and ``storage_error`` turns it into the error tree
(``errors.StorageError`` and its subclasses) with a message naming the URL and the real cause.

Kinds are permanent (not found, access denied, no credentials, an invalid request: fail at
once) or transient (throttling, timeouts, refused/reset connections, 5xx: retried by
``retry.py`` with backoff until the attempts or the deadline run out). An exception that is no
storage failure at all (a bug) gets no kind and passes through untouched.

Decisions are made from codes and types only: the S3 error code carried by botocore's
``ClientError`` (s3fs keeps it as the ``__cause__`` of the OSError it raises) or by
``objects.ObjectStoreError`` (obstore's errors, translated where they are raised), the HTTP status,
and the exception classes of botocore, aiohttp and the standard library (matched by class in
the exception's MRO, so botocore need not be imported to classify).

A failure that is handled, not raised on (retried, or a missing path that means "empty"), lets its
frames go (``release_frames``): one raised through fsspec's ``sync`` is in a reference cycle that
holds every caller's frame and locals until the garbage collector's next full pass. So does the
cause of every error ``storage_error`` makes: the typed error raised to the user keeps its cause's
type, words and traceback lines, and no longer the cycle that kept the user's loader, dataset and
buffers alive after the error was dropped.
"""

from __future__ import annotations

import enum
import socket
import ssl
import traceback
from collections.abc import Iterator

from shardstream.errors import (
    AccessDenied,
    BucketNotFound,
    NoCredentials,
    StorageError,
    StorageNotFound,
    StorageTimeout,
    StorageUnavailable,
)


class Kind(enum.Enum):
    NOT_FOUND = "not found"
    DENIED = "access denied"
    NO_CREDENTIALS = "no credentials"
    INVALID = "invalid request"
    THROTTLED = "throttled"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"


TRANSIENT = frozenset({Kind.THROTTLED, Kind.TIMEOUT, Kind.UNAVAILABLE})

_CODES = {
    Kind.NOT_FOUND: {"NoSuchKey", "NoSuchBucket", "NotFound", "NoSuchVersion", "404"},
    Kind.DENIED: {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "Forbidden",
        "403",
    },
    Kind.THROTTLED: {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestThrottled",
        "ServiceUnavailable",
        "503",
        "429",
    },
    Kind.UNAVAILABLE: {"InternalError", "RequestTimeout", "BadGateway", "GatewayTimeout", "500", "502", "504"},
}
_BY_CODE = {code: kind for kind, codes in _CODES.items() for code in codes}

# Exception classes by (module prefix, class name): found anywhere in an exception's MRO.
_TYPES = (
    (
        Kind.NO_CREDENTIALS,
        "botocore",
        {
            "NoCredentialsError",
            "PartialCredentialsError",
            "CredentialRetrievalError",
            "NoAuthTokenError",
            "TokenRetrievalError",
            "UnauthorizedSSOTokenError",
        },
    ),
    (Kind.TIMEOUT, "botocore", {"ReadTimeoutError", "ConnectTimeoutError"}),
    (
        Kind.INVALID,
        "botocore",
        {
            "ParamValidationError",
            "NoRegionError",
            "InvalidRegionError",
            "InvalidS3AddressingStyleError",
            "UnknownEndpointError",
            "InvalidEndpointConfigurationError",
        },
    ),
    (
        Kind.UNAVAILABLE,
        "botocore",
        {
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ProxyConnectionError",
            "SSLError",
            "HTTPClientError",
            "ResponseStreamingError",
            "IncompleteReadError",
        },
    ),
    (Kind.UNAVAILABLE, "aiohttp", {"ClientError"}),
    (Kind.TIMEOUT, "httpx", {"TimeoutException"}),
    (Kind.UNAVAILABLE, "httpx", {"TransportError"}),
    (Kind.UNAVAILABLE, "urllib3", {"HTTPError"}),
)

_DENIED = {
    "InvalidAccessKeyId": "the access key ID is not known to this endpoint (check AWS_ACCESS_KEY_ID, --profile and --endpoint-url)",
    "SignatureDoesNotMatch": "the secret key does not match the access key ID (check AWS_SECRET_ACCESS_KEY or the profile's secret)",
    "ExpiredToken": "the session token has expired (refresh the credentials)",
    "InvalidToken": "the session token is not valid (check AWS_SESSION_TOKEN or the profile)",
}
_DENIED_DEFAULT = "access denied: these credentials may not do this (check the IAM or bucket policy, --profile and --endpoint-url)"
_NO_CREDENTIALS = (
    "no credentials found (looked in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, the AWS_PROFILE or --profile "
    "entry of ~/.aws/credentials and ~/.aws/config, and instance metadata): set them or pass --profile"
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes/contexts, and the OS error aiohttp keeps on a connector error."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        cur = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        for nxt in (getattr(cur, "cause", None), getattr(cur, "os_error", None), cur.__cause__, cur.__context__):
            if isinstance(nxt, BaseException):
                todo.append(nxt)


def release_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames ``exc`` (and its causes and contexts) went through,
    where the failure is handled, or raised on as the cause of a typed error (``storage_error``):
    the traceback keeps its lines, the frame that caught it runs on (a frame still running is
    left as it is).

    An error of an async fsspec filesystem (s3fs, HTTP, gcsfs: every call through fsspec's
    ``sync``) is in a reference cycle: ``sync``'s frame holds the exception (its ``result`` list)
    and the exception's traceback holds that frame, whose callers' frames (``f_back``) it holds in
    turn. Dropped as it is, the error kept every frame up to the caller's caller alive, with their
    locals, until the garbage collector's next pass over its generation: a function that packed to
    a new S3 prefix (the listing's FileNotFoundError) and made a loader kept the loader and its
    workers after it returned (tests/test_obstore.py)."""
    for cur in _chain(exc):
        traceback.clear_frames(cur.__traceback__)


def _response(exc: BaseException) -> tuple[str | None, int | None]:
    """The S3 error code and HTTP status behind an exception, if any link of its chain carries them."""
    for cur in _chain(exc):
        response = getattr(cur, "response", None)
        # plain HTTP(S): aiohttp's ClientResponseError (fsspec's http) carries the status; an httpx
        # HTTPStatusError and huggingface_hub's HfHubHTTPError carry their response
        status = getattr(cur, "status", None) if _has_type(cur, "aiohttp", {"ClientResponseError"}) else None
        if status is None and (_has_type(cur, "httpx", {"HTTPStatusError"}) or _has_type(cur, "huggingface_hub", {"HfHubHTTPError"})):
            status = getattr(response, "status_code", None)
        if isinstance(status, int) and status >= 400:
            return None, status
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code or status:
                return (str(code) if code else None), (int(status) if status else None)
    return None, None


def error_code(exc: BaseException) -> str | None:
    """The S3 error code behind an exception (s3fs wraps botocore's ClientError), or None."""
    return _response(exc)[0]


def _has_type(exc: BaseException, module: str, names: set[str]) -> bool:
    return any(c.__name__ in names and c.__module__.startswith(module) for c in type(exc).__mro__)


def _kind_of_type(exc: BaseException) -> Kind | None:
    for kind, module, names in _TYPES:
        if _has_type(exc, module, names):
            return kind
    if isinstance(exc, TimeoutError):  # asyncio's and aiohttp's timeouts are TimeoutErrors too
        return Kind.TIMEOUT
    if isinstance(exc, FileNotFoundError):
        return Kind.NOT_FOUND
    if isinstance(exc, PermissionError):
        return Kind.DENIED
    if isinstance(exc, (IsADirectoryError, NotADirectoryError)):
        return Kind.INVALID
    if isinstance(exc, (OSError, EOFError)):  # connection refused/reset, DNS, TLS, a short body
        return Kind.UNAVAILABLE
    return None


def classify(exc: BaseException) -> Kind | None:
    """The kind of storage failure ``exc`` is, or None when it is no storage failure (a bug)."""
    if isinstance(exc, StorageError):
        return _KIND_OF_ERROR.get(type(exc), Kind.INVALID)
    code, status = _response(exc)
    if code in _BY_CODE:
        return _BY_CODE[code]
    if status is not None:
        if status in (429, 503):
            return Kind.THROTTLED
        if status in (401, 403) and not code:  # plain HTTP(S) and the Hugging Face Hub: no S3 code
            return Kind.DENIED
        if status == 404 and not code:
            return Kind.NOT_FOUND
        return Kind.UNAVAILABLE if status >= 500 else Kind.INVALID
    if code:  # an S3 code we do not list, without a status: the request itself was refused
        return Kind.INVALID
    wrapped = None
    for cur in _chain(exc):
        kind = _kind_of_type(cur)
        if kind is Kind.NOT_FOUND and type(cur) is FileNotFoundError and cur.__cause__ is not None and wrapped is None:
            # fsspec's HTTP info() (an object's size) raises FileNotFoundError from any failure
            # (a refused connection, a timeout): its cause, when it has a kind, says what happened
            wrapped = kind
            continue
        if kind is not None:
            return kind
    return wrapped


def is_past_end(exc: BaseException) -> bool:
    """An HTTP 416 (S3's InvalidRange): the range asked for starts at or past the object's end,
    i.e. the object is shorter than the caller believed. For a range a manifest promised, that is
    a truncated object, not an invalid request."""
    code, status = _response(exc)
    return status == 416 and code in (None, "416", "InvalidRange")


def denied_message(exc: BaseException) -> str:
    """What a 403 means, in words that say what to check: unknown key, wrong secret, expired token
    or missing permission."""
    return _DENIED.get(error_code(exc) or "", _DENIED_DEFAULT)


def explain_denied(fs, path: str, exc: BaseException) -> str:
    """``denied_message`` for a refused request on ``path``; a HEAD's 403 has no body to say why,
    so ask again with a one-byte ranged GET, whose error carries the code."""
    if error_code(exc) in (None, "403", "Forbidden") and fs is not None and "Local" not in type(fs).__name__:
        try:
            fs.cat_file(path, start=0, end=1)
        except Exception as again:  # noqa: BLE001 - the first answer stands unless this one is a refusal too
            release_frames(again)  # (through fsspec's sync: the cycle that holds this frame's callers)
            if isinstance(again, PermissionError):
                return denied_message(again)  # (its words, not the error: kept in a local, it held this frame)
    return denied_message(exc)


def cause(exc: BaseException) -> str:
    """The real cause in a few words: timeout (connect or read), refused, DNS, TLS, reset, HTTP status and code."""
    code, status = _response(exc)
    if code or status:
        return f"HTTP {status or '?'} {code or ''}".rstrip()
    for cur in _chain(exc):
        if _has_type(cur, "botocore", {"ConnectTimeoutError"}):
            return "connect timeout (no connection within the connect timeout)"
        if _has_type(cur, "botocore", {"ReadTimeoutError"}) or _has_type(cur, "aiohttp", {"SocketTimeoutError", "ServerTimeoutError"}):
            return "read timeout (the server sent nothing within the read timeout)"
        if isinstance(cur, socket.gaierror) or _has_type(cur, "aiohttp", {"ClientConnectorDNSError"}):
            return "host name not found (DNS)"
        if isinstance(cur, ssl.SSLError) or _has_type(cur, "aiohttp", {"ClientSSLError"}):
            return f"TLS error ({cur})"
        if isinstance(cur, ConnectionRefusedError):
            return "connection refused (nothing listens at the endpoint)"
        if isinstance(cur, ConnectionResetError):
            return "connection reset"
    if isinstance(exc, TimeoutError):
        return f"timeout ({exc})" if str(exc) else "timeout"
    return f"{type(exc).__name__}: {exc}"


def storage_error(
    url: str,
    exc: BaseException,
    *,
    attempts: int = 1,
    waited: float = 0.0,
    fs=None,
    path: str | None = None,
    hint: str = "",
    resets: int = 0,
    cut_bytes: int = 0,
) -> StorageError:
    """The one translation of a storage failure into the error tree, naming ``url`` and the cause.

    ``attempts``/``waited`` say how long a transient cause lasted (``resets``: how many of those
    tries were cut after ``cut_bytes`` bytes in all, too few to count as progress); ``fs``/``path`` let a bare 403
    be asked again for its reason; ``hint`` is added to a not-found message (what the object is).

    ``exc`` becomes the typed error's cause, its frames let go (``release_frames``): an error of
    s3fs (fsspec's ``sync``, s3fs's own wrapper) held in its traceback the frame that held it, and
    with it every caller's frame up to the user's: a loader whose read raised, its workers' handles
    and its buffers lived on after the user dropped the error, until a full garbage collection."""
    if isinstance(exc, StorageError):
        return exc
    release_frames(exc)
    kind = classify(exc)
    if kind is Kind.NOT_FOUND:
        code = error_code(exc)
        if code == "NoSuchBucket":
            return BucketNotFound(f"{url}: the bucket does not exist (check the URL and --endpoint-url)", url=url)
        return StorageNotFound(f"{url}: not found{hint}", url=url)
    if kind is Kind.DENIED and not url.startswith(("s3://", "s3a://")) and error_code(exc) is None:
        return AccessDenied(f"{url}: access denied ({cause(exc)}): check the credentials in the storage options (for hf://, the token)", url=url)
    if kind is Kind.DENIED:
        return AccessDenied(f"{url}: {explain_denied(fs, path, exc) if path else denied_message(exc)}", url=url)
    if kind is Kind.NO_CREDENTIALS:
        if _has_type(exc, "botocore", {"NoCredentialsError"}):
            return NoCredentials(f"{url}: {_NO_CREDENTIALS}", url=url)
        return NoCredentials(f"{url}: credentials incomplete or unusable ({exc}); check the AWS_* variables and --profile", url=url)
    if kind is Kind.INVALID:
        return StorageError(f"{url}: the store refused the request as invalid ({cause(exc)}); check the URL, --endpoint-url and the region", url=url)
    tries = f" after {attempts} {'try' if attempts == 1 else 'tries'} in {waited:.1f} s"
    if resets:
        tries += (
            f" ({resets} {'connection' if resets == 1 else 'connections'} reset after {cut_bytes} bytes in all, too few to count as"
            " progress: the server or a proxy between cuts every answer short)"
        )
    what = "check the endpoint URL and the network" if kind is not Kind.THROTTLED else "the store is overloaded: retry later"
    if kind is Kind.TIMEOUT:
        return StorageTimeout(f"{url}: {cause(exc)}{tries}; {what}", url=url, attempts=attempts, waited=waited, resets=resets)
    return StorageUnavailable(f"{url}: cannot reach storage: {cause(exc)}{tries}; {what}", url=url, attempts=attempts, waited=waited, resets=resets)


_KIND_OF_ERROR: dict[type, Kind] = {
    StorageNotFound: Kind.NOT_FOUND,
    BucketNotFound: Kind.NOT_FOUND,
    AccessDenied: Kind.DENIED,
    NoCredentials: Kind.NO_CREDENTIALS,
    StorageTimeout: Kind.TIMEOUT,
    StorageUnavailable: Kind.UNAVAILABLE,
}
