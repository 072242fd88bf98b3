"""Secrets kept out of what shardstream prints: reprs and its own log records.

``mask_options`` is a copy of a storage-options mapping (nested ones too) whose credential fields
(``key``, ``secret``, ``token``, ``session_token``, ``password``, ``access_key_id``, ...) are
masked: an access key id keeps its first 4 characters (which key, not the key), anything else
becomes ``***``. ``redact`` masks the secrets a text may carry: SigV4 signatures (an
``Authorization`` header, ``X-Amz-Signature=`` in a presigned URL), session tokens, a
``Bearer`` token, the password of a ``scheme://user:password@host`` URL. ``RedactSecrets``, the
filter on every shardstream logger that could meet them, rewrites a record's message (and its
traceback) through ``redact`` before any handler sees it.

botocore's and s3fs's own loggers are theirs: docs/storage.md says how to keep them quiet.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
# fields that hold a secret (masked whole) and fields that name a key (first 4 characters kept)
_SECRET = re.compile(r"secret|token|password|passwd|credential|signature|api_?key|private", re.I)
_KEY_ID = frozenset({"key", "access_key", "access_key_id", "aws_access_key_id", "account_key"})


def mask(value: Any, keep: int = 0) -> str:
    """``value`` masked: ``***``, or its first ``keep`` characters and ``***``."""
    text = str(value)
    return (text[:keep] + MASK) if keep and len(text) > 2 * keep else MASK


def is_secret_field(name: str) -> bool:
    return bool(_SECRET.search(name)) or name.lower() in _KEY_ID


def mask_options(options: Any) -> Any:
    """A copy of ``options`` (a mapping, or lists/tuples of them) with every credential field masked."""
    if isinstance(options, Mapping):
        out: dict[Any, Any] = {}
        for name, value in options.items():
            if isinstance(name, str) and value is not None and not isinstance(value, bool) and is_secret_field(name):
                out[name] = mask(value, 4 if name.lower() in _KEY_ID else 0)
            else:
                out[name] = mask_options(value)
        return out
    if isinstance(options, (list, tuple)):
        return type(options)(mask_options(v) for v in options)
    return options


_PATTERNS = (
    # SigV4: the signature, in a header or a presigned URL's query, and the credential's key id
    (re.compile(r"(?i)(signature\s*[=:]\s*)[0-9a-zA-Z+/=%_-]+"), r"\1" + MASK),
    (re.compile(r"(?i)(credential\s*[=:]\s*)([A-Z0-9]{4})[A-Z0-9]*"), r"\1\2" + MASK),
    (re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?)(?:AWS4-HMAC-SHA256\s+)?[^'\",\r\n]+"), r"\1" + MASK),
    (re.compile(r"(?i)(x-amz-security-token['\"]?\s*[:=]\s*['\"]?)[^'\"&\s,]+"), r"\1" + MASK),
    (re.compile(r"(?i)(bearer\s+)[0-9a-zA-Z._~+/=-]+"), r"\1" + MASK),
    # option-like text: secret='...', "token": "...", password=...
    (
        re.compile(r"(?i)(['\"]?\b(?:aws_)?(?:secret(?:_access)?_key|secret|session_token|token|password)['\"]?\s*[:=]\s*['\"]?)[^'\"\s,}&]+"),
        r"\1" + MASK,
    ),
    # scheme://user:password@host
    (re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)[^/\s@]+@"), r"\1" + MASK + "@"),
)


def redact(text: str) -> str:
    """``text`` with every secret it carries masked (see the module docstring)."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactSecrets(logging.Filter):
    """A logger filter: each record's message, and its traceback's text, through ``redact``."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not fit its format: left as it is
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


_FILTER = RedactSecrets()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with ``RedactSecrets`` on it (once)."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


def masked_repr(self: Any) -> str:
    """A dataclass's repr with its credential fields masked (``mask_options`` over every field):
    ``__repr__ = masked_repr`` in a class that holds storage options."""
    import dataclasses

    shown = ", ".join(f"{f.name}={mask_options(getattr(self, f.name))!r}" for f in dataclasses.fields(self) if f.repr)
    return f"{type(self).__qualname__}({shown})"
