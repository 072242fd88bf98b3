"""A lock shared by a rank's main process and its workers, however they start, that leaves nothing
behind when every process of the job is killed at once.

multiprocessing's locks are named POSIX semaphores (``/dev/shm/sem.mp-*``) unlinked by its resource
tracker, which a kill of the whole group kills too. This is a record lock (``lockf``) on a file
unlinked as soon as it is opened: the kernel drops it with its last descriptor. Forked workers
inherit the descriptor; others receive it as they start (``DupFd``). Record locks are per process,
so threads of one process take a thread lock first.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import weakref
from typing import Any

from shardstream.private import dup_fd, spawning

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
        if not spawning():  # a plain copy would share nothing: pickled only for a new process
            raise RuntimeError("a ProcessLock is shared with a new process only as it starts (in its arguments or dataset)")
        return {"fd": dup_fd(self._fd)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["fd"].detach())


def _after_fork_in_child() -> None:
    # A thread of the parent may have held a thread lock at the fork: the child's copy would stay
    # taken. Record locks are not inherited at all.
    for lock in list(_locks):
        lock._thread = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
