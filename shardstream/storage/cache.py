"""A local shard cache for multi-epoch training from remote storage.

Shards read from S3 (or any remote store) are downloaded whole into ``cache_dir`` and read from
there by later epochs. Several DataLoader workers and several ranks on one node may share one
cache directory:

- a fill happens under an exclusive lock on ``<name>.lock``: one process downloads, the others
  wait on the lock and then find the file (no duplicate downloads);
- a fill is atomic and durable: it is written to a temporary name, checked against the manifest's
  sha256 (``verify=True``), fsync'ed, renamed, and the directory fsync'ed, so a partial file is
  never visible, and a power loss cannot leave an empty or short file under the final name;
- every hit checks the file's size against the manifest's (a file damaged after its fill, e.g. cut
  short by a crash of the host or by hand, is dropped and fetched again, with a warning; the
  refetch counts as a ``cache_misses``), so only a fill pays for the hash;
- readers hold a shared lock on the shard's lock file while they read it; eviction (least
  recently used first, by modification time, touched on every use) skips shards whose lock it
  cannot take, so it never removes a shard that is being read;
- the limit is a hard bound on the bytes on disk at every moment, across processes: room is
  made and reserved under an exclusive lock on ``.cache.lock`` in the directory, and a fill's
  partial file is allocated at the shard's full size before any byte is downloaded, so the
  directory never holds more than ``limit`` bytes of shards and partials;
- a partial file left by a process that died (kill -9, OOM) is reclaimed: its shard's lock is
  free once its writer is gone, so it is removed at start and whenever room is made; a reader
  never waits on a dead writer (the kernel drops a dead process's flock);
- when the shards being read leave no room under the limit, or the disk is full (ENOSPC,
  EDQUOT: one warning, the partial removed), the read bypasses the cache (streams from storage,
  counted as ``cache_bypass``) instead of waiting or failing; a limit smaller than the largest
  shard is a ConfigError at construction.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

from shardstream.errors import ChecksumError, ConfigError, ShardFormatError, StorageError
from shardstream.stats import NullCounters

logger = logging.getLogger(__name__)

_SUFFIX = ".tar"
_PARTIAL = ".partial-"
_DIR_LOCK = ".cache.lock"
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


class ShardCache:
    def __init__(self, cache_dir: str, limit_bytes: int, *, verify: bool = True):
        self.dir = os.path.abspath(cache_dir)
        self.limit = int(limit_bytes)
        self.verify = verify
        self._warned_full = False
        os.makedirs(self.dir, exist_ok=True)
        with self._dir_locked():
            self._reclaim_partials()

    def _dir_locked(self):
        """The directory-wide lock under which bytes on disk are counted and reserved."""
        return _FileLock(os.path.join(self.dir, _DIR_LOCK))

    def _reclaim_partials(self) -> int:
        """Remove partial files whose writer is gone (their shard lock is free); returns bytes freed."""
        freed = 0
        for name in os.listdir(self.dir):
            if _PARTIAL not in name:
                continue
            full = os.path.join(self.dir, name)
            with open(full.split(_PARTIAL)[0][: -len(_SUFFIX)] + ".lock", "a+b") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live process is filling it
                try:
                    freed += os.stat(full).st_size
                    os.unlink(full)
                    logger.info("cache %s: removed %s left by a process that died", self.dir, name)
                except FileNotFoundError:
                    pass
        return freed

    def check_fits(self, shards: list[tuple[int, str]]) -> None:
        """``shards`` as (bytes, url). Shards larger than the limit are streamed, not cached (one
        warning); a limit smaller than every shard makes the cache useless: a ConfigError."""
        if not shards:
            return
        smallest, url = min(shards)
        if smallest > self.limit:
            raise ConfigError(
                f"cache_limit {self.limit} bytes is smaller than shard {url} ({smallest} bytes), the smallest: "
                f"raise cache_limit to at least {max(shards)[0]} (better: several shards per worker)"
            )
        too_big = [u for size, u in shards if size > self.limit]
        if too_big:
            logger.warning(
                "cache %s: %d shards are larger than cache_limit %d bytes and will be streamed, not cached (e.g. %s)",
                self.dir,
                len(too_big),
                self.limit,
                too_big[0],
            )

    def name(self, url: str, sha256: str | None, size: int) -> str:
        ident = sha256 or hashlib.sha256(f"{url}:{size}".encode()).hexdigest()
        return os.path.join(self.dir, ident[:40] + _SUFFIX)

    def open(
        self, url: str, sha256: str | None, size: int, download: Callable[[Callable[[bytes], None]], None], counters: Any = None
    ) -> tuple[Any, Any] | None:
        """Return ``(file, lock)`` for the cached shard, filling it first if needed; None to bypass.

        ``download(write)`` streams the shard's bytes into ``write``. The caller reads ``file``
        and must call ``release(file, lock)``.
        """
        counters = counters or NullCounters()
        path = self.name(url, sha256, size)
        lock = open(path[: -len(_SUFFIX)] + ".lock", "a+b")
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)
            hit = self._use(path, lock, size)
            if hit is not None:
                counters.add("cache_hits")
                return hit
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_EX)  # one filler; the others wait here, then hit
            hit = self._use(path, lock, size, drop=True)
            if hit is not None:
                fcntl.flock(lock, fcntl.LOCK_SH)  # downgrade
                counters.add("cache_hits")
                return hit
            counters.add("cache_misses")
            tmp = self._reserve(path, size)
            if tmp is None:
                lock.close()
                counters.add("cache_bypass")
                return None
            if not self._fill(tmp, path, url, sha256, size, download):
                lock.close()
                counters.add("cache_bypass")
                return None
            fcntl.flock(lock, fcntl.LOCK_SH)  # downgrade: readers welcome, evictors not
            filled = self._use(path, lock, size)
            if filled is None:
                raise StorageError(f"cache {self.dir}: {path} is not {size} bytes right after its fill", url=url)
            return filled
        except BaseException:
            lock.close()
            raise

    def _use(self, path: str, lock: Any, size: int, drop: bool = False) -> tuple[Any, Any] | None:
        """``(file, lock)`` for the cached shard at ``path``, or None when there is none or its size
        is not the manifest's ``size``: then, with ``drop`` (the exclusive lock held), the bad file
        is removed so that it is fetched again."""
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            return None
        found = os.fstat(f.fileno()).st_size
        if found != size:
            f.close()
            if drop:
                logger.warning(
                    "cache %s: %s is %d bytes, the manifest says %d (cut short by a crash?): dropping it and fetching the shard again",
                    self.dir,
                    path,
                    found,
                    size,
                )
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            return None
        os.utime(path)  # least recently used = oldest mtime
        return f, lock

    @staticmethod
    def release(file: Any, lock: Any) -> None:
        file.close()
        lock.close()  # closing drops the flock

    def _reserve(self, path: str, size: int) -> str | None:
        """Make room and allocate a partial file of ``size`` bytes, under the directory lock, so
        the bytes on disk never exceed the limit; None when there is no room or no disk."""
        if size > self.limit:
            return None  # larger than the whole cache: streamed (warned about at construction)
        with self._dir_locked():
            if not self._make_room(size, keep=path):
                logger.warning(
                    "cache %s: no room under its limit (%d bytes) beside the shards in use: streaming this shard from storage", self.dir, self.limit
                )
                return None
            tmp = f"{path}{_PARTIAL}{uuid.uuid4().hex[:8]}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                try:
                    os.posix_fallocate(fd, 0, size)  # the disk blocks are ours now, or ENOSPC here
                except OSError as exc:
                    if exc.errno in _FULL_DISK:
                        raise
                    os.ftruncate(fd, size)  # no fallocate on this filesystem: still counted at full size
            except OSError as exc:
                os.close(fd)
                os.unlink(tmp)
                if exc.errno in _FULL_DISK:
                    self._disk_full(exc)
                    return None
                raise
            os.close(fd)
            return tmp

    def _disk_full(self, exc: OSError) -> None:
        if not self._warned_full:
            self._warned_full = True
            logger.warning("cache %s: the disk is full (%s): streaming shards from storage instead of caching them", self.dir, exc.strerror)

    def _fill(self, tmp: str, path: str, url: str, sha256: str | None, size: int, download) -> bool:
        """Download into the reserved ``tmp`` and publish it as ``path``; False if the disk filled up."""
        digest = hashlib.sha256()
        written = 0
        try:
            with open(tmp, "r+b") as f:

                def write(chunk: bytes) -> None:
                    nonlocal written
                    if written + len(chunk) > size:
                        raise StorageError(f"{url}: the object is larger than the manifest's {size} bytes", url=url)
                    digest.update(chunk)
                    f.write(chunk)
                    written += len(chunk)

                download(write)
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the name points at them
            if written != size:  # the object is shorter than the manifest says: as on local disk, a truncated shard
                raise ShardFormatError(url, written, f"stream ended at byte {written}, expected {size} (truncated shard)")
            if self.verify and sha256 and digest.hexdigest() != sha256:
                raise ChecksumError(url, digest.hexdigest(), sha256)
            os.replace(tmp, path)
            _fsync_dir(self.dir)  # and the new name survives a power loss too
            return True
        except OSError as exc:
            if exc.errno not in _FULL_DISK or isinstance(exc, StorageError):
                raise
            self._disk_full(exc)
            return False
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _make_room(self, incoming: int, keep: str) -> bool:
        """Evict least recently used shards not in use until ``incoming`` fits; False if it cannot.
        Called under the directory lock; partials of live fills count at their full size."""
        if incoming > self.limit:
            return False  # larger than the whole cache: streamed (warned about at construction)
        self._reclaim_partials()
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
            elif _PARTIAL in name:
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


def _fsync_dir(path: str) -> None:
    """Make a rename in directory ``path`` durable, where the platform and filesystem allow."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a filesystem that cannot fsync a directory: the file itself was fsync'ed
    finally:
        os.close(fd)


class _FileLock:
    """An exclusive flock on a file, as a context manager (held across processes)."""

    def __init__(self, path: str):
        self.path = path
        self.file: Any = None

    def __enter__(self) -> _FileLock:
        self.file = open(self.path, "a+b")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()  # closing drops the flock
