"""Storage access through fsspec: every byte shardstream writes, every listing, and every read
but S3's (which obstore makes, ``objects.py``, where it can: s3fs's path otherwise) goes from here.

Resolves a URL (local path, ``s3://``, ``memory://``, anything fsspec knows) to a filesystem with
the user's options (``storage_options``, ``--endpoint-url``, ``--profile``; the ``AWS_*``
environment variables are honoured by botocore itself), and adds what fsspec lacks: atomic publish
of a finished file and clear errors for a destination that is missing or refuses access.

Every filesystem made here follows ``StorageConfig`` (timeouts; for S3 botocore's standard retry
mode, which retries transient causes only, with ``upload_attempts`` tries and s3fs's own retry loop
off so tries do not multiply). Reads go through ``ranges.py``, which retries itself, and so does
a pack's destination check (``check_destination_writable``).
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from shardstream.errors import BucketNotFound, ConfigError, DestinationError, StorageNotFound
from shardstream.private import cached_s3_filesystems
from shardstream.redact import get_logger
from shardstream.storage.classify import classify, storage_error
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.retry import call

T = TypeVar("T")

logger = get_logger(__name__)


def make_storage_options(
    storage_options: Mapping[str, Any] | None = None,
    *,
    endpoint_url: str | None = None,
    profile: str | None = None,
) -> dict[str, Any]:
    """Merge CLI-style flags into fsspec storage options (explicit flags win)."""
    options = dict(storage_options or {})
    if endpoint_url:
        options["endpoint_url"] = endpoint_url
    if profile:
        options["profile"] = profile
    return options


def bound_options(url: str, storage_options: Mapping[str, Any] | None = None, config: StorageConfig = DEFAULT_STORAGE) -> dict[str, Any]:
    """``storage_options`` with ``config``'s policy written into them, as ``get_fs(url, options,
    config)`` applies it: for S3, botocore's standard retry mode with ``config.upload_attempts`` tries
    per request, and ``config``'s timeouts. A later ``get_fs(url, options)`` with no config (code
    that takes only storage options, such as ``write_manifest``) then follows ``config`` too, and
    gets the same cached filesystem. Options the user set explicitly win. (Uploads keep the full
    timeouts: the deadline, which reads' timeouts are cut to, does not bound them.)"""
    protocol = fsspec.utils.get_protocol(url)
    options = dict(storage_options or {})
    if protocol in ("file", "local"):
        return options
    if protocol in ("s3", "s3a"):
        config_kwargs = dict(options.get("config_kwargs") or {})
        config_kwargs.setdefault("retries", {"max_attempts": config.upload_attempts, "mode": "standard"})
        config_kwargs.setdefault("connect_timeout", config.connect_timeout)
        config_kwargs.setdefault("read_timeout", config.read_timeout)
        options["config_kwargs"] = config_kwargs
    return config.fs_options(options, protocol)


def get_fs(url: str, storage_options: Mapping[str, Any] | None = None, config: StorageConfig = DEFAULT_STORAGE):
    """Return ``(filesystem, path)`` for a URL; options only apply to remote protocols."""
    protocol = fsspec.utils.get_protocol(url)
    if protocol in ("file", "local"):
        return url_to_fs(url)
    if protocol == "hf" or url[:3].lower() == "hf:":
        require_hf(url)
    options = bound_options(url, storage_options, config)
    if protocol in ("s3", "s3a"):
        if "session" not in options:
            check_profile(options.get("profile"))
        # Every S3 filesystem shares the session, the readers' own too (their options already
        # carry a retry policy: before, those made a session, and parsed botocore's models, per
        # process: 0.4-0.8 s of each DataLoader worker's CPU).
        session = shared_s3_session(options)
        if session is not None:
            options["session"] = session
            options.pop("profile", None)  # the session carries it
        fs, path = url_to_fs(url, **options)
        fs.retries = 1  # botocore retries (transient causes only); s3fs's loop would multiply them
        return fs, path
    return url_to_fs(url, **options)


def aws_environment() -> tuple[tuple[str, str], ...]:
    """The ``AWS_*`` and ``REQUESTS_CA_BUNDLE`` variables: what a cached session or client depends on
    (one made under other credentials, profile, files or CA bundle is not reused)."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("AWS_", "REQUESTS_CA"))))


_profiles: dict[tuple, frozenset[str]] = {}


def check_profile(profile: str | None) -> None:
    """Raise ConfigError naming ``profile`` (or ``AWS_PROFILE``'s) and the files profiles are read
    from when neither holds it: botocore raised ProfileNotFound deep inside the first request, a
    traceback. The profiles are read once per set of ``AWS_*`` variables."""
    source = "profile"
    if not profile:
        profile, source = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE"), "AWS_PROFILE"
    if not profile:
        return
    key = aws_environment()
    known = _profiles.get(key)
    if known is None:
        import botocore.session

        known = _profiles[key] = frozenset(botocore.session.Session(profile=None).available_profiles)
    if profile not in known:
        files = f"{os.environ.get('AWS_CONFIG_FILE', '~/.aws/config')} and {os.environ.get('AWS_SHARED_CREDENTIALS_FILE', '~/.aws/credentials')}"
        raise ConfigError(
            f"AWS {source} {profile!r} not found: profiles are read from {files} (AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE), "
            f"which hold {', '.join(repr(p) for p in sorted(known)) or 'none'}"
        )


HF_FORM = "hf://datasets/ORG/NAME[/path]"
_HF_URL = re.compile(r"hf://datasets/(?P<org>[A-Za-z0-9][\w.-]*)/(?P<name>[A-Za-z0-9][\w.-]*)(@[^/]+)?(/.*)?")


def check_hf_url(url: str) -> None:
    """A ConfigError with the expected form when ``url`` is not a Hugging Face dataset's URL
    (``hf://datasets/ORG/NAME[/path]``, an optional ``@revision`` after the name)."""
    if not _HF_URL.fullmatch(url) or "/../" in url + "/" or url.endswith("/.."):
        raise ConfigError(f"{url!r} is not a Hugging Face dataset URL: the expected form is {HF_FORM}")


def check_url(url: str) -> None:
    """What can be said of a user's URL before anything is joined to it or read: an ``hf:`` URL
    must name a dataset (``check_hf_url``)."""
    if url[:3].lower() == "hf:":
        check_hf_url(url)


def require_hf(url: str) -> None:
    """``hf://`` URLs name a dataset (``check_hf_url``) and need huggingface_hub (its
    ``HfFileSystem`` registers the protocol): an optional extra."""
    import importlib.util

    check_hf_url(url)
    if importlib.util.find_spec("huggingface_hub") is None:
        raise ConfigError(f"{url}: hf:// URLs (the Hugging Face Hub) need huggingface_hub: pip install 'shardstream[hf]'")


@functools.cache
def _s3fs_args() -> frozenset[str]:
    """s3fs's own keyword arguments and fsspec's for its instance and listings caches, read from
    their signatures: options beyond these (and ``profile``) go to the botocore session s3fs makes,
    so a dataset with such options keeps a session of its own."""
    import inspect

    import s3fs
    from fsspec.dircache import DirCache

    names = set(inspect.signature(s3fs.S3FileSystem.__init__).parameters) | set(inspect.signature(DirCache.__init__).parameters)
    return frozenset(names - {"self", "args", "kwargs"}) | {"skip_instance_cache"}


_sessions: dict[tuple, Any] = {}
_sessions_lock = threading.Lock()


def shared_s3_session(options: Mapping[str, Any]):
    """One aiobotocore session per process, profile and AWS_* environment, shared by every S3
    filesystem made here.

    Making a client loads botocore's service models (a few hundred ms of JSON parsing); a session
    keeps them. DataLoader workers are forked after the main process has read the manifest, so
    they inherit a session that has them loaded: a worker's first request went from ~0.45 s to
    ~0.09 s (the former benchmarks/bench_s3.py). None when the options need a session of their own (one given,
    or session arguments this module does not know)."""
    if "session" in options or not set(options) <= _s3fs_args() | {"profile"}:
        return None
    profile = options.get("profile")
    key = (profile, aws_environment())  # (a rotated key, another profile or credentials file: another session)
    with _sessions_lock:
        session = _sessions.get(key)
        if session is None:
            import aiobotocore.session

            session = _sessions[key] = aiobotocore.session.AioSession(profile=profile)
        return session


def ready_s3_client(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Make in this process the s3fs client ``get_fs(url, storage_options)`` reads with, and nothing
    more (no request): before ``fork`` starts processes that read ``url`` through s3fs. Each child
    then starts from the shared session (``shared_s3_session``) with s3fs imported, botocore's
    service models parsed and the credentials resolved, where each child did all of that itself
    at its first read (0.7-1 s of CPU per worker, two workers at once on 2 cores: 3.1-3.5 s to a
    fresh process's first batch at 30 ms per request). Best effort: a failure is left to the
    children's first read, which meets it again and reports it as a read's error."""
    try:
        fs, _ = get_fs(url, storage_options)
        fs.connect()  # s3fs's client, on fsspec's loop: the session's models and credentials loaded here
    except Exception:  # noqa: BLE001 - the children meet it at their first read and say it there
        logger.debug("shardstream: no S3 client made ahead of the fork for %s", url, exc_info=True)


_inherited: list[Any] = []


def _stash_filesystems() -> None:
    """Before a fork: reference the S3 filesystems fsspec has cached, so a forked child (a
    DataLoader worker) keeps them and their finalizers never run there. fsspec clears its instance
    cache in the child; each dropped s3fs instance's finalizer then waits 0.1 s for the parent's
    event loop, which has no thread in the child (measured: 1-1.5 s of a worker's first batch on
    a dataset opened with a few option sets). Their connections are the parent's; the child never
    uses them. The parent drops the references again right after the fork."""
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        _inherited[:] = cached_s3_filesystems(s3fs)


def _unstash_filesystems() -> None:
    _inherited.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_stash_filesystems, after_in_parent=_unstash_filesystems)


def is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)


def join(base: str, *parts: str) -> str:
    """Join URL/path parts with '/', keeping the protocol prefix intact."""
    return posixpath.join(base.rstrip("/") if base not in ("/",) else base, *parts)


def full_url(fs, path: str) -> str:
    """The user-facing URL of a path on fs (``s3://b/k`` rather than ``b/k``)."""
    if is_local(fs):
        return path
    return fs.unstrip_protocol(path)


def publish_file(fs, local_tmp: str, dest_path: str) -> None:
    """Make a finished local file visible under its final name, atomically.

    Local: rename within the destination directory (the temp file is created there).
    Remote: one upload; S3 makes an object visible only when its PUT or multipart upload
    completes, so a crash never leaves a truncated object under the final name.
    """
    if is_local(fs):
        os.replace(local_tmp, dest_path)
        return
    try:
        fs.put_file(local_tmp, dest_path)
    except Exception as exc:
        raise destination_error(full_url(fs, dest_path), exc) from exc
    finally:
        try:
            os.unlink(local_tmp)
        except FileNotFoundError:
            pass


def write_bytes_atomic(fs, dest_path: str, data: bytes) -> None:
    """Write a small file (the manifest) so that it appears whole or not at all."""
    if is_local(fs):
        tmp = f"{dest_path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest_path)
        return
    try:
        fs.pipe_file(dest_path, data)
    except Exception as exc:
        raise destination_error(full_url(fs, dest_path), exc) from exc


def destination_error(url: str, exc: BaseException) -> BaseException:
    """A storage failure while writing ``url`` as a DestinationError (a bug stays itself)."""
    if classify(exc) is None:
        return exc
    err = storage_error(url, exc)
    if isinstance(err, StorageNotFound) and not isinstance(err, BucketNotFound):
        return DestinationError(f"cannot write {url}: bucket or path does not exist")
    return DestinationError(f"cannot write {err}")


def check_destination_writable(fs, path: str, *, storage_options: Mapping[str, Any] | None = None, config: StorageConfig = DEFAULT_STORAGE) -> None:
    """Fail early and clearly when a remote destination's bucket is missing or refuses access.

    ``fs`` is the destination's filesystem (``get_fs``) and ``storage_options`` the options it was
    made with. The check is one listing of the bucket under shardstream's retry policy
    (``storage_call``: a filesystem of the same options that makes one try per call, as for
    reads, and ``retry.call`` around it): a permanent failure (no such bucket,
    denied, no credentials) fails at once, a transient one (refused, timeout, 5xx, throttling) is
    retried with backoff until ``config.deadline`` (and ``config.max_attempts``, if set), and the error
    says how many tries were made in how long."""
    if is_local(fs):
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise DestinationError(f"{path}: not writable")
        return
    bucket = path.split("/", 1)[0]
    url = full_url(fs, bucket)
    try:
        storage_call(url, lambda probe, bucket_path: probe.ls(bucket_path, refresh=True), storage_options, config, bounded=True)
    except Exception as exc:
        raise destination_error(url, exc) from exc


def storage_call(
    url: str,
    fn: Callable[[Any, str], T],
    storage_options: Mapping[str, Any] | None = None,
    config: StorageConfig = DEFAULT_STORAGE,
    *,
    bounded: bool = False,
) -> T:
    """``fn(fs, path)`` for ``url`` under ``config``. On remote storage ``fs`` makes one try per
    call (botocore's retries off, ``config``'s timeouts: ``StorageConfig.fs_options``) and the call
    runs under shardstream's retry policy (``retry.call``): a transient failure (refused, timeout,
    5xx, throttling) is retried with backoff until ``config.deadline`` (and ``config.max_attempts``,
    if set), a permanent one fails at once, and either becomes a StorageError naming ``url``, the
    cause, and the tries and time it took (a missing object: ``StorageNotFound``, a
    FileNotFoundError). ``bounded``: ``fn`` is a listing or a HEAD, each try waited for no longer
    than the deadline's time left (``retry.call``). Local paths: ``fn`` runs once, its errors as they are."""
    began = time.monotonic()
    fs, path = get_fs(url, config.fs_options(storage_options, fsspec.utils.get_protocol(url)), config)
    if is_local(fs):
        return fn(fs, path)
    return call(url, lambda: fn(fs, path), config=config, fs=fs, path=path, began=began, bounded=bounded)


GLOB_CHARS = "*?["


def expand_urls(pattern: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """A brace pattern, a glob, or a single URL -> sorted shard URLs (existing files only for globs)."""
    import braceexpand

    urls: list[str] = []
    for url in braceexpand.braceexpand(pattern):
        if any(c in url for c in GLOB_CHARS):
            fs, path = get_fs(url, storage_options)
            urls += [full_url(fs, p) for p in sorted(fs.glob(path))]
        else:
            urls.append(url)
    return urls


def expand_retried(pattern: str, storage_options: Mapping[str, Any] | None = None, config: StorageConfig = DEFAULT_STORAGE) -> list[str]:
    """``expand_urls`` under ``config``'s retry policy (a glob lists storage: ``storage_call``)."""
    one_try = config.fs_options(storage_options, fsspec.utils.get_protocol(pattern))
    return storage_call(pattern, lambda fs, path: expand_urls(pattern, one_try), storage_options, config, bounded=True)
