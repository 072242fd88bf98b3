"""The exceptions shardstream raises, as one tree.

    ShardstreamError                 every error shardstream raises on purpose
    ├── ConfigError                  options that cannot work (also a ValueError)
    ├── SourceError                  bad pack input: unreadable file, malformed line, key clash, a
    │                                reference leaving the source; a table's duplicate or reserved column
    ├── DestinationError             pack destination missing, refusing access, or not empty
    ├── ManifestError                index.json missing, not JSON, inconsistent, or reaching outside its root
    ├── StateError                   a resume state from another dataset, seed, mode or version
    ├── StorageError                 an object cannot be opened or read (its url attribute names it)
    │   ├── StorageNotFound          no such object or bucket (also a FileNotFoundError)
    │   │   └── BucketNotFound       the bucket itself does not exist
    │   ├── AccessDenied             the store refused these credentials (also a PermissionError)
    │   ├── NoCredentials            no credentials found where botocore looks for them
    │   ├── StorageUnavailable       a transient cause that outlasted the retries: refused, DNS,
    │   │   │                        TLS, reset, 5xx/throttling (``.attempts``, ``.waited``, ``.resets``)
    │   │   └── StorageTimeout       no answer within the timeouts/deadline (also a TimeoutError)
    │   └── ChecksumError            a shard's bytes do not match the manifest's sha256
    ├── ShardFormatError             bytes that are not a valid tar shard (names URL and offset)
    ├── SampleError                  a sample that cannot be decoded (names URL, key and field)
    ├── TooManyErrors                on_error="skip" gave up: failures ran past the tolerance,
    │                                or a worker could read no sample at all
    ├── WorkerTimeout                a DataLoader worker sent no batch within the loader's bound
    │                                (names rank, worker, pid and its last step; also a TimeoutError)
    └── WorkerDied                   a DataLoader worker exited: killed by a signal (OOM, segfault)
                                     or an exit code (names rank, worker, pid, signal, last step;
                                     also a RuntimeError)

A storage error met while reading a manifest (or a mix file) is raised as both: a ManifestError
(a ConfigError) and the storage class of its cause, such as ``ManifestAccessDenied`` (``restated``
below); either ``except`` catches it.

Each message says what is wrong and where (path, line, shard URL, byte offset), so a user can
act on it without a traceback. Callers catch the classes, never match message text. Every class
is importable from ``shardstream`` and from ``shardstream.errors``.

Every class can be rebuilt from its message alone (``cls(str(exc))``): that is how pickling
and PyTorch's DataLoader hand a worker's exception to the training loop, so the loop sees the
same type the worker raised. Structured fields (``url``, ``offset``, ...) are then None.
"""

from __future__ import annotations


class ShardstreamError(Exception):
    """Base class of every error shardstream raises on purpose."""


class ConfigError(ShardstreamError, ValueError):
    """Options that cannot work together; raised at construction."""


class SourceError(ShardstreamError):
    """A pack source item cannot be turned into a sample."""

    def __init__(self, where: str, what: str | None = None):
        self.where = where
        self.what = what if what is not None else where
        super().__init__(where if what is None else f"{where}: {what}")


class DestinationError(ShardstreamError):
    """The pack destination cannot be written as asked."""


class ManifestError(ShardstreamError):
    """A manifest that cannot be trusted."""


class StateError(ShardstreamError, ValueError):
    """A resume state that does not fit this dataset or this shardstream (says which field differs)."""


class StorageError(ShardstreamError):
    """An object (shard or manifest) that cannot be opened or read; ``url`` names it."""

    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(message)
        self.url = url


class StorageNotFound(StorageError, FileNotFoundError):
    """No such object or bucket."""


class AccessDenied(StorageError, PermissionError):
    """The store refused the request with these credentials."""


class NoCredentials(StorageError):
    """No credentials were found (environment, profile files, instance metadata)."""


class StorageUnavailable(StorageError):
    """A transient failure that lasted through every retry; ``resets``: how many of those tries
    were connections cut after too few bytes to count as progress."""

    def __init__(self, message: str, *, url: str | None = None, attempts: int = 0, waited: float = 0.0, resets: int = 0):
        super().__init__(message, url=url)
        self.attempts = attempts
        self.waited = waited
        self.resets = resets


class StorageTimeout(StorageUnavailable, TimeoutError):
    """The store did not answer within the connect/read timeouts or the deadline."""


class ChecksumError(StorageError):
    """A shard whose bytes do not hash to the sha256 the manifest recorded."""

    def __init__(self, url: str, actual: str | None = None, expected: str | None = None):
        self.actual = actual
        self.expected = expected
        if actual is None:  # rebuilt from its message
            super().__init__(url)
            return
        super().__init__(
            f"{url}: sha256 {actual} does not match the manifest's {expected} (the shard changed after it was packed, or is corrupt)", url=url
        )


class ShardFormatError(ShardstreamError):
    """Bytes that are not a valid tar shard."""

    def __init__(self, url: str, offset: int | None = None, what: str | None = None):
        self.url: str | None = url if what is not None else None
        self.offset = offset
        self.what = what
        super().__init__(url if what is None else f"{url} at byte {offset}: {what}")


class SampleError(ShardstreamError):
    """A sample that cannot be decoded or lacks a required field (names the shard URL and key)."""

    def __init__(self, url: str, key: str | None = None, what: str | None = None):
        self.url: str | None = url if what is not None else None
        self.key = key
        self.what = what
        super().__init__(url if what is None else f"{url}, sample {key!r}: {what}")


class TooManyErrors(ShardstreamError):
    """Skipping gave up: the data or the decoders are likely broken, not a sample here and there."""


class WorkerTimeout(ShardstreamError, TimeoutError):
    """A DataLoader worker sent no batch within ``make_loader``'s ``timeout`` (or ``first_batch_timeout``):
    the message names the rank, the worker, its pid and the last thing it was seen doing."""


class WorkerDied(ShardstreamError, RuntimeError):
    """A DataLoader worker exited while the loop waited on it (killed by a signal: the OOM killer's
    SIGKILL, a SIGSEGV in native code; or an exit code): the message names the rank, the worker,
    its pid, the signal or code and its last step. Also a RuntimeError, as DataLoader's own
    "exited unexpectedly" was. ``worker``, ``pid`` and ``exitcode`` (negative:
    the signal's number, as multiprocessing gives it) are None when rebuilt from the message."""

    def __init__(self, message: str, *, worker: int | None = None, pid: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.worker, self.pid, self.exitcode = worker, pid, exitcode


class BucketNotFound(StorageNotFound):
    """The bucket itself does not exist (S3's NoSuchBucket): a typo in the URL, or another endpoint
    or account than the one that holds it. Raised by ``storage.classify.storage_error``."""


# -- a storage error met while doing something with its own contract -----------------------------
# Reading a manifest can fail for any storage cause; the caller of ``ShardStream(...)`` or
# ``load_manifest`` catches either the contract of the step (ManifestError) or the cause's class
# (AccessDenied, StorageNotFound, NoCredentials, ...), as errors.md documents. The error raised is
# both: a class per (step, cause), made here once, at import, so pickling (and DataLoader's hand-off
# of a worker's exception) finds it by name in this module.
_STORAGE_CLASSES: tuple[type[StorageError], ...] = (
    StorageError,
    StorageNotFound,
    BucketNotFound,
    AccessDenied,
    NoCredentials,
    StorageUnavailable,
    StorageTimeout,
    ChecksumError,
)
_BOTH: dict[tuple[type[ShardstreamError], type[StorageError]], type[StorageError]] = {}


def _make_both(step: type[ShardstreamError], cause: type[StorageError]) -> type[StorageError]:
    prefix = step.__name__.removesuffix("Error")
    name = prefix + cause.__name__  # ManifestAccessDenied, ConfigStorageNotFound, ...
    cls = type(
        name,
        (step, cause),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{cause.__name__} met while reading what a {step.__name__} is about: both classes catch it.",
        },
    )
    globals()[name] = cls
    return cls


for _step in (ManifestError, ConfigError):
    for _cause in _STORAGE_CLASSES:
        _BOTH[(_step, _cause)] = _make_both(_step, _cause)
del _step, _cause


def restated(cause: StorageError, message: str, step: type[ShardstreamError] | None = None) -> StorageError:
    """``cause`` said as ``message``: an error of ``cause``'s own storage class (its ``url``,
    ``attempts``, ... kept) that is also a ``step`` error when given (``ManifestError`` while a manifest
    is read; ``ConfigError`` for a mix file), so ``except AccessDenied`` and ``except ManifestError``
    both catch it. A storage class of someone else's (a subclass made elsewhere) keeps its nearest
    documented class."""
    base = next(c for c in type(cause).__mro__ if c in _STORAGE_CLASSES)
    cls = _BOTH[(step, base)] if step is not None else base
    exc = cls(message)
    exc.__dict__.update(cause.__dict__)
    return exc
