"""A local shard cache for multi-epoch training from remote storage.

Shards read from S3 (or any remote store) are downloaded whole into ``cache_dir`` and read from
there by later epochs. Several DataLoader workers and several ranks on one node may share one
cache directory:

- a fill happens under an exclusive lock on ``<name>.lock``: one process downloads, the others
  wait on the lock and then find the file (no duplicate downloads);
- a fill is atomic and durable: it is written to a temporary name, checked against the manifest's
  sha256 (``verify=True``), fsync'ed, renamed, and the directory fsync'ed, so a partial file is
  never visible, and a power loss cannot leave an empty or short file under the final name;
- every hit is checked before a byte of it is handed on: its size against the manifest's, and its
  bytes against the CRC-32 recorded at its fill in ``<name>.crc32`` (the fill was checked against
  the manifest's sha256, so the record vouches for those bytes). A copy damaged after its fill (a
  bit flipped on disk, a file cut short by a crash of the host or by hand) is dropped and fetched
  again, with a warning, counted as ``cache_corrupt`` (the refetch as a ``cache_misses``). CRC-32
  rather than the sha256 again: 8 ms per 32 MiB against 19 ms (zlib and hashlib on this VM, both
  in C, sha256 with the CPU's SHA instructions; several times that without them). A cached shard
  with no record (filled by an older version) is checked once against the manifest's sha256 and
  given one, or fetched again when the manifest has none. ``Cache(verify=False)`` checks neither
  fills nor hits;
- readers hold a shared lock on the shard's lock file while they read it; eviction (least
  recently used first, by modification time, touched on every use) skips shards whose lock it
  cannot take, so it never removes a shard that is being read;
- the limit is a hard bound on the bytes on disk at every moment, across processes: room is
  made and reserved under an exclusive lock on ``.cache.lock`` in the directory, and a fill's
  partial file is allocated at the shard's full size before any byte is downloaded, so the
  directory never holds more than ``limit`` bytes of shards, partials and their checksum records
  (30 bytes each);
- a partial file left by a process that died (kill -9, OOM) is reclaimed: its shard's lock is
  free once its writer is gone, so it is removed at start and whenever room is made; a reader
  never waits on a dead writer (the kernel drops a dead process's flock);
- when the shards being read leave no room under the limit, or the disk is full (ENOSPC,
  EDQUOT: one warning, the partial removed), the read bypasses the cache (streams from storage,
  counted as ``cache_bypass``) instead of waiting or failing; a limit smaller than the largest
  shard is a ConfigError at construction, and so is a directory that cannot be one (a file, not
  writable, not creatable), named.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import uuid
import zlib
from collections.abc import Callable
from typing import Any

from shardstream.errors import ChecksumError, ConfigError, ShardFormatError, StorageError
from shardstream.redact import get_logger
from shardstream.stats import NullCounters

logger = get_logger(__name__)

_SUFFIX = ".tar"
_PARTIAL = ".partial-"
_DIR_LOCK = ".cache.lock"
_LOCK = ".lock"  # beside <name>.tar: held shared by its readers, exclusive by its filler
_RECORD = ".crc32"  # beside <name>.tar: "<crc32 hex> <size>", written at the fill
_RECORD_BYTES = 30  # its size, always (counted under the limit with its shard's)
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
_HASH_BLOCK = 4 << 20


class ShardCache:
    def __init__(self, cache_dir: str, limit_bytes: int, *, verify: bool = True):
        self.dir = os.path.abspath(cache_dir)
        self.limit = int(limit_bytes)
        self.verify = verify
        self._warned_full = False
        try:
            os.makedirs(self.dir, exist_ok=True)
            if not os.access(self.dir, os.R_OK | os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "no permission to read and write it")
            with _locked(os.path.join(self.dir, _DIR_LOCK)):  # (creates the directory's lock file: a read-only filesystem fails here)
                self._reclaim_partials()
        except OSError as exc:
            raise ConfigError(f"cache directory {self.dir} cannot be used: {_why(exc)}; pass Cache(dir=...) a writable directory") from exc

    def _reclaim_partials(self) -> None:
        """Remove partial files whose writer is gone (their shard lock is free)."""
        for name in os.listdir(self.dir):
            if _PARTIAL in name:
                full = os.path.join(self.dir, name)
                with _unused(full) as free:  # (not free: a live process is filling it)
                    if free and _remove(full):
                        logger.info("cache %s: removed %s left by a process that died", self.dir, name)

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
        lock = open(_beside(path, _LOCK), "a+b")
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)
            hit = self._use(path, lock, size, url, sha256)
            if hit is not None:
                counters.add("cache_hits")
                return hit
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_EX)  # one filler; the others wait here, then hit
            hit = self._use(path, lock, size, url, sha256, drop=counters)
            if hit is not None:
                fcntl.flock(lock, fcntl.LOCK_SH)  # downgrade
                counters.add("cache_hits")
                return hit
            counters.add("cache_misses")
            tmp = self._reserve(path, size)
            if tmp is None or not self._fill(tmp, path, url, sha256, size, download):
                lock.close()
                counters.add("cache_bypass")
                return None
            fcntl.flock(lock, fcntl.LOCK_SH)  # downgrade: readers welcome, evictors not
            filled = self._use(path, lock, size, url, sha256, check=False)  # (checked as it was filled)
            if filled is None:
                raise StorageError(f"cache {self.dir}: {path} is not {size} bytes right after its fill", url=url)
            return filled
        except BaseException:
            lock.close()
            raise

    def _use(self, path: str, lock: Any, size: int, url: str, sha256: str | None, *, drop: Any = None, check: bool = True) -> tuple[Any, Any] | None:
        """``(file, lock)`` for the cached shard at ``path``, or None when there is none, or it is not
        the manifest's ``size`` or fails its check (``_intact``). With ``drop`` (counters; the
        exclusive lock held) a bad copy is removed, with a warning, so that it is fetched again."""
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            return None
        found = os.fstat(f.fileno()).st_size
        problem, damaged = None, True
        if found != size:
            problem = f"is {found} bytes, the manifest says {size} (cut short by a crash?)"
        elif check and self.verify:
            problem, damaged = self._intact(f, path, size, sha256, exclusive=drop is not None)
            f.seek(0)
        if problem is not None:
            f.close()
            if drop is not None:
                logger.warning("cache %s: %s (%s) %s: dropping it and fetching the shard again", self.dir, path, url, problem)
                if damaged:
                    drop.add("cache_corrupt")
                _remove(path)
                _remove(_beside(path, _RECORD))
            return None
        os.utime(path)  # least recently used = oldest mtime
        return f, lock

    def _intact(self, f: Any, path: str, size: int, sha256: str | None, *, exclusive: bool) -> tuple[str | None, bool]:
        """``(what is wrong, whether it is damage)`` for the cached copy open as ``f``, ``(None,
        False)`` when it is intact: its CRC-32 against the record of its fill; with no record, under
        the exclusive lock, its sha256 against the manifest's (a match is given a record); without
        the lock, "no record" (the caller takes it and asks again)."""
        recorded = _read_record(path, size)
        if recorded is not None:
            crc = _crc32(f)
            if crc != recorded:
                return f"does not match the CRC-32 recorded when it was filled ({crc:08x}, recorded {recorded:08x}): damaged on disk", True
            return None, False
        if not exclusive:
            return "has no checksum record", False
        if not sha256:
            return "has no checksum record, and the manifest no sha256 to check it against", False
        digest = hashlib.sha256()
        crc = _crc32(f, digest)
        if digest.hexdigest() != sha256:
            return f"has sha256 {digest.hexdigest()}, the manifest says {sha256}: damaged on disk", True
        _write_record(path, crc, size)
        return None, False

    @staticmethod
    def release(file: Any, lock: Any) -> None:
        file.close()
        lock.close()  # closing drops the flock

    def _reserve(self, path: str, size: int) -> str | None:
        """Make room and allocate a partial file of ``size`` bytes, under the directory lock, so
        the bytes on disk never exceed the limit; None when there is no room or no disk."""
        if size + _RECORD_BYTES > self.limit:
            return None  # larger than the whole cache: streamed (warned about at construction)
        with _locked(os.path.join(self.dir, _DIR_LOCK)):  # bytes on disk are counted and reserved under it
            if not self._make_room(size + _RECORD_BYTES, keep=path):
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
        written = crc = 0
        published = False
        try:
            with open(tmp, "r+b") as f:

                def write(chunk: bytes) -> None:
                    nonlocal written, crc
                    if written + len(chunk) > size:
                        raise StorageError(f"{url}: the object is larger than the manifest's {size} bytes", url=url)
                    digest.update(chunk)
                    crc = zlib.crc32(chunk, crc)
                    f.write(chunk)
                    written += len(chunk)

                download(write)
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the name points at them
            if written != size:  # the object is shorter than the manifest says: as on local disk, a truncated shard
                raise ShardFormatError(url, written, f"stream ended at byte {written}, expected {size} (truncated shard)")
            if self.verify and sha256 and digest.hexdigest() != sha256:
                raise ChecksumError(url, digest.hexdigest(), sha256)
            _write_record(path, crc, size)  # before the name: a shard under its name always has one
            os.replace(tmp, path)
            published = True
            _fsync_dir(self.dir)  # and the new name survives a power loss too
            return True
        except OSError as exc:
            if exc.errno not in _FULL_DISK or isinstance(exc, StorageError):
                raise
            self._disk_full(exc)
            return False
        finally:
            _remove(tmp)
            if not published:
                _remove(_beside(path, _RECORD))  # a record written for a shard that was not published

    def _make_room(self, incoming: int, keep: str) -> bool:
        """Evict least recently used shards not in use until ``incoming`` fits; False if it cannot.
        Called under the directory lock; partials of live fills count at their full size, and every
        shard and partial with the record of its checksum (``_RECORD_BYTES``)."""
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
                entries.append((st.st_mtime, st.st_size + _RECORD_BYTES, full))
                total += st.st_size + _RECORD_BYTES
            elif _PARTIAL in name:
                try:
                    total += os.stat(os.path.join(self.dir, name)).st_size + _RECORD_BYTES  # fills in progress count too
                except FileNotFoundError:
                    pass
        for _, size, full in sorted(entries):
            if total + incoming <= self.limit:
                break
            if full == keep:
                continue
            with _unused(full) as free:
                if not free:
                    continue  # being read or filled: never evicted
                if _remove(full):
                    total -= size
                _remove(_beside(full, _RECORD))
        return total + incoming <= self.limit


def _why(exc: OSError) -> str:
    if isinstance(exc, FileExistsError) or exc.errno == errno.ENOTDIR:
        return "a file is in the way (a directory is needed)"
    if exc.errno == errno.EROFS:
        return "it is on a read-only filesystem"
    if isinstance(exc, PermissionError):
        return "no permission to read and write it"
    return exc.strerror or str(exc)


def _remove(path: str) -> bool:
    """Remove ``path``; False when it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _beside(path: str, suffix: str) -> str:
    """The file beside the cached shard ``path`` (``<name>.tar``, or a partial of it) named
    ``<name>`` + ``suffix``: its lock (``_LOCK``) or its checksum record (``_RECORD``)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, name.split(_PARTIAL)[0][: -len(_SUFFIX)] + suffix)


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive flock on the file ``path``, held across processes while in the block."""
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # (closing the file drops the flock)


@contextlib.contextmanager
def _unused(path: str):
    """In the block, the exclusive lock of the cached shard ``path`` (or a partial of it), taken
    without waiting: yields True, or False when it is held (the shard is being read or filled)."""
    with open(_beside(path, _LOCK), "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def _read_record(path: str, size: int) -> int | None:
    """The CRC-32 recorded for the cached shard at ``path`` of ``size`` bytes, or None (no record,
    or one that is unreadable or for another size)."""
    try:
        with open(_beside(path, _RECORD), "rb") as f:
            text = f.read(_RECORD_BYTES + 1).split()
        if len(text) == 2 and int(text[1]) == size:
            return int(text[0], 16)
    except (OSError, ValueError):
        pass
    return None


def _write_record(path: str, crc: int, size: int) -> None:
    """Record ``path``'s CRC-32 (called under its shard's exclusive lock: nobody reads it meanwhile).
    It is written before the shard's rename and fsync'ed with the directory after it."""
    with open(_beside(path, _RECORD), "wb") as f:
        f.write(b"%08x %020d\n" % (crc, size))
        f.flush()
        os.fsync(f.fileno())


def _crc32(f: Any, digest: Any = None) -> int:
    """The CRC-32 of the open file ``f`` from its start, read block by block into one buffer;
    ``digest`` (a hashlib object) is given the bytes too."""
    f.seek(0)
    crc = 0
    view = memoryview(bytearray(_HASH_BLOCK))
    try:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
            if digest is not None:
                digest.update(view[:n])
    finally:
        view.release()
    return crc


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
