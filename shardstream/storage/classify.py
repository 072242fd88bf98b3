"""What a storage failure means: permanent (fail at once, saying what to check), transient
(retry with backoff), or throttling; and words for a refused request.

The one place that reads storage exceptions: s3fs and botocore errors are classified by their
error code or exception type where they carry one, by their text only as a last resort.
"""

from __future__ import annotations

from shardstream.errors import StorageError

_PERMANENT_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
_PERMANENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "ParamValidationError", "NoRegionError"}
_PERMANENT_WORDS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "NoSuchBucket", "NoSuchKey", "InvalidBucketName")
_THROTTLE_WORDS = ("SlowDown", "reduce your request rate", "Throttl", "TooManyRequests", "429", "503")


_DENIED = (
    ("InvalidAccessKeyId", "the access key ID is not known to this endpoint (check AWS_ACCESS_KEY_ID, --profile and --endpoint-url)"),
    ("SignatureDoesNotMatch", "the secret key does not match the access key ID (check AWS_SECRET_ACCESS_KEY or the profile's secret)"),
    ("ExpiredToken", "the session token has expired (refresh the credentials)"),
    ("InvalidToken", "the session token is not valid (check AWS_SESSION_TOKEN or the profile)"),
)
_DENIED_DEFAULT = "access denied: these credentials may not do this (check the IAM or bucket policy, --profile and --endpoint-url)"


def error_code(exc: BaseException) -> str:
    """The S3 error code behind an exception (s3fs wraps botocore's ClientError), or its text."""
    seen = set()
    texts = []
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            if code:
                return str(code)
        texts.append(str(cur))
        cur = cur.__cause__ or cur.__context__
    return " ".join(texts)


def denied_message(exc: BaseException) -> str:
    """What a 403 means, in words that say what to check: unknown key, wrong secret, expired token
    or missing permission."""
    code = error_code(exc)
    for word, message in _DENIED:
        if word in code:
            return message
    return _DENIED_DEFAULT


def explain_denied(fs, path: str, exc: BaseException) -> str:
    """``denied_message`` for a refused request on ``path``; a HEAD's 403 has no body to say why,
    so ask again with a one-byte ranged GET, whose error carries the code."""
    code = error_code(exc)
    if code == "403" or "Forbidden" in code:
        try:
            fs.cat_file(path, start=0, end=1)
        except PermissionError as detailed:
            exc = detailed
        except Exception:  # noqa: BLE001 - the first answer stands
            pass
    return denied_message(exc)


def is_permanent(exc: BaseException) -> bool:
    if isinstance(exc, _PERMANENT_TYPES) or type(exc).__name__ in _PERMANENT_NAMES:
        return True
    text = str(exc)
    return any(word in text for word in _PERMANENT_WORDS)


def is_transient(exc: BaseException) -> bool:
    """Network and server trouble worth retrying; programming errors are not."""
    if isinstance(exc, (OSError, EOFError, TimeoutError)):
        return True
    module = type(exc).__module__.split(".", 1)[0]
    return module in ("aiohttp", "botocore", "aiobotocore", "urllib3", "asyncio", "s3fs")


def is_throttle(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return any(word in text for word in _THROTTLE_WORDS)


def permanent_error(url: str, exc: BaseException) -> StorageError:
    if isinstance(exc, FileNotFoundError) or "NoSuchKey" in str(exc):
        return StorageError(f"{url}: not found (it is listed in the manifest: was it deleted or moved?)")
    if "NoSuchBucket" in str(exc):
        return StorageError(f"{url}: the bucket does not exist (check the URL and --endpoint-url)")
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return StorageError(f"{url}: no credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or --profile)")
    return StorageError(f"{url}: {denied_message(exc)}")


