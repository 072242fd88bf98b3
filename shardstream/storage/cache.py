"""A local shard cache for multi-epoch training from remote storage.

Shards read from S3 (or any remote store) are downloaded whole into ``cache_dir`` and read from
there by later epochs. Several DataLoader workers and several ranks on one node may share one
cache directory:

- a fill happens under an exclusive lock on ``<name>.lock``: one process downloads, the others
  wait on the lock and then find the file (no duplicate downloads);
- a fill is atomic: it is written to a temporary name, checked against the manifest's sha256
  (``verify=True``) and renamed, so a partial file is never visible;
- readers hold a shared lock on the shard's lock file while they read it; eviction (least
  recently used first, by modification time, touched on every use) skips shards whose lock it
  cannot take, so it never removes a shard that is being read;
- when the shards being read leave no room under the limit, the read bypasses the cache
  (streams from storage, counted as ``cache_bypass``) instead of waiting; a limit smaller than
  the largest shard is a ConfigError at construction.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

from shardstream.errors import ChecksumError, ConfigError, StorageError
from shardstream.stats import NullCounters

logger = logging.getLogger(__name__)

_SUFFIX = ".tar"


class ShardCache:
    def __init__(self, cache_dir: str, limit_bytes: int, *, verify: bool = True):
        self.dir = os.path.abspath(cache_dir)
        self.limit = int(limit_bytes)
        self.verify = verify
        os.makedirs(self.dir, exist_ok=True)

    def check_fits(self, largest_shard: int, url: str) -> None:
        if largest_shard > self.limit:
            raise ConfigError(
                f"cache_limit {self.limit} bytes is smaller than shard {url} ({largest_shard} bytes): "
                f"raise cache_limit to at least {largest_shard} (better: several shards per worker)"
            )

    def name(self, url: str, sha256: str | None, size: int) -> str:
        ident = sha256 or hashlib.sha256(f"{url}:{size}".encode()).hexdigest()
        return os.path.join(self.dir, ident[:40] + _SUFFIX)

    def open(self, url: str, sha256: str | None, size: int, download: Callable[[Callable[[bytes], None]], None],
             counters: Any = None) -> tuple[Any, Any] | None:
        """Return ``(file, lock)`` for the cached shard, filling it first if needed; None to bypass.

        ``download(write)`` streams the shard's bytes into ``write``. The caller reads ``file``
        and must call ``release(file, lock)``.
        """
        counters = counters or NullCounters()
        path = self.name(url, sha256, size)
        lock = open(path[: -len(_SUFFIX)] + ".lock", "a+b")
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)
            if os.path.exists(path):
                counters.add("cache_hits")
                return self._use(path, lock)
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_EX)  # one filler; the others wait here, then hit
            if os.path.exists(path):
                fcntl.flock(lock, fcntl.LOCK_SH)  # downgrade
                counters.add("cache_hits")
                return self._use(path, lock)
            counters.add("cache_misses")
            if not self._make_room(size, keep=path):
                fcntl.flock(lock, fcntl.LOCK_UN)
                lock.close()
                counters.add("cache_bypass")
                logger.warning("cache %s full of shards in use: reading %s from storage", self.dir, url)
                return None
            self._fill(path, url, sha256, size, download)
            fcntl.flock(lock, fcntl.LOCK_SH)  # downgrade: readers welcome, evictors not
            return self._use(path, lock)
        except BaseException:
            lock.close()
            raise

    def _use(self, path: str, lock: Any) -> tuple[Any, Any]:
        os.utime(path)  # least recently used = oldest mtime
        return open(path, "rb", buffering=0), lock

    @staticmethod
    def release(file: Any, lock: Any) -> None:
        file.close()
        lock.close()  # closing drops the flock

    def _fill(self, path: str, url: str, sha256: str | None, size: int, download) -> None:
        tmp = f"{path}.partial-{uuid.uuid4().hex[:8]}"
        digest = hashlib.sha256()
        written = 0
        try:
            with open(tmp, "wb") as f:
                def write(chunk: bytes) -> None:
                    nonlocal written
                    digest.update(chunk)
                    f.write(chunk)
                    written += len(chunk)

                download(write)
            if written != size:
                raise StorageError(f"{url}: downloaded {written} bytes, the manifest says {size}")
            if self.verify and sha256 and digest.hexdigest() != sha256:
                raise ChecksumError(url, digest.hexdigest(), sha256)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _make_room(self, incoming: int, keep: str) -> bool:
        """Evict least recently used shards not in use until ``incoming`` fits; False if it cannot."""
        entries = []
        total = 0
        for name in os.listdir(self.dir):
            if name.endswith(_SUFFIX):
                full = os.path.join(self.dir, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, full))
                total += st.st_size
            elif ".partial-" in name:
                try:
                    total += os.stat(os.path.join(self.dir, name)).st_size  # fills in progress count too
                except FileNotFoundError:
                    pass
        for _, size, full in sorted(entries):
            if total + incoming <= self.limit:
                break
            if full == keep:
                continue
            with open(full[: -len(_SUFFIX)] + ".lock", "a+b") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # being read or filled: never evicted
                try:
                    os.unlink(full)
                    total -= size
                except FileNotFoundError:
                    pass
        return total + incoming <= self.limit
