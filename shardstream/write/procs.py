"""Worker processes for pack: tasks in, results out in task order, over one pipe per worker.

    tasks -> parent (at most ``ahead`` in flight, ``per_worker`` on each) -> Pipe -> worker: fn(task)
          <- results, reordered by task number <- Pipe <-

Built on the public API only: ``multiprocessing.get_context("spawn")`` (or ``"fork"``, see
below) ``.Process``, one duplex ``ctx.Pipe()`` per worker (a socketpair),
``multiprocessing.connection.wait`` over the pipes and ``Process.sentinel``. There is no Queue,
Lock, Event or Pool, so nothing here makes a named POSIX semaphore: a kill -9 of every process of
the job at once (a cgroup, SLURM, a container runtime; multiprocessing's resource tracker
included, which spawn starts beside the workers and which has nothing of ours to track) leaves
nothing in /dev/shm.

``context="fork"`` is for a caller whose workers need what it holds already (a local tree's
listing: ``write/localshards.ListedWork``): ``fn`` and its arguments are inherited, not pickled,
and a worker starts in milliseconds instead of a new Python's imports. ``fork_safe()`` says when
that is sound: on Linux, with no other Python thread in the process (a fork copies only the
thread that calls it; a lock another thread held stays held in the child). A forked worker
closes its copies of the parent's pipe ends (its own and earlier workers'), so that it still
sees its parent's death as the end of its pipe.

- A worker's exception comes back as the same exception (its traceback stays in the worker) and is
  raised here; one that cannot be pickled comes back as a RuntimeError with its type and first line.
- A worker that dies (killed, the OOM killer) is seen by its sentinel: ``WorkerDied``, one line
  naming the worker, its pid, the signal or exit code and the task it held.
- Ctrl-C (or any error) in the parent stops the workers by PID: terminate, a bounded join, kill.
  Workers start with SIGINT ignored (inherited through exec, before they import anything), so a
  terminal's Ctrl-C reaches only the parent, which says what happened in one line.
- A worker whose parent is gone sees the end of its pipe (a thread of its own reads it) and exits.

A worker reads tasks on a thread of its own into a local deque, so the parent's send of a task
never waits on a worker busy sending a result (two processes each blocked in a send to the other
would wait for good).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable, Generator, Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

from shardstream.errors import WorkerDied

JOIN_SECONDS = 5.0  # a stopped worker's bounded wait, after SIGTERM and again after SIGKILL
_STOP = None  # the parent's "no more tasks"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling as itself, else a RuntimeError of its type and first line."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:  # noqa: BLE001 - any failure to pickle or rebuild: sent as text
        pass
    return RuntimeError(_first_line(exc))


def fork_safe() -> bool:
    """Whether ``Workers(..., context="fork")`` is sound here: Linux, and no Python thread but this one."""
    return sys.platform.startswith("linux") and threading.active_count() == 1


def _serve(conn: Connection, payload: bytes | tuple, siblings: tuple[Connection, ...] = ()) -> None:
    """A worker's life: unpickle (fn, initializer, initargs) (a forked worker has them as they
    are), then ``fn(task)`` for each task, in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (already ignored since exec or fork; kept if started otherwise)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (a forked worker's copy of its parent's handler: stop() ends it)
    for sibling in siblings:  # a forked worker's copies of the parent's pipe ends (its own and earlier workers')
        sibling.close()
    tasks: collections.deque[Any] = collections.deque()
    ready = threading.Condition()

    def read() -> None:
        while True:
            try:
                task = conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the parent is gone (or gave up on us): nothing left to do it for
            with ready:
                tasks.append(task)
                ready.notify()
            if task is _STOP:
                return

    try:
        fn, initializer, initargs = pickle.loads(payload) if isinstance(payload, bytes) else payload
        if initializer is not None:
            initializer(*initargs)
    except Exception as exc:  # noqa: BLE001 - said by the parent, as the worker's own error
        failed: BaseException | None = _portable(exc)
    else:
        failed = None
    threading.Thread(target=read, name="shardstream-pack-tasks", daemon=True).start()
    while True:
        with ready:
            while not tasks:
                ready.wait()
            task = tasks.popleft()
        if task is _STOP:
            return
        if failed is not None:
            reply: tuple[bool, Any] = (False, failed)
        else:
            try:
                reply = (True, fn(task))
            except Exception as exc:  # noqa: BLE001 - the parent raises it
                reply = (False, _portable(exc))
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionResetError):
            os._exit(0)
        except Exception as exc:  # noqa: BLE001 - a result that cannot be pickled
            conn.send((False, RuntimeError(f"cannot send the result back: {_first_line(exc)}")))


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Workers:
    """``n`` worker processes that run ``fn(task)``: spawned (``fn``, ``initializer`` and
    ``initargs`` pickled once, at start) or, with ``context="fork"`` where ``fork_safe()``,
    forked (inherited as they are). Use as a context manager; ``map`` runs tasks."""

    def __init__(
        self,
        fn: Callable[[Any], Any],
        n: int,
        *,
        initializer: Callable[..., Any] | None = None,
        initargs: tuple = (),
        name: str = "pack worker",
        context: str = "spawn",
    ):
        forked = context == "fork"
        if forked and not fork_safe():
            raise RuntimeError("fork workers need Linux and a process with no other thread (procs.fork_safe())")
        # spawn by default: no fork of a process holding event-loop threads
        payload: bytes | tuple = (fn, initializer, initargs) if forked else pickle.dumps((fn, initializer, initargs))
        ctx: Any = multiprocessing.get_context(context)
        self.name = name
        self.forked = forked
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        # Children start with SIGINT ignored (inherited through fork and exec, before they import anything).
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGINT) if main else None
        if main:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for _ in range(n):
                ours, theirs = ctx.Pipe(duplex=True)
                args = (theirs, payload, (*self.conns, ours)) if forked else (theirs, payload)  # (its copies of our ends)
                proc = ctx.Process(target=_serve, args=args, name=f"shardstream-{name.replace(' ', '-')}", daemon=True)
                proc.start()
                theirs.close()  # the worker holds its end: its death reads as the end of ours
                self.procs.append(proc)
                self.conns.append(ours)
        except BaseException:
            self.stop()
            raise
        finally:
            if main:  # a handler installed outside Python reads as None: the default stands in for it
                signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)

    def map(
        self, tasks: Iterable[Any], *, ahead: int, per_worker: int = 2, describe: Callable[[Any], str] = lambda task: "a task"
    ) -> Generator[Any, None, None]:
        """``fn(task)`` of each task, in the tasks' order; at most ``ahead`` tasks in flight (and
        ``per_worker`` on each worker: the next is there when one ends). ``describe(task)`` names a
        task in a ``WorkerDied``. A worker's exception is raised here, once every worker is stopped."""
        it = iter(tasks)
        owned: list[collections.deque[int]] = [collections.deque() for _ in self.procs]
        held: dict[int, Any] = {}  # the tasks in flight, by number (named if their worker dies)
        done: dict[int, tuple[bool, Any]] = {}
        sent = wanted = 0
        exhausted = False
        while True:
            while not exhausted and sent - wanted < ahead:
                w = min(range(len(self.procs)), key=lambda i: len(owned[i]))
                if len(owned[w]) >= per_worker:
                    break
                task = next(it, _STOP)
                if task is _STOP:
                    exhausted = True
                    break
                held[sent] = task
                try:
                    self.conns[w].send(task)
                except (BrokenPipeError, ConnectionResetError):  # dead: named by the task it held, if any
                    self._died(w, held[owned[w][0]] if owned[w] else task, describe)
                owned[w].append(sent)
                sent += 1
            if wanted == sent and exhausted:
                return
            while wanted not in done:
                busy = [i for i in range(len(self.procs)) if owned[i]]
                ready = wait([self.conns[i] for i in busy] + [self.procs[i].sentinel for i in busy])
                for i in busy:
                    if self.conns[i] in ready:
                        try:
                            reply = self.conns[i].recv()
                        except (EOFError, OSError):
                            self._died(i, held[owned[i][0]], describe)
                        done[owned[i].popleft()] = reply
                    elif self.procs[i].sentinel in ready:
                        self._died(i, held[owned[i][0]], describe)
            ok, value = done.pop(wanted)
            del held[wanted]
            wanted += 1
            if not ok:
                self.stop()
                raise value
            yield value

    def _died(self, i: int, task: Any, describe: Callable[[Any], str]) -> None:
        proc = self.procs[i]
        proc.join(JOIN_SECONDS)  # (its pipe ended: its exit code is there at once)
        message = f"{self.name} {i} (pid {proc.pid}) {_exit_text(proc.exitcode)} while on {describe(task)}"
        if proc.exitcode == -signal.SIGKILL:
            message += " (the OOM killer sends SIGKILL: fewer --workers or smaller tasks use less memory)"
        code = proc.exitcode
        self.stop()
        raise WorkerDied(message, worker=i, pid=proc.pid, exitcode=code)

    def stop(self) -> None:
        """Stop every worker by its PID: terminate, a bounded join, kill, join. Idempotent."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in self.procs:
            proc.join(JOIN_SECONDS)
            if proc.exitcode is None:
                proc.kill()
                proc.join(JOIN_SECONDS)
        self._close_pipes()

    def finish(self) -> None:
        """End idle workers the polite way (no more tasks), then as ``stop`` does past the bound."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(_STOP)
        for proc in self.procs:
            proc.join(JOIN_SECONDS)
        self.stop()

    def _close_pipes(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns = []

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.stop()


def map_in_order(
    fn: Callable[[Any], Any],
    tasks: Iterable[Any],
    *,
    workers: int | Workers,
    ahead: int,
    initializer: Callable[..., Any] | None = None,
    initargs: tuple = (),
    describe: Callable[[Any], str] = lambda task: "a task",
    name: str = "pack worker",
) -> Generator[Any, None, None]:
    """``fn(task)`` for each task on ``workers`` processes (or on ``Workers`` started already, for
    ``fn``: their start then overlaps the caller's work), results in the tasks' order (see
    ``Workers.map``). Close it (``contextlib.closing``) to stop the workers early; once the last
    result is taken the workers are already ended, before it is given."""
    pool = workers if isinstance(workers, Workers) else Workers(fn, workers, initializer=initializer, initargs=initargs, name=name)
    try:
        results = pool.map(tasks, ahead=ahead, describe=describe)
        last: list[Any] = []
        for value in results:
            if last:
                yield last.pop()
            last.append(value)
    except BaseException:
        pool.stop()
        raise
    # The workers end before the last result is given: a caller that stops at its last item (zip)
    # never asks again, and closes this generator at its last yield, which then stops nothing.
    pool.finish()
    yield from last
