"""How a loader's DataLoader workers start, live and die.

Start. ``fork()`` copies one thread of a process that may have many: a child forked while another
thread holds a lock (CPython's own around thread states, gh-112275, before 3.12; OpenMP's, CUDA's,
NCCL's, an allocator's in any version) can deadlock before it runs a line of Python, and Python
3.12 warns about forking a threaded process. Counting threads to judge the risk was wrong both
ways (idle BLAS threads count, a native thread inside a Python callback does not), so there is no
guessing: workers start from ``forkserver`` (what Python 3.14 chooses by default), a
single-threaded server process started once (fork+exec) that forks each worker, which receives
the dataset pickled (a few KB). ``fork`` and ``spawn`` are there when asked for, by
``make_loader(start_method=...)`` or ``SHARDSTREAM_START_METHOD``; the first loader of a process
that does not ask fixes the method for every later one, and a loader keeps its method for all its
passes, so a run never changes method mid-way.
With persistent workers (make_loader's default) workers start once, not every epoch.

Life. A worker keeps the heap memory it frees for its next samples (``keep_freed_memory``: glibc
would otherwise map and zero every page of each large sample afresh). Each worker reports its
steps on the rank's board (stats.py). The loader bounds every wait
for a batch (``timeout``, and ``first_batch_timeout`` for a pass's first one) and raises
``WorkerTimeout`` naming the rank, the worker, its pid and its last step, so a hung rank fails the
job (and ``torchrun`` restarts it from a checkpoint) instead of every rank waiting forever.

Death. A worker dies with its rank: ``PR_SET_PDEATHSIG`` on Linux where the thread that started it
lives as long as the process (the rank's main thread, a forkserver), and everywhere a thread that
sees the parent go (``getppid`` changes) or, for a worker whose parent is a forkserver (which stays
up while any worker it forked lives) or that another thread of the rank started, the rank itself
go (a pidfd). A worker of a killed rank
otherwise blocks for good flushing its queue to a reader that is gone.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import logging
import multiprocessing
import os
import pickle
import re
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import synchronize
from typing import Any

from shardstream.buffers import pooled_shared
from shardstream.errors import ConfigError, WorkerDied, WorkerTimeout
from shardstream.portable import reduce_portable
from shardstream.private import (
    forkserver_preload,
    forkserver_running,
    is_iterator_timeout,
    iterator_workers,
    owed_worker,
    sem_unlink,
    semaphore_finalizers,
    semaphore_name,
    set_iterator_timeout,
    shutdown_workers,
    start_forkserver,
    tracker_unregister,
    worker_new_shared,
)

logger = logging.getLogger(__name__)

START_METHODS = ("auto", "fork", "forkserver", "spawn")
DEFAULT_TIMEOUT = 600.0  # seconds a worker may take for any batch after its first
DEFAULT_FIRST_BATCH_TIMEOUT = 1800.0  # for the first batch of a pass: start, plan, first reads
PARENT_POLL_S = 1.0
STATUS_CHECK_S = 5.0  # DataLoader's own MP_STATUS_CHECK_INTERVAL: how often worker liveness is checked
# Imported once by the forkserver's server, so each worker it forks starts without importing them
# (measured: 0.25 s per worker start without, 0.07 s with).
PRELOAD = ("torch", "numpy.random", "shardstream.loader")
# Preloaded as well once a loader over a dataset on object storage asks (make_loader): the S3
# client's modules, which each new worker would otherwise import at its first read (botocore's
# credential chain 0.3-0.8 s, obstore), so the first batch does not wait for them in every worker.
# The server imports them only; it makes no request, so its children start obstore afresh.
REMOTE_PRELOAD = ("botocore.session", "botocore.credentials", "obstore.store")
MAIN_PRELOAD = "shardstream.loader.mainpreload"  # imports the main script in the server (see there)
MAIN_ENV = "SHARDSTREAM_FORKSERVER_MAIN"  # [the script's path, sys.argv] as JSON, for MAIN_PRELOAD
_preload_remote = False
_PR_SET_PDEATHSIG = 1


ENV_START_METHOD = "SHARDSTREAM_START_METHOD"  # read by make_loader when start_method="auto"
_process_method: str | None = None  # what "auto" means in this process, fixed by its first "auto" loader


def resolve_start_method(start_method: str) -> tuple[str, str]:
    """(the start method, why) for ``make_loader``'s ``start_method``, decided once per process.

    ``"auto"`` (the default) is ``forkserver`` (what Python 3.14 chooses by default on Linux),
    unless ``SHARDSTREAM_START_METHOD`` names another (read once, by the first "auto" loader of the
    process): every later "auto" loader gets the same, so a run never changes method between
    passes or loaders. A loader that asks for a method gets it; one asking for another than the
    process's "auto" loaders chose is warned that one process then starts workers two ways."""
    global _process_method
    if start_method not in START_METHODS:
        raise ConfigError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
    if start_method == "auto":
        if _process_method is not None:
            return _process_method, "this process's start method, fixed by its first loader"
        asked = os.environ.get(ENV_START_METHOD, "").strip()
        if asked:
            if asked not in START_METHODS[1:]:
                raise ConfigError(f"{ENV_START_METHOD} must be one of {', '.join(START_METHODS[1:])}, got {asked!r}")
            method, why = asked, f"{ENV_START_METHOD}={asked}"
        else:
            method, why = "forkserver", "the default: no fork of a process that has threads"
    else:
        method, why = start_method, "asked for"
        if _process_method is not None and method != _process_method:
            logger.warning(
                "shardstream: this loader's workers start with %s, while this process's earlier loaders chose %s: "
                "one start method per process is what docs/training.md describes",
                method,
                _process_method,
            )
            return method, why
    if method == "fork" and not hasattr(os, "fork"):
        raise ConfigError("start_method='fork': this platform has no fork()")
    if start_method == "auto":
        _process_method = method
    return method, why


def _reduce_generator(gen: Any) -> Any:
    """A CPU ``torch.Generator`` as its state's bytes, for workers that are not forked. torch pickles
    it with its state tensor, which multiprocessing's pickler sends as a shared-memory file that
    the worker then fails to map ("unable to resize file ... Invalid argument"): a transform
    holding a generator (as ``bind`` suggests) killed every forkserver or spawn worker."""
    if gen.device.type != "cpu":
        return gen.__reduce__()
    return _rebuild_generator, (gen.get_state().numpy().tobytes(),)


def _rebuild_generator(state: bytes) -> Any:
    import torch

    gen = torch.Generator()
    gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return gen


def _register_generator() -> None:
    from multiprocessing.reduction import ForkingPickler

    import torch

    ForkingPickler.register(torch.Generator, _reduce_generator)


def context(method: str, start: bool = False) -> Any:
    """The multiprocessing context for ``method``; forkserver's server preloads torch and shardstream
    (and the main script, where it may: ``_main_to_preload``), so a worker starts without importing them.
    ``start``: start the server now if it is not running (``private.start_forkserver``: from this
    process's ``sys.path``, which multiprocessing's own start of it ignores on Python 3.11)."""
    if method != "fork":
        _register_generator()
    if method == "forkserver":
        if not forkserver_running():  # not started yet: preload counts
            preload = forkserver_preload()
            ours = PRELOAD + (REMOTE_PRELOAD if _preload_remote else ())
            script = _main_to_preload()
            if script is not None:  # (multiprocessing's own preload of __main__ never gets the path: mainpreload.py)
                os.environ[MAIN_ENV] = json.dumps([script, sys.argv])
                ours += (MAIN_PRELOAD,)
            else:
                os.environ.pop(MAIN_ENV, None)  # (one inherited from a parent names its script, not this one)
            multiprocessing.set_forkserver_preload([*preload, *(m for m in ours if m not in preload)])
        if start:
            start_forkserver()  # (a no-op if running; waits for a start under way in another thread)
    return multiprocessing.get_context(method)


def _main_to_preload() -> str | None:
    """The main script's path when the forkserver may import it (``mainpreload.py``): a script run
    by its path whose loaders start inside its ``if __name__ == "__main__":`` block, or from
    functions (the caller's frames say), so that importing it runs no training. None otherwise:
    ``python -m``, ``-c``, an interactive session, no guard, or a loader made at its top level."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or getattr(main, "__spec__", None) is not None or not path.endswith(".py"):
        return None
    guards = _main_guards(path)
    if not guards:
        return None
    line = _main_line(path, vars(main))  # (None: called from inside a function)
    if line is not None and not any(first <= line <= last for first, last in guards):
        return None
    return os.path.abspath(path)


def preload_remote() -> None:
    """Have the forkserver's server (if it has not started yet) preload the S3 client's modules too."""
    global _preload_remote
    _preload_remote = True


def warm_forkserver() -> threading.Thread | None:
    """Start the forkserver's server now, in a background thread, if it is not running: it takes
    1.4-2.1 s (a new interpreter importing torch and shardstream), which ``make_loader`` then
    overlaps with what the script does before its first pass (building the model, wrapping it in
    DDP, loading a checkpoint) instead of adding it to the first batch. The first pass waits for
    it if it is not up yet; a failure here is left to that pass, which starts the server again and
    raises what it raises. Returns the thread (None: already running)."""
    if forkserver_running():
        return None
    context("forkserver")  # its preload list, before the server starts

    def start() -> None:
        try:
            start_forkserver()
        except Exception:  # noqa: BLE001 - the pass starts it again and reports
            logger.debug("shardstream: the forkserver did not start ahead of the first pass", exc_info=True)

    thread = threading.Thread(target=start, name="shardstream-forkserver-start", daemon=True)
    thread.start()
    return thread


def check_picklable(method: str, why: str, **parts: Any) -> None:
    """Workers that are not forked receive the dataset and the loader's functions pickled (what a
    worker cannot import, such as a notebook's function or a lambda, by value: portable.py): say
    which part cannot be, and what to do, before any worker starts."""
    for name, obj in parts.items():
        if obj is None:
            continue
        try:
            pickle.dumps(obj)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"DataLoader workers start with {method!r} here ({why}), so the {name} is sent to them pickled, and it "
                f"cannot be: {exc}. An object that holds an open file, a lock, a socket or a generator cannot travel: "
                f"create it in the transform (or in worker_init_fn) instead, or pass start_method='fork' to make_loader"
            ) from exc


def main_without_file() -> None:
    """For workers that are not forked, when the main module's ``__file__`` names no file:
    ``python -`` sets it to ``"<stdin>"``, and multiprocessing's ``spawn.prepare`` then has every
    worker (spawned or forkserver's) run that path as the main script, which fails before the
    worker starts (FileNotFoundError). Such a main is treated as ``python -c``'s, which has no
    ``__file__``: the attribute is removed, once (it named nothing a program could open)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str) or getattr(main, "__spec__", None) is not None:
        return
    if not os.path.isfile(path):
        logger.debug("shardstream: __main__.__file__ %r names no file (python -): removed, as for python -c", path)
        del main.__file__


def check_main_guarded(method: str) -> None:
    """ConfigError when workers that start with ``method`` (forkserver, spawn) are about to start
    from the top level of the main script, outside ``if __name__ == "__main__":``. Such a worker
    imports the script again (as ``__mp_main__``) and runs its top-level code: it builds the stream
    and starts workers of its own, which multiprocessing refuses, and the loop would only see
    DataLoader's "worker exited unexpectedly". Said here, before any worker starts. A script whose
    source cannot be read or parsed is not judged."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:  # an interactive session, python -c: nothing is imported again
        return
    line = _main_line(path, vars(main))
    if line is None:  # called from a function the script's guard (or another module) called
        return
    guards = _main_guards(path)
    if guards is None or any(first <= line <= last for first, last in guards):
        return
    raise ConfigError(
        f"{path}, line {line}: DataLoader workers start here from the script's top level, and a worker started with "
        f"{method} imports the script again and would run this code too (then fail starting workers of its own): "
        f"add `if __name__ == '__main__':` around your training code (workers start from {method} here, see docs/training.md)"
    )


def _main_line(path: str, main_globals: dict[str, Any]) -> int | None:
    """The line of the main script's top level that this call comes from, None if it comes from
    inside a function. The frames are let go before returning: a frame held in a local of its own
    function is a reference cycle, and the callers' frames (the loader starting its workers, its
    DataLoader iterator) would then live until the garbage collector's next pass, whose shutdown
    of an iterator's workers waits DataLoader's 5 s status interval for each (its queues' own
    finalizers have run first)."""
    frame = inspect.currentframe()
    try:
        while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is main_globals and frame.f_code.co_filename == path):
            frame = frame.f_back
        return frame.f_lineno if frame is not None else None
    finally:
        del frame


@functools.lru_cache(maxsize=8)
def _main_guards(path: str) -> tuple[tuple[int, int], ...] | None:
    """The line ranges of the top-level ``if __name__ == "__main__":`` blocks of the script at
    ``path`` (None: unreadable or not Python); read once per script, not at every pass."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    return tuple((n.lineno, n.end_lineno or n.lineno) for n in tree.body if isinstance(n, ast.If) and _tests_main(n.test))


def _tests_main(test: ast.expr) -> bool:
    """Whether an ``if`` test compares ``__name__`` with ``"__main__"`` (either way round, maybe within an and/or)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(isinstance(p, ast.Name) and p.id == "__name__" for p in parts) and any(
                isinstance(p, ast.Constant) and p.value == "__main__" for p in parts
            ):
                return True
    return False


# -- in the worker --------------------------------------------------------------------------------
def die_with_parent(main_pid: int, forked: bool, main_thread: bool = True) -> None:
    """In a worker, first thing: be killed when the rank goes. ``main_pid`` is the rank's pid: the
    parent of a forked or spawned worker; a forkserver's worker has the server as its parent, and
    watches the rank itself (below). ``main_thread``: whether the rank's main thread started the
    worker. ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits, not the
    process: a worker started from another thread (an iterator made in a thread that then ends)
    would be killed with the rank alive, so such a worker watches the rank's pid instead."""
    if forked and os.getppid() != main_pid:
        os.kill(os.getpid(), signal.SIGKILL)  # orphaned before we got here
    parent = os.getppid()
    # A forkserver's server is single-threaded (its thread lives as long as it does)
    if sys.platform.startswith("linux") and (main_thread or parent != main_pid):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # not glibc/musl: the thread below still watches
            pass
    if os.getppid() != parent:  # the parent went between the check and prctl
        os.kill(os.getpid(), signal.SIGKILL)
    # A forkserver's worker holds the server's "alive" pipe open, so the server outlives the rank as
    # long as the worker lives: the worker watches the rank itself (a pidfd where there is one), as
    # does a worker that no parent-death signal covers.
    rank = None
    if main_pid != parent or not main_thread:
        try:
            rank = os.pidfd_open(main_pid)
        except (AttributeError, OSError):  # no pidfd (older kernel, not Linux): polled by pid
            rank = -1
    threading.Thread(target=_watch, args=(parent, main_pid, rank), name="shardstream-parent-watch", daemon=True).start()


def _watch(parent: int, main_pid: int, rank: int | None) -> None:
    while os.getppid() == parent:
        if rank is not None and rank >= 0:
            if select.select([rank], [], [], PARENT_POLL_S)[0]:  # readable: the rank exited
                break
            continue
        if rank is not None and not _pid_alive(main_pid):
            break
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# A worker keeps the heap memory it frees for its next batches instead of handing it back to the
# kernel (glibc's malloc; elsewhere nothing changes). Left to glibc, each large sample (a 4 MiB
# member joined from its pieces, a batch's buffers) is fresh memory: mapped, then zeroed and mapped
# page by page on first touch, then unmapped or trimmed when the batch is handed off. On s3rver
# with 2 workers and 4 MiB samples that was 136 page faults per MB and 0.2 ms of a worker's CPU
# per MB (BENCHMARKS.md, "Fewer copies and page faults on S3"). Allocations up to MMAP_THRESHOLD
# come from the heap, and up to TRIM_THRESHOLD of free memory at its top is kept: a worker's
# memory stays at its high-water mark (its read-ahead budget and the batches it has in flight).
# SHARDSTREAM_KEEP_FREED_MEMORY=0 in the rank's environment leaves the workers at glibc's defaults
# (memory handed back as soon as glibc sees fit, each large sample fresh memory).
KEEP_FREED_ENV = "SHARDSTREAM_KEEP_FREED_MEMORY"
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h


def keep_freed_memory() -> bool:
    """In a worker: glibc's malloc keeps freed memory for reuse (see above). False where the C
    library has no ``mallopt`` (musl, macOS) or refuses the values."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


class WorkerStart:
    """The loader's ``worker_init_fn``: die with the rank, keep freed memory (``keep_freed_memory``),
    the hand-off's segment pool (if any), then the user's function. A class, not a closure, so it pickles for workers that are not forked."""

    def __init__(self, channels: Any = None, fn: Callable[[int], Any] | None = None, inline_bytes: int = 0):
        self.channels, self.fn = channels, fn
        self.inline_bytes = inline_bytes  # tensors up to this size cross as bytes (PackInWorker): no shared memory for them
        self.main_pid = os.getpid()
        self.method = "fork"  # set by the loader before each set of workers starts
        self.environ: dict[str, str] | None = None  # the rank's environment, for workers a forkserver forks
        self.main_thread = True  # whether the rank's main thread starts this set of workers

    def __reduce__(self) -> Any:
        return reduce_portable(self)  # the user's worker_init_fn by value where a worker could not import it

    def start(self, method: str) -> None:
        """In the main process, just before a set of workers starts with ``method``."""
        self.method = method
        self.main_thread = threading.current_thread() is threading.main_thread()
        # A forkserver's workers inherit the server's environment, taken when it started: they get
        # the rank's as it is now instead, as a forked or spawned worker would (credentials, settings).
        self.environ = dict(os.environ) if method not in ("fork", "spawn") else None

    def __call__(self, worker_id: int) -> None:
        die_with_parent(self.main_pid, self.method == "fork", self.main_thread)
        if self.environ is not None and self.environ != os.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.environ.get(KEEP_FREED_ENV, "1") != "0":
            keep_freed_memory()
        if self.inline_bytes:  # torch's shared storages: small ones private, large ones from the pool (if any)
            worker_new_shared(self.inline_bytes, pooled_shared)
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        stats = getattr(info.dataset if info is not None else None, "_stats", None)
        if stats is not None:  # the loader's watchdog (and semaphore reclaim) sees this worker started
            stats.counters(worker_id).step(f"started ({self.method}), running worker_init_fn")
        if self.channels is not None:
            self.channels.start_worker(worker_id)
        if self.fn is not None:
            self.fn(worker_id)


# -- in the main process: named semaphores -------------------------------------------------------
# Workers that are not forked open the DataLoader's queues and events by name: each lock is a named
# POSIX semaphore in /dev/shm (``sem.mp-*``), unlinked when it is collected or, if this process dies,
# by multiprocessing's resource tracker. A kill -9 of the job's process group killed the tracker
# too and left every name: the tracker is started here in a session of its own, so it outlives a
# kill of the group, sees the job's end and unlinks what is left (shared.isolate_resource_tracker). Once every worker has started
# (opened them all), the loader unlinks its own semaphores' names at once, and the objects work on
# through their handles.
def _semaphore_names(obj: Any, depth: int = 0, seen: set[int] | None = None) -> set[str]:
    """The names of the named semaphores inside ``obj`` (a DataLoader iterator, and within it its
    multiprocessing queues, events, conditions and locks)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return set()
    seen.add(id(obj))
    if isinstance(obj, synchronize.SemLock):
        name = semaphore_name(obj)
        return {name} if name else set()
    if isinstance(obj, (list, tuple)):
        return set().union(*(_semaphore_names(o, depth + 1, seen) for o in obj)) if obj else set()
    module = type(obj).__module__ or ""
    if depth and not module.startswith("multiprocessing"):
        return set()
    names: set[str] = set()
    for value in getattr(obj, "__dict__", {}).values():
        names |= _semaphore_names(value, depth + 1, seen)
    return names


def unlink_semaphores(batches: Any) -> int:
    """Unlink the names of the named semaphores of ``batches`` (a DataLoader iterator): their
    finalizers cancelled, the resource tracker told. Nothing of them stays in /dev/shm, whatever
    happens to this process; other loaders' semaphores are not touched. Returns how many."""
    names = _semaphore_names(batches)
    done = 0
    for name, fin in semaphore_finalizers(-1):
        if name not in names:
            continue
        fin.cancel()
        try:
            sem_unlink(name)
        except FileNotFoundError:
            pass
        tracker_unregister(name, "semaphore")
        done += 1
    return done


# -- in the main process: the watchdog ------------------------------------------------------------
def watched(
    batches: Any,
    *,
    stats: Any,
    rank: int,
    timeout: float | None,
    first_timeout: float | None,
    semaphores: bool = False,
    method: str | None = None,
) -> Any:
    """Yield ``batches`` (a DataLoader iterator) with every wait bounded: ``first_timeout`` for the
    first batch, ``timeout`` for each later one (None: unbounded). A wait past its bound raises
    WorkerTimeout naming the worker that owes the next batch and its last step; a worker that
    died raises WorkerDied (DataLoader's own error says only "exited unexpectedly"). With
    ``semaphores``, the names of the iterator's named semaphores are unlinked once every worker
    has started. ``method``: how the workers started (for the message)."""
    workers = iterator_workers(batches)
    if workers is None:  # no worker processes: nothing to watch
        yield from batches
        return
    started = time.monotonic()
    bound = first_timeout
    while True:
        # Waited for in slices of at most MP_STATUS_CHECK_INTERVAL: after each, DataLoader checks that
        # its workers live (workers forked by a forkserver are not our children: no SIGCHLD tells).
        waiting = time.monotonic()
        while True:
            left = None if bound is None else bound - (time.monotonic() - waiting)
            set_iterator_timeout(batches, STATUS_CHECK_S if left is None else max(min(STATUS_CHECK_S, left), 0.001))
            try:
                batch = next(batches)
                break
            except StopIteration:
                return
            except RuntimeError as exc:
                if not is_iterator_timeout(exc):
                    died = _died(batches, stats, rank, str(exc), method)  # a worker gone: a bare RuntimeError
                    _shut_down(batches)
                    traceback.clear_frames(exc.__traceback__)  # (a worker's own RuntimeError: as below)
                    if died is not None:
                        raise died from exc
                    raise
                if left is not None and left <= STATUS_CHECK_S:
                    message = _late_worker(batches, stats, rank, bound or 0, time.monotonic() - started)
                    _shut_down(batches)
                    raise WorkerTimeout(message) from None
            except BaseException as exc:  # a worker's exception, re-raised here; Ctrl-C
                _shut_down(batches)
                # DataLoader's reraise() holds the worker's error it raises: a cycle with every frame up
                # to the user's (this loader with them) until a full garbage collection. The frames
                # below this one are done: their locals go, their lines stay in the traceback.
                traceback.clear_frames(exc.__traceback__)
                raise
        bound = timeout
        if semaphores and all(_has_started(stats, i, w) for i, w in enumerate(workers)):
            unlink_semaphores(batches)
            semaphores = False
        yield batch


# DataLoader says a worker is gone with a bare RuntimeError naming its pid ("DataLoader worker (pid(s)
# 4711, 4712) exited unexpectedly", "... (pid 4711) is killed by signal: Killed."): told here by the
# type, the pids of this iterator's workers in the message and their exit codes, not by the words.
_SIGNAL_HINTS = {
    signal.SIGKILL: "SIGKILL comes from the kernel's OOM killer (dmesg says so) or a kill -9: if memory ran out, "
    "lower num_workers, Shuffle(buffer) or prefetch_factor",
    signal.SIGSEGV: "SIGSEGV is a crash in native code, such as a decoder or a C extension a transform calls: run with num_workers=0 to see where",
    signal.SIGBUS: "SIGBUS in a worker usually means shared memory ran out (/dev/shm, 64 MB in a default container): enlarge it",
    signal.SIGABRT: "SIGABRT: native code aborted; the worker's output above says why",
}


def _died(it: Any, stats: Any, rank: int, message: str, method: str | None) -> WorkerDied | None:
    """WorkerDied for the workers whose pids DataLoader's ``message`` holds, or for every worker that
    has exited when it holds none of theirs; None if none is found dead (another RuntimeError)."""
    workers = iterator_workers(it) or []
    pids = {int(p) for p in re.findall(r"\d+", message)} & {proc.pid for proc in workers}
    found = []
    for w, proc in enumerate(workers):
        if pids and proc.pid not in pids:
            continue
        proc.join(STATUS_CHECK_S if proc.pid in pids else 0)  # its exit code (a forkserver's child: sent by the server)
        if proc.exitcode is not None:
            found.append((w, proc))
    if not found:
        return None
    lines = []
    for w, proc in found:
        code = proc.exitcode
        hint = None
        if code < 0:
            try:
                sig = signal.Signals(-code)
            except ValueError:
                how = f"was killed by signal {-code}"
            else:
                how, hint = f"was killed by {sig.name}", _SIGNAL_HINTS.get(sig)
        else:
            how = f"exited with code {code}"
        line = stats.worker_line(w)
        if line is not None and line[0] == proc.pid:
            _, ago, made, what = line
            where = f"after {made} batches this pass; its last step, {ago:.0f} s ago: {what}"
        else:
            where = "before it started its pass"
            if code > 0 and method is not None and method != "fork" and _main_runs_again():
                hint = _unguarded_hint(method)
        lines.append(f"worker {w} (pid {proc.pid}) {how} {where}" + (f". {hint}" if hint else ""))
    first = found[0][1]
    return WorkerDied(f"rank {rank}: DataLoader " + "; ".join(lines), worker=found[0][0], pid=first.pid, exitcode=first.exitcode)


def _main_runs_again() -> bool:
    """Whether a worker that is not forked runs the main script again (multiprocessing imports it
    by its path): not in a notebook, ``python -``, ``python -c`` or ``python -m``, where the main
    guard's advice does not apply."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return isinstance(path, str) and os.path.isfile(path) and getattr(main, "__spec__", None) is None


def _unguarded_hint(method: str) -> str:
    return (
        f"A worker started with {method} imports the script again; if its training code is not under "
        "`if __name__ == '__main__':`, the worker runs it and fails: add `if __name__ == '__main__':` around your "
        f"training code (workers start from {method} here, see docs/training.md)"
    )


def _shut_down(batches: Any) -> None:
    """Stop a failed pass's workers now, while its queues are alive. Left to the iterator's
    ``__del__``, they are stopped when the exception's traceback is collected, a reference cycle
    in which the index queues are finalized first: the "stop" each worker is sent never reaches it,
    and DataLoader waits 5 s for each one before killing it (10 s per failed pass with 2 workers)."""
    shutdown_workers(batches)


def _has_started(stats: Any, index: int, proc: Any) -> bool:
    line = stats.worker_line(index)
    return line is not None and line[0] == proc.pid


def _late_worker(it: Any, stats: Any, rank: int, bound: float, elapsed: float) -> str:
    worker = owed_worker(it)
    workers = iterator_workers(it) or []
    which = [worker] if worker is not None else list(range(len(workers)))
    lines = []
    for w in which:
        proc = workers[w]
        line = stats.worker_line(w)
        if line is None or line[0] != proc.pid:
            lines.append(
                f"worker {w} (pid {proc.pid}) has not started its pass: no line of the dataset ran in "
                f"{elapsed:.0f} s since the pass began (a start that hung: a fork deadlock, or an import or "
                f"worker_init_fn that blocks)"
            )
        else:
            pid, ago, made, what = line
            lines.append(f"worker {w} (pid {pid}) made {made} batches this pass; its last step, {ago:.0f} s ago: {what}")
    return (
        f"rank {rank}: no batch from the DataLoader workers in {bound:g} s; "
        + "; ".join(lines)
        + ". Raise make_loader's timeout / first_batch_timeout if this is expected (slow storage, huge batches); "
        "py-spy dump --pid PID shows where a worker is stuck"
    )
