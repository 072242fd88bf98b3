"""A lock shared by a rank's main process and its DataLoader workers, however they start, that
leaves nothing behind when the whole process group is killed.

multiprocessing's locks that travel to spawned and forkserver workers are named POSIX semaphores
(``/dev/shm/sem.mp-*``), unlinked by a resource tracker process: kill -9 of the group (how
schedulers stop jobs) kills the tracker too and leaves one file per lock. This lock is a POSIX
record lock (``lockf``) on a temporary file that is unlinked as soon as it is opened: only file
descriptors refer to it, and the kernel drops it with the last of them. Forked workers inherit
the descriptor; others receive it with the dataset (``DupFd`` while spawning). Record locks are
held per process, so threads of one process also take a thread lock first.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import weakref
from multiprocessing import context, reduction, resource_tracker, util
from typing import Any

_locks: weakref.WeakSet[ProcessLock] = weakref.WeakSet()


class ProcessLock:
    def __init__(self) -> None:
        fd, path = tempfile.mkstemp(prefix="shardstream-lock-")
        os.unlink(path)
        self._setup(fd)

    def _setup(self, fd: int) -> None:
        self._fd = fd
        self._thread = threading.Lock()
        self._close = weakref.finalize(self, os.close, fd)
        _locks.add(self)

    def __enter__(self) -> ProcessLock:
        self._thread.acquire()
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread.release()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN)
        self._thread.release()

    def __getstate__(self) -> dict[str, Any]:
        context.assert_spawning(self)  # a plain copy would share nothing: pickled only for a new process
        return {"fd": reduction.DupFd(self._fd)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["fd"].detach())


def _after_fork_in_child() -> None:
    # A thread of the parent may have held a thread lock at the fork: the child's copy would stay
    # taken. Record locks are not inherited at all.
    for lock in list(_locks):
        lock._thread = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# multiprocessing's named semaphores (a DataLoader's queues for workers that are not forked, a
# spawn pool's) are unlinked by its resource tracker when the process that made them is gone. A
# kill -9 of the job's process group killed the tracker with it and left every name in /dev/shm.
_TRACKER_CODE = "from multiprocessing.resource_tracker import main;"


def isolate_resource_tracker() -> None:
    """Start multiprocessing's resource tracker now, if it is not running, in a new session (not in
    this process's group), so that a kill of the job's process group leaves it to clean up after the
    job. Where it already runs (started by anything else), it is left alone."""
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    spawnv = getattr(util, "spawnv_passfds", None)
    if tracker is None or spawnv is None or getattr(tracker, "_fd", 0) is not None or not hasattr(os, "setsid"):
        return

    def in_own_session(path: str, args: list[str], passfds: Any) -> int:
        if len(args) >= 2 and args[-2] == "-c" and args[-1].startswith(_TRACKER_CODE):
            args = [*args[:-1], "import os; os.setsid(); " + args[-1]]
        return spawnv(path, args, passfds)

    with _tracker_lock:
        util.spawnv_passfds = in_own_session  # type: ignore[assignment]  # the tracker's launch calls it by this name
        try:
            tracker.ensure_running()
        finally:
            util.spawnv_passfds = spawnv


_tracker_lock = threading.Lock()
