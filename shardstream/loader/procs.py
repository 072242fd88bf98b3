"""Worker processes: a loader's workers as processes, each talking to the loop over one socket.

Each worker gets a copy of the dataset (pickled as it starts, unless forked) and iterates its share
of every pass it is told to run. Loop -> worker: ``("pass", n, prefetch, released)``;
``("credit", n, released)`` after each batch received (at most ``prefetch`` batches ahead);
``("stop", n)`` ends pass n early; ``("exit",)``; ``released``: the segments the loop let go.
Worker -> loop: ``("batch", origin, packed, dropped)`` with the descriptors of new segments
(handoff.py), ``("end",)``, ``("error", ...)`` (the worker's own exception, rebuilt in the loop).

Only public parts: a context's ``Process``, ``socket.socketpair``, ``send_fds``/``recv_fds``,
``multiprocessing.connection.wait``. No queue, lock or semaphore of multiprocessing's is made, so
nothing is named in /dev/shm and a kill of every process of the job leaves nothing behind. A worker
that exits is ``WorkerDied`` naming it, its signal or exit code and its last step (the rank's board,
stats.py); a worker dies with its rank (a thread of it waits for its socket to hang up).
"""

from __future__ import annotations

import os
import pickle
import random
import select
import signal
import socket
import struct
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from types import SimpleNamespace
from typing import Any

from shardstream.errors import WorkerDied
from shardstream.loader.handoff import Mappings, SegmentPool, pack
from shardstream.loader.workers import Workers
from shardstream.plan.topology import WorkerInfo, set_worker

_HEADER = struct.Struct("<QI")
MAX_FDS = 64  # new segments one message may carry
STOP_JOIN_S = 5.0  # how long workers are given to exit before they are killed
_SIGNAL_HINTS = {
    signal.SIGKILL: "SIGKILL comes from the kernel's OOM killer (dmesg says so) or a kill -9: if memory ran out, "
    "lower num_workers, Shuffle(buffer) or prefetch_factor",
    signal.SIGSEGV: "SIGSEGV is a crash in native code, such as a decoder or a C extension a transform calls: run with num_workers=0 to see where",
    signal.SIGBUS: "SIGBUS in a worker usually means memory for its batches ran out: lower prefetch_factor or the batch size",
    signal.SIGABRT: "SIGABRT: native code aborted; the worker's output above says why",
}


# -- messages ---------------------------------------------------------------------------------------
def send(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(body), len(fds or ()))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(body)


def recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and the descriptors that came with it; EOFError where the peer is gone."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
    if not head:
        raise EOFError("the other end closed its socket")
    size, _ = _HEADER.unpack(head + _exactly(sock, _HEADER.size - len(head)))
    return pickle.loads(_exactly(sock, size)), fds


def _exactly(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("the other end closed its socket mid-message")
        got += n
    return data


# -- in the worker ------------------------------------------------------------------------------------
def _die_with_rank(sock: socket.socket) -> None:
    """A worker whose rank is gone (its socket hung up) ends at once, whatever it is doing."""

    def watch() -> None:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP)
        while True:
            for _, event in poller.poll():
                if event & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    os._exit(0)

    threading.Thread(target=watch, name="shardstream-rank-watch", daemon=True).start()


def worker_main(spec: Any) -> None:
    """A worker process's life: start, then run the passes it is told to, until told to exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the loop's to handle: it stops the workers
    for fd in spec.close_fds:  # (forked: the loop's ends of every worker's socket)
        try:
            os.close(fd)
        except OSError:
            pass
    if spec.environ is not None and spec.environ != dict(os.environ):  # a forkserver's child: the rank's environment
        os.environ.clear()
        os.environ.update(spec.environ)
    sock: socket.socket = spec.sock
    _die_with_rank(sock)
    dataset = spec.dataset
    seed = spec.base_seed + spec.worker
    random.seed(seed)
    import numpy as np
    import torch

    torch.set_num_threads(1)  # as DataLoader's workers do: K workers, not K times torch's pool (a forked pool hangs)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    pool = SegmentPool()
    set_worker(WorkerInfo(spec.worker, spec.num_workers, seed, dataset, pool.take, spec.as_stored), thread=False)
    counters = dataset.counters  # (None where the dataset could not be rebuilt here: its first pass says why)
    if counters is not None:
        counters.counters(spec.worker).step(f"started ({spec.method}), running worker_init_fn")
    try:
        if spec.init_fn is not None:
            spec.init_fn(spec.worker)
    except BaseException as exc:  # noqa: BLE001 - said in the loop
        _send_error(sock, exc)
        return
    while True:
        try:
            message, _ = recv(sock)
        except (EOFError, OSError):
            return
        if message[0] == "exit":
            return
        if message[0] == "pass":
            pool.release(message[3])
            if not _run_pass(sock, dataset, spec.collate_fn, pool, message[1], message[2]):
                return
        elif message[0] == "credit":
            pool.release(message[2])


def _run_pass(sock: socket.socket, dataset: Any, collate: Callable[[Any], Any] | None, pool: SegmentPool, number: int, prefetch: int) -> bool:
    """One pass: each batch sent once the loop has room for it. False: told to exit (or gone)."""
    credits, stopping, leaving = prefetch, False, False

    def control(block: bool) -> None:
        nonlocal credits, stopping, leaving
        while block or select.select([sock], [], [], 0)[0]:
            block = False
            message, _ = recv(sock)
            if message[0] == "credit":
                pool.release(message[2])
                credits += message[1] == number
            elif message[0] == "stop" and message[1] == number:
                stopping = True
            elif message[0] == "exit":
                stopping = leaving = True

    batches: Iterator[Any] | None = None
    try:
        batches = iter(dataset)
        for batch in batches:
            origin = dataset.origin()
            if collate is not None:
                batch = collate(batch)
            control(False)
            while credits <= 0 and not stopping:
                control(True)
            if stopping:
                break
            packed, fds, dropped = pack(batch, pool)
            del batch
            send(sock, ("batch", origin, packed, dropped), fds)
            credits -= 1
        send(sock, ("end",))
    except (EOFError, BrokenPipeError, ConnectionError):
        return False
    except BaseException as exc:  # noqa: BLE001 - the worker's own error, said in the loop
        _send_error(sock, exc)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    return not leaving


def _send_error(sock: socket.socket, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    data: bytes | None = None
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - an exception that cannot travel: its type and words do
        data = None
    try:
        send(sock, ("error", data, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text))
    except OSError:
        pass


# -- in the loop's process ----------------------------------------------------------------------------
class ProcessWorkers(Workers):
    """A loader's set of worker processes (started by ``start``), their passes and their end."""

    def __init__(self, dataset: Any, num_workers: int, *, method: str, as_stored: bool = False, **kw: Any):
        super().__init__(dataset, num_workers, **kw)
        self.method, self.as_stored = method, as_stored
        self.procs: list[Any] = []
        self.socks: list[socket.socket] = []
        self.mappings = Mappings(num_workers)
        self._finalizer: weakref.finalize | None = None

    def start(self, context: Any) -> None:
        import torch

        base_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        environ = dict(os.environ) if self.method == "forkserver" else None
        pairs = [socket.socketpair() for _ in range(self.num_workers)]
        self.dataset.counters.clear_board()
        for w, (ours, theirs) in enumerate(pairs):
            # Forked: the loop's end of every socket, and the sockets of workers not started yet,
            # numbered as they are open now (a number closed before may be a new pipe's by now).
            close = [sock.fileno() for sock in (*self.socks, ours, *(x for pair in pairs[w + 1 :] for x in pair))]
            spec = SimpleNamespace(
                sock=theirs,
                dataset=self.dataset,
                worker=w,
                num_workers=self.num_workers,
                base_seed=base_seed,
                method=self.method,
                environ=environ,
                collate_fn=self.collate_fn,
                init_fn=self.init_fn,
                as_stored=self.as_stored,
                close_fds=close if self.method == "fork" else [],
            )
            proc = context.Process(target=worker_main, args=(spec,), name=f"shardstream-worker-{w}", daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.socks.append(ours)
        self._finalizer = weakref.finalize(self, _stop, list(self.procs), list(self.socks))

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def _begin(self, number: int) -> int:
        for w, sock in enumerate(self.socks):
            send(sock, ("pass", number, self.prefetch, self.mappings.take_released(w)))
        return number

    def _next(self, run: Any, w: int, bound: float | None) -> tuple[Any, Any] | None:
        message, fds = self._recv(w, bound)
        if message[0] == "end":
            return None
        if message[0] == "error":
            raise self._error(w, message)
        _, origin, packed, dropped = message
        batch = self.mappings.unpack(w, packed, fds, dropped, self.pin)
        send(self.socks[w], ("credit", run, self.mappings.take_released(w)))
        return origin, batch

    def _end(self, run: Any, done: bool, active: list[int]) -> None:
        """A pass left before its end: its workers told to stop, and what they still send drained."""
        if done:
            return
        try:
            for w in active:
                send(self.socks[w], ("stop", run))
            for w in active:
                while True:
                    message, fds = self._recv(w, self.timeout)
                    if message[0] != "batch":
                        break
                    self.mappings.unpack(w, message[2], fds, message[3], False)  # (mapped, then let go)
        except Exception:  # noqa: BLE001 - a worker that cannot stop cleanly is stopped
            self.stop()

    def _recv(self, w: int, bound: float | None) -> tuple[Any, list[int]]:
        sock, proc = self.socks[w], self.procs[w]
        started = time.monotonic()
        while True:
            left = None if bound is None else bound - (time.monotonic() - started)
            if left is not None and left <= 0:
                self.stop()
                raise self.late(w, bound or 0, self.procs[w].pid)
            ready = wait([sock, proc.sentinel], timeout=left)
            if sock in ready:
                try:
                    return recv(sock)
                except (EOFError, ConnectionError):
                    raise self._died(w) from None
            if proc.sentinel in ready:
                raise self._died(w)

    def _died(self, w: int) -> WorkerDied:
        proc = self.procs[w]
        proc.join(STOP_JOIN_S)
        code = proc.exitcode
        self.stop()
        hint = None
        if code is None:
            how = "closed its socket"
        elif code < 0:
            try:
                sig = signal.Signals(-code)
            except ValueError:
                how = f"was killed by signal {-code}"
            else:
                how, hint = f"was killed by {sig.name}", _SIGNAL_HINTS.get(sig)
        else:
            how = f"exited with code {code}"
        line = self.dataset.counters.worker_line(w)
        if line is not None and line[0] == proc.pid:
            _, ago, made, what = line
            where = f"after {made} batches this pass; its last step, {ago:.0f} s ago: {what}"
        else:
            where = "before it started its pass"
        return WorkerDied(
            f"rank {self.rank}: DataLoader worker {w} (pid {proc.pid}) {how} {where}" + (f". {hint}" if hint else ""),
            worker=w,
            pid=proc.pid,
            exitcode=code,
        )

    def _error(self, w: int, message: Any) -> BaseException:
        _, data, kind, words, text = message
        exc: BaseException | None = None
        if data is not None:
            try:
                exc = pickle.loads(data)
            except Exception:  # noqa: BLE001 - rebuilt from its words instead
                exc = None
        if exc is None:
            exc = RuntimeError(f"{kind}: {words}")
        exc.add_note(f"(raised in rank {self.rank}'s worker {w}, pid {self.procs[w].pid}; its traceback:)\n{text.rstrip()}")
        self.stop()
        return exc

    def stop(self) -> None:
        """End every worker now (told, then killed if it does not go)."""
        if self._finalizer is not None:
            self._finalizer()


def _stop(procs: list[Any], socks: list[socket.socket]) -> None:
    for sock in socks:
        try:
            send(sock, ("exit",))
        except OSError:
            pass
        sock.close()
    deadline = time.monotonic() + STOP_JOIN_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join(STOP_JOIN_S)
