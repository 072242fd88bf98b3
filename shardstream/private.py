"""Every private name of torch, multiprocessing and s3fs that shardstream uses, here.

Each accessor below says what it reaches and why no public way does it. A name is looked up at its
first use and checked then: where a torch, Python, s3fs or botocore release has removed or renamed
it, the use raises ``PrivateNameGone`` naming the name and the versions installed, instead of an
``AttributeError`` deep in a worker. ``NAMES`` lists them all; ``check()`` resolves every one (the
suite's tests/test_private.py does, on every combination of the version matrix, .ci/matrix).

Here too: multiprocessing's undocumented names without an underscore (``context.get_spawning_popen``,
``reduction.DupFd``, ``resource_tracker.unregister``, ``util.spawnv_passfds``), as undocumented as
the others. Not here: names private to shardstream's own classes, and names done the public way
instead: the CLI's option suggestions read the actions ``add_argument`` returns (no argparse
``_actions``), the ``.npy`` header is read by numpy's public ``read_array_header_1_0``/``2_0``, and a
dead DataLoader worker is told by the type of DataLoader's error, the worker pids it holds and their
exit codes, not by its words (``loader/workers.py``).
"""

from __future__ import annotations

import importlib
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from shardstream.errors import ShardstreamError


class PrivateNameGone(ShardstreamError, RuntimeError):
    """A private name shardstream relies on is missing from the installed torch, Python or library."""


# name -> (module, dotted attribute path, why no public way exists)
NAMES: dict[str, tuple[str, str, str]] = {
    # torch
    "torch.UntypedStorage._new_shared": (
        "torch",
        "UntypedStorage._new_shared",
        "a shared-memory storage made in place; UntypedStorage(n).share_memory_() allocates private memory first and copies it",
    ),
    "torch._C._storage_Use_Count": (
        "torch",
        "_C._storage_Use_Count",
        "how many tensors still hold a storage, so a worker reuses a segment only when the main process let go of it",
    ),
    "torch.utils.data._utils.pin_memory.pin_memory": (
        "torch.utils.data._utils.pin_memory",
        "pin_memory",
        "DataLoader's own pinning of a nested batch (dicts, tuples, namedtuples), used with no workers",
    ),
    "DataLoader._iterator": (
        "torch.utils.data",
        "DataLoader.__init__",  # an instance attribute: checked on an instance (see check())
        "a persistent-workers DataLoader's live iterator: to see its workers live and shut them down",
    ),
    "_MultiProcessingDataLoaderIter": (
        "torch.utils.data.dataloader",
        "_MultiProcessingDataLoaderIter",
        "the iterator class of a DataLoader with workers (the watchdog watches only those)",
    ),
    "_MultiProcessingDataLoaderIter._workers": (
        "torch.utils.data.dataloader",
        "_MultiProcessingDataLoaderIter._shutdown_workers",
        "the worker processes (pids, liveness) for the watchdog, and their orderly stop",
    ),
    # multiprocessing (CPython)
    "multiprocessing.forkserver._forkserver": (
        "multiprocessing.forkserver",
        "_forkserver",
        "whether the forkserver runs already and what it preloads (no public getter)",
    ),
    "multiprocessing.util._finalizer_registry": (
        "multiprocessing.util",
        "_finalizer_registry",
        "the named semaphores a DataLoader made, to unlink their names once its workers opened them",
    ),
    "multiprocessing.synchronize.SemLock._cleanup": (
        "multiprocessing.synchronize",
        "SemLock._cleanup",
        "tells a semaphore's finalizer from the others in that registry",
    ),
    "_multiprocessing.sem_unlink": ("_multiprocessing", "sem_unlink", "unlinks a named semaphore"),
    "multiprocessing.synchronize.SemLock._semlock": (
        "_multiprocessing",
        "SemLock.name",  # the instance attribute _semlock holds one of these (see semaphore_name())
        "the name of a multiprocessing lock's POSIX semaphore, to find a DataLoader's own among the finalizers",
    ),
    "multiprocessing.resource_tracker.unregister": (
        "multiprocessing.resource_tracker",
        "unregister",
        "tells the resource tracker a semaphore's name is unlinked already (else it warns at exit and unlinks it again)",
    ),
    "multiprocessing.resource_tracker._resource_tracker": (
        "multiprocessing.resource_tracker",
        "_resource_tracker",
        "the tracker process's handle: whether it runs yet (its _fd), and its start (ensure_running)",
    ),
    "multiprocessing.util.spawnv_passfds": (
        "multiprocessing.util",
        "spawnv_passfds",
        "the call that starts the resource tracker and the forkserver's server, wrapped for that one start so the tracker "
        "runs in a session of its own and the server imports from this process's sys.path",
    ),
    "multiprocessing.spawn.get_preparation_data": (
        "multiprocessing.spawn",
        "get_preparation_data",
        "this process's sys.path as multiprocessing hands it to a new process ('' made the directory it started in)",
    ),
    "multiprocessing.context.get_spawning_popen": (
        "multiprocessing.context",
        "get_spawning_popen",
        "whether an object is being pickled for a new process (its handles travel) or copied (pickle, deepcopy)",
    ),
    "multiprocessing.reduction.DupFd": (
        "multiprocessing.reduction",
        "DupFd",
        "a file descriptor pickled for a new process: sent by the spawning process, a duplicate in the child",
    ),
    "multiprocessing.spawn.import_main_path": (
        "multiprocessing.spawn",
        "import_main_path",
        "imports the main script as __mp_main__ the way a spawned worker does, so the forkserver's server imports it once for all its workers",
    ),
    "multiprocessing.spawn._check_not_importing_main": (
        "multiprocessing.spawn",
        "_check_not_importing_main",
        "reads current_process()._inheriting: a script that starts processes as the server imports it raises instead",
    ),
    "sys._current_frames": ("sys", "_current_frames", "counts the threads running Python code (threading.enumerate misses _thread's)"),
    "multiprocessing.pool.Pool._outqueue": (
        "multiprocessing.pool",
        "Pool._help_stuff_finish",
        "a pool given up on (Ctrl-C, an error) stopped without joining its result thread, which never returns when a worker died mid-result",
    ),
    # s3fs, fsspec
    "s3fs.S3FileSystem._call_s3": ("s3fs", "S3FileSystem._call_s3", "s3fs's GET with its retries and error mapping, on its own client"),
    "s3fs.S3FileSystem._cache": ("s3fs", "S3FileSystem._cache", "fsspec's instance cache, held across a fork so a worker's copy is not finalized"),
}

_resolved: dict[str, Any] = {}
_lock = threading.Lock()


def versions() -> str:
    """The versions the names depend on, for an error message."""
    parts = [f"Python {platform.python_version()}"]
    for module in ("torch", "s3fs", "botocore"):
        mod = sys.modules.get(module)
        if mod is not None:
            parts.append(f"{module} {getattr(mod, '__version__', '?')}")
    return ", ".join(parts)


def gone(name: str, detail: str = "") -> PrivateNameGone:
    why = NAMES[name][2] if name in NAMES else ""
    return PrivateNameGone(
        f"shardstream relies on {name} ({why}), which this installation lacks{': ' + detail if detail else ''} "
        f"({versions()}); install a supported version (see pyproject.toml) or report it"
    )


def resolve(name: str) -> Any:
    """The object ``name`` of NAMES stands for, looked up once; ``PrivateNameGone`` where it is missing."""
    got = _resolved.get(name)
    if got is not None:
        return got
    module, path, _ = NAMES[name]
    with _lock:
        try:
            obj: Any = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise gone(name, str(exc)) from None
        _resolved[name] = obj
    return obj


# -- torch ------------------------------------------------------------------------------------------
def new_shared_storage(nbytes: int) -> Any:
    """A new ``torch.UntypedStorage`` of ``nbytes`` in shared memory: torch's own ``_new_shared``,
    whatever ``worker_new_shared`` did to it in this process (the segment pool makes its segments
    here)."""
    return resolve("torch.UntypedStorage._new_shared")(nbytes)


_worker_new_shared = False


def worker_new_shared(limit: int, pooled: Callable[[int], Any] | None = None) -> None:
    """In a DataLoader worker whose batches shardstream's pack step hands over (``make_loader``'s):
    where torch asks for a new CPU "shared" storage (``UntypedStorage._new_shared``; its
    ``default_collate`` stacks each batch into one when it runs in a worker, to save a copy when
    torch pickles the tensor), one of at most ``limit`` bytes is made an ordinary one, and a larger
    one asked in the process's main thread comes from ``pooled(nbytes)`` (the worker's segment pool;
    None: none here, torch's own then).

    Small: torch's fresh shared memory is a file created, sized, mapped and its pages zeroed on first
    touch, then unmapped; the pack step sends every tensor of at most its inline limit as bytes in
    the message instead, so that memory only cost: 1 KiB samples with torch's default_collate, batch
    64, spent about an eighth of a worker's CPU there (py-spy). A tensor of such a storage that torch
    pickles after all (a view larger than the limit, the user's own queue) is moved to shared memory
    then, by torch's own reduction, as any tensor is.

    Large: the pool hands out a segment the main process let go of and no tensor of the worker still
    uses (``loader/segments.py``), maybe larger than asked (torch's collate makes its tensor over
    the storage's start: ``new(storage).resize_``), and the pack step sends it by number, as it does
    shardstream's own collate's batches; a segment that leaves some other way is never reused. Only
    the main thread: the pool is the worker's main thread's (a user's thread gets torch's own). The
    same bytes either way."""
    global _worker_new_shared
    import torch

    original = resolve("torch.UntypedStorage._new_shared")
    if _worker_new_shared:
        return
    main = threading.main_thread()

    def _new_shared(cls: Any, size: int, *, device: Any = "cpu") -> Any:
        if torch.device(device).type == "cpu":
            if size <= limit:
                return cls(size)
            if pooled is not None and cls is torch.UntypedStorage and threading.current_thread() is main:
                storage = pooled(size)
                if storage is not None:
                    return storage
        return original(size, device=device)

    torch.UntypedStorage._new_shared = classmethod(_new_shared)  # type: ignore[method-assign,assignment]
    _worker_new_shared = True


def storage_use_count(storage: Any) -> int:
    """How many references torch holds to ``storage``'s data (tensors and storages alike)."""
    return int(resolve("torch._C._storage_Use_Count")(storage._cdata))


def pin_memory(batch: Any, device: str) -> Any:
    """``batch`` with its tensors in pinned memory, as DataLoader's pin thread makes it."""
    return resolve("torch.utils.data._utils.pin_memory.pin_memory")(batch, device)


def loader_iterator(loader: Any) -> Any:
    """A DataLoader's kept iterator (persistent workers), or None."""
    try:
        return loader._iterator
    except AttributeError:
        raise gone("DataLoader._iterator") from None


def drop_loader_iterator(loader: Any) -> Any:
    """Take a DataLoader's kept iterator away from it (the next pass makes a new one); returns it."""
    it = loader_iterator(loader)
    loader._iterator = None
    return it


def iterator_workers(it: Any) -> list[Any] | None:
    """The worker processes of a DataLoader iterator, None for one without workers."""
    if not isinstance(it, resolve("_MultiProcessingDataLoaderIter")):
        return None
    try:
        return list(it._workers)
    except AttributeError:
        raise gone("_MultiProcessingDataLoaderIter._workers") from None


def set_iterator_timeout(it: Any, seconds: float) -> None:
    """How long the iterator's next wait for a batch lasts before 'DataLoader timed out'."""
    if not hasattr(it, "_timeout"):
        raise gone("_MultiProcessingDataLoaderIter._workers", "no _timeout")
    it._timeout = seconds


def is_iterator_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is the iterator's timeout (DataLoader raises a bare RuntimeError for it)."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader timed out")


def shutdown_workers(it: Any) -> None:
    """Stop an iterator's workers now (what its ``__del__`` does)."""
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()


def owed_worker(it: Any) -> int | None:
    """The worker that owes the iterator's next batch, None if unknown."""
    info = getattr(it, "_task_info", {}).get(getattr(it, "_rcvd_idx", -1))
    return info[0] if info else None


# -- multiprocessing --------------------------------------------------------------------------------
def forkserver_running() -> bool:
    return getattr(resolve("multiprocessing.forkserver._forkserver"), "_forkserver_pid", None) is not None


def forkserver_preload() -> list[str]:
    """The modules the forkserver will preload when it starts (multiprocessing's default: __main__)."""
    return list(getattr(resolve("multiprocessing.forkserver._forkserver"), "_preload_modules", ["__main__"]))


def finalizer_registry() -> dict[Any, Any]:
    """multiprocessing's finalizers, keyed by (priority, order)."""
    return resolve("multiprocessing.util._finalizer_registry")


def semaphore_finalizers(after: int) -> Iterator[tuple[str, Any]]:
    """(name, finalizer) of each named semaphore registered after order ``after``."""
    cleanup = resolve("multiprocessing.synchronize.SemLock._cleanup")
    for key, fin in list(finalizer_registry().items()):
        if key[1] > after and getattr(fin, "_callback", None) is cleanup:
            yield fin._args[0], fin


def semaphore_name(lock: Any) -> str | None:
    """The name of a ``multiprocessing.synchronize.SemLock``'s (Lock, Semaphore, ...) POSIX semaphore;
    None for one with no name (already unlinked)."""
    resolve("multiprocessing.synchronize.SemLock._semlock")
    try:
        semlock = lock._semlock
    except AttributeError:
        raise gone("multiprocessing.synchronize.SemLock._semlock") from None
    return semlock.name


def sem_unlink(name: str) -> None:
    resolve("_multiprocessing.sem_unlink")(name)


def spawning() -> bool:
    """Whether this thread is pickling for a new process's start (spawn, forkserver): what such a
    pickle holds reaches that process only (file descriptors travel with it), where a plain pickle or
    deepcopy shares nothing."""
    return resolve("multiprocessing.context.get_spawning_popen")() is not None


def dup_fd(fd: int) -> Any:
    """``fd`` for the new process being pickled for (``spawning()``): the unpickled object's
    ``detach()`` is a descriptor of the same open file in that process."""
    return resolve("multiprocessing.reduction.DupFd")(fd)


def tracker_unregister(name: str, rtype: str) -> None:
    """Tell the resource tracker ``name`` (of resource type ``rtype``, e.g. "semaphore") is gone."""
    resolve("multiprocessing.resource_tracker.unregister")(name, rtype)


# The command the resource tracker starts with (Python 3.11-3.14: "...import main;main(fd)").
_TRACKER_CODE = "from multiprocessing.resource_tracker import main;"
# The forkserver's server's (Python 3.11-3.14: "from multiprocessing.forkserver import main; main(...)").
_FORKSERVER_CODE = "from multiprocessing.forkserver import main;"
_spawnv_lock = threading.Lock()  # one wrap of util.spawnv_passfds at a time (the tracker's, the server's)


def resource_tracker_in_own_session() -> bool:
    """Start multiprocessing's resource tracker now in a session of its own (``setsid``), if it is
    not running; False where it runs already (started by anything else: left alone) or where there
    are no sessions. multiprocessing starts the tracker on demand as a child in the caller's process
    group, through ``util.spawnv_passfds``, and has no way to ask for another session: that call is
    wrapped for this one start to put ``os.setsid()`` before the tracker's own code."""
    import os

    if not hasattr(os, "setsid"):
        return False
    tracker = resolve("multiprocessing.resource_tracker._resource_tracker")
    if not hasattr(tracker, "_fd") or not callable(getattr(tracker, "ensure_running", None)):
        raise gone("multiprocessing.resource_tracker._resource_tracker", "no _fd or ensure_running")
    with _spawnv_lock:
        if tracker._fd is not None:
            return False
        _start_prefixed(_TRACKER_CODE, lambda: "import os; os.setsid(); ", tracker.ensure_running)
    return True


def forkserver_ignores_sys_path() -> bool:
    """Whether this Python's forkserver's server ignores the ``sys_path`` it is handed and preloads from
    its own: the working directory (it runs ``python -c``) and PYTHONPATH first (gh-117378, fixed in
    3.12.8 and 3.13.1; 3.11 and older were not fixed)."""
    v = sys.version_info[:3]
    return v < (3, 12, 8) or (3, 13, 0) <= v < (3, 13, 1)


def start_forkserver() -> None:
    """Start multiprocessing's forkserver's server now, if it is not running, importing its preload
    list from this process's ``sys.path`` on every Python. Where the server ignores the path it is
    handed (``forkserver_ignores_sys_path``), a process that imported shardstream from one tree (a
    ``sys.path`` set at run time, an installed copy) with another tree's in the working directory or
    on PYTHONPATH had the server preload the other tree's shardstream, and every worker forked from
    it ran that code. The server's command (``python -c "from multiprocessing.forkserver import
    main; main(...)"``), made inside ``ForkServer.ensure_running`` and started through
    ``util.spawnv_passfds``, gets ``sys.path`` set first, as the fixed Pythons' ``main`` does: that
    call is wrapped for this one start. Returns at once: the server imports on its own, and the
    first worker's start waits for it."""
    from multiprocessing import forkserver

    if not forkserver_ignores_sys_path():
        forkserver.ensure_running()
        return
    preparation = resolve("multiprocessing.spawn.get_preparation_data")

    def sys_path_first() -> str:
        import os

        given = preparation("ignore").get("sys_path", sys.path)
        sys_path = [os.fspath(p) for p in given if isinstance(p, (str, os.PathLike))]  # (a repr in the command: strings only)
        return f"import sys; sys.path[:] = {sys_path!r}; "

    with _spawnv_lock:
        _start_prefixed(_FORKSERVER_CODE, sys_path_first, forkserver.ensure_running)


def _start_prefixed(code: str, prefix: Callable[[], str], start: Callable[[], Any]) -> None:
    """``start()`` with ``util.spawnv_passfds`` wrapped for it: a ``python -c`` command that begins
    with ``code`` (the helper process ``start`` makes: the resource tracker, the forkserver's server)
    gets ``prefix()`` put before it, the one way to add to what multiprocessing runs there. Called
    under ``_spawnv_lock`` (one wrap at a time)."""
    util: Any = importlib.import_module("multiprocessing.util")
    spawnv = resolve("multiprocessing.util.spawnv_passfds")

    def prefixed(path: str, args: list[str], passfds: Any) -> int:
        if len(args) >= 2 and args[-2] == "-c" and args[-1].startswith(code):
            args = [*args[:-1], prefix() + args[-1]]
        return spawnv(path, args, passfds)

    util.spawnv_passfds = prefixed  # the start calls it by this name
    try:
        start()
    finally:
        util.spawnv_passfds = spawnv


def import_main_inherited(path: str) -> None:
    """Import the main script at ``path`` as ``__mp_main__``, as the forkserver's own preload of
    ``__main__`` does: with the current process marked ``_inheriting``, so that a script starting
    processes at import raises (``spawn._check_not_importing_main``) instead of starting them."""
    resolve("multiprocessing.spawn._check_not_importing_main")
    import_main_path = resolve("multiprocessing.spawn.import_main_path")
    from multiprocessing import process

    current = process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]
    try:
        import_main_path(path)
    finally:
        del current._inheriting  # type: ignore[attr-defined]


def python_threads() -> int:
    """Threads of this process running Python code: threading's and _thread's alike."""
    return len(resolve("sys._current_frames")())


def abandon_pool(pool: Any) -> None:
    """Stop a ``multiprocessing`` pool that is being given up on (Ctrl-C, an error) without waiting on
    it for good. ``terminate()`` joins the pool's result thread, and that thread never returns when a
    worker died halfway through writing a result (the rest of the message never comes): pack then
    hung after Ctrl-C. The workers are killed (none in the middle of sending a result: see below) and
    the pool's exit-time clean-up (the same join) is cancelled. Its two threads are then ended: the
    task thread at a sentinel, the result thread at the end of its pipe (the workers held its other
    write ends), each waited for a moment at most; left running, they could last until the
    interpreter's exit. The pool itself is marked terminated, as ``terminate()`` marks it: the pool is
    in reference cycles (its cache holds the imap iterator, which holds the pool), so it is collected
    whenever the garbage collector runs, at exit perhaps, where ``Pool.__del__`` of a pool still
    marked running wrote to its change notifier's pipe, already closed, and printed an ignored
    ``OSError: [Errno 9] Bad file descriptor`` traceback under pack's one line (8 of 15 Ctrl-C runs)."""
    from multiprocessing.pool import TERMINATE

    resolve("multiprocessing.pool.Pool._outqueue")
    pool._state = TERMINATE
    handler = getattr(pool, "_worker_handler", None)
    if handler is not None:
        handler._state = TERMINATE  # no replacement workers for the ones killed below
        handler.join(5)
    # Killed while sending a result, a worker would keep the result queue's write lock for good (the
    # task thread's last message waits on it): the kill comes while this process holds the lock.
    lock: Any = getattr(getattr(pool, "_outqueue", None), "_wlock", None)
    held = lock is not None and lock.acquire(timeout=2)
    try:
        for proc in list(getattr(pool, "_pool", [])):
            proc.kill()
        for proc in list(getattr(pool, "_pool", [])):
            proc.join(5)
    finally:
        if held:
            lock.release()
    finalizer = getattr(pool, "_terminate", None)
    if finalizer is not None:
        finalizer.cancel()
    threads = [t for t in (getattr(pool, "_task_handler", None), getattr(pool, "_result_handler", None)) if t is not None]
    for thread in threads:
        thread._state = TERMINATE
    taskqueue = getattr(pool, "_taskqueue", None)
    if taskqueue is not None:
        taskqueue.put(None)
    writer = getattr(getattr(pool, "_outqueue", None), "_writer", None)
    if writer is not None:
        try:
            writer.close()  # the result thread's read ends: EOFError, and it returns
        except OSError:
            pass
    for thread in threads:
        thread.join(2)


# -- s3fs, fsspec ----------------------------------------------------------------------------------
async def s3_call(fs: Any, method: str, **params: Any) -> Any:
    """An S3 call through s3fs's own client, retries and error mapping."""
    resolve("s3fs.S3FileSystem._call_s3")
    return await fs._call_s3(method, **params)


def cached_s3_filesystems(s3fs: Any) -> list[Any]:
    """The S3 filesystems fsspec's instance cache holds."""
    return list(getattr(s3fs.S3FileSystem, "_cache", {}).values())


def check() -> list[str]:
    """Resolve every module-level name of NAMES; returns the names checked."""
    for name in NAMES:
        resolve(name)
    return list(NAMES)
