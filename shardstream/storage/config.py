"""StorageConfig: the one storage policy every request shardstream makes follows (manifest,
shards, scan/index, verify, pack uploads), as one frozen option group.

Timeouts bound each try; ``deadline`` bounds one request across its retries and each of its
tries (a try's timeouts are cut to the time left; a read that makes real progress, 64 KiB or a
sixteenth of its range since it last started (``retry.real_progress``), starts afresh), so a
dead or stalled endpoint fails within about ``deadline`` seconds (60 by default) with a message
naming the URL, the cause and the time waited. Transient causes (throttling, timeouts, refused
or reset connections, 5xx) are retried with full-jitter backoff until the deadline, whatever
their number (``max_attempts``, None by default, can cap the tries too); a missing object, a
refusal (403), missing credentials or a malformed request fail at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardstream.errors import ConfigError


@dataclass(frozen=True)
class StorageConfig:
    """How shardstream talks to storage.

    connect_timeout  seconds to open a connection (per try; cut to the deadline's time left)
    read_timeout     seconds the server may stay silent while answering (per try; cut likewise)
    deadline         seconds one request may take across all its tries before it fails
    max_attempts     None: tries until the deadline; a number caps the tries per request too
                     (1 = no retry). Uploads (botocore's own retries) make this many, 8 if None
    backoff_base     first backoff in seconds; doubles per try, full jitter
    backoff_cap      longest backoff in seconds
    allow_roots      URL prefixes a manifest's shard entries may point into besides the
                     manifest's own directory (datasets that span buckets); empty = only its root
    s3_client        "obstore" (the default): S3 reads (shard bytes, the manifest, sidecars, a
                     size) through obstore (``storage/objects.py``); "s3fs": through
                     s3fs/aiobotocore. Options obstore cannot honour (a custom session, SSE-C,
                     ``version_aware``, proxies) and fork-started workers of a process that
                     read S3 use s3fs regardless. (Replaces ``direct_get``.)
    max_manifest_bytes  the largest manifest (``index.json``) read, in bytes; a larger one is a
                     ManifestError naming its size (128 MiB: a version-2 manifest takes about 106
                     bytes per shard, a million shards about 101 MiB; parsing one takes about 5
                     times its size in memory: a 300 MB manifest took 1.4 GB)
    """

    connect_timeout: float = 10.0
    read_timeout: float = 20.0
    deadline: float = 60.0
    max_attempts: int | None = None
    backoff_base: float = 0.05
    backoff_cap: float = 5.0
    allow_roots: tuple[str, ...] = ()
    s3_client: str = "obstore"
    max_manifest_bytes: int = 128 << 20

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout", "deadline"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"StorageConfig.{name} must be a positive number of seconds, got {value!r}")
        if self.max_attempts is not None and not (isinstance(self.max_attempts, int) and self.max_attempts >= 1):
            raise ConfigError(f"StorageConfig.max_attempts must be None (until the deadline) or an integer >= 1, got {self.max_attempts!r}")
        if self.s3_client not in ("obstore", "s3fs"):
            raise ConfigError(f"StorageConfig.s3_client must be 'obstore' or 's3fs', got {self.s3_client!r}")
        if not (isinstance(self.max_manifest_bytes, int) and self.max_manifest_bytes >= 1):
            raise ConfigError(f"StorageConfig.max_manifest_bytes must be a positive number of bytes, got {self.max_manifest_bytes!r}")
        if self.backoff_base < 0 or self.backoff_cap < 0:
            raise ConfigError("StorageConfig.backoff_base and backoff_cap must be >= 0")
        if isinstance(self.allow_roots, str):
            raise ConfigError("StorageConfig.allow_roots is a sequence of URL prefixes, not one string")
        object.__setattr__(self, "allow_roots", tuple(self.allow_roots))

    @property
    def upload_attempts(self) -> int:
        """Tries per upload, made by botocore's standard retry mode (the deadline does not bound
        them): ``max_attempts``, or 8 when it is None."""
        return self.max_attempts if self.max_attempts is not None else UPLOAD_ATTEMPTS

    def fs_options(self, storage_options: Mapping[str, Any] | None, protocol: str) -> dict[str, Any]:
        """fsspec options carrying this policy: for S3, botocore's timeouts and one try per call
        (retries happen in ``retry.py``, where they are counted and bounded by the deadline); for
        HTTP(S), aiohttp's connect and read timeouts. The timeouts are cut to the deadline, so that
        one try of a call that cannot be given the time left (a HEAD, a listing) still ends within it.
        Options the user set explicitly win."""
        merged = dict(storage_options or {})
        connect, read = min(self.connect_timeout, self.deadline), min(self.read_timeout, self.deadline)
        if protocol in ("s3", "s3a"):
            config = dict(merged.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
            config.setdefault("connect_timeout", connect)
            config.setdefault("read_timeout", read)
            merged["config_kwargs"] = config
        elif protocol in ("http", "https") and "timeout" not in (merged.get("client_kwargs") or {}):
            import aiohttp  # fsspec's HTTP filesystem; aiohttp comes with s3fs

            client = dict(merged.get("client_kwargs") or {})
            client["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=read)
            merged["client_kwargs"] = client
        return merged


UPLOAD_ATTEMPTS = 8  # botocore's tries per upload when max_attempts is None
DEFAULT_STORAGE = StorageConfig()
