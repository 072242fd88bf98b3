"""Worker processes that start safely and die cleanly (loader/start.py, loader/procs.py): the
start method, the bounded waits' WorkerTimeout (thread workers' too), workers that die with their
rank, no named semaphore made at all, and a persistent worker that died replaced on the next pass."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import scaled, write_dataset

from shardstream import ShardStream, make_loader
from shardstream.errors import ConfigError, WorkerDied, WorkerTimeout
from shardstream.loader import start as workers
from shardstream.loader.start import resolve_start_method

_libc = ctypes.CDLL(None, use_errno=True)
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


@contextlib.contextmanager
def native_threads_entering_python(threads: int = 2):
    """Native threads (pthread_create, not Python's threading) that each run a Python callback and
    end, over and over: every run creates and deletes a Python thread state outside the GIL, as
    gloo's and pybind11's threads do. Python threads drive them and join them."""
    stop = threading.Event()
    entered = [0]

    def callback(_arg):
        entered[0] += 1
        return None

    cb = _CALLBACK(callback)  # kept alive for as long as the threads may call it

    def drive():
        tid = ctypes.c_ulong()
        while not stop.is_set():
            if _libc.pthread_create(ctypes.byref(tid), None, cb, None) == 0:
                _libc.pthread_join(tid, None)

    drivers = [threading.Thread(target=drive, name=f"native-driver-{i}") for i in range(threads)]
    for t in drivers:
        t.start()
    try:
        while entered[0] == 0:
            time.sleep(0.01)  # until a native thread has entered Python once (no event to wait on in C)
        yield entered
    finally:
        stop.set()
        for t in drivers:
            t.join()


@contextlib.contextmanager
def a_native_thread():
    """One native thread that waits in pause() until cancelled: a thread Python did not start."""
    tid = ctypes.c_ulong()
    pause = ctypes.cast(_libc.pause, ctypes.c_void_p)
    assert _libc.pthread_create(ctypes.byref(tid), None, pause, None) == 0
    try:
        yield
    finally:
        _libc.pthread_cancel(tid)
        _libc.pthread_join(tid, None)


@pytest.fixture(autouse=True)
def no_start_method_in_the_environment(monkeypatch):
    monkeypatch.delenv(workers.ENV_START_METHOD, raising=False)


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "ds", n=120, max_count=20)


def _keys(loader):
    return sorted(k for b in loader for k in b["__key__"])


_seen = [0]


def stall_in_worker_0_after_2_batches(batch):
    """A collate_fn (it runs in the worker on each batch) that stalls worker 0 at its third batch
    (module level: it pickles for forkserver workers)."""
    from shardstream import get_worker_info

    info = get_worker_info()
    if info is not None and info.id == 0:
        _seen[0] += 1
        if _seen[0] > 2:
            time.sleep(120)
    return batch


def hang_at_start(worker_id):
    time.sleep(120)


# -- the start method ---------------------------------------------------------------------------------
def test_auto_is_forkserver_and_a_method_asked_for_is_given(dataset):
    ds = ShardStream(dataset, batch_size=10)
    with a_native_thread():  # threads no longer choose anything
        loader = make_loader(ds, num_workers=2, workers="processes")
    assert loader.start_method == "forkserver"
    assert _keys(loader) == sorted(f"s{i:06d}" for i in range(120))
    assert loader._context.get_start_method() == "forkserver"
    assert make_loader(ds, num_workers=1, workers="processes").start_method == "forkserver"
    assert resolve_start_method("spawn") == ("spawn", "asked for")
    assert make_loader(ds, num_workers=1, start_method="spawn")._context.get_start_method() == "spawn"
    assert resolve_start_method("auto")[0] == "forkserver"  # a loader that asked for another changes no later one
    with pytest.raises(ConfigError, match="start_method must be one of"):
        make_loader(ShardStream(dataset, batch_size=10), num_workers=1, start_method="thread")


def test_the_environment_variable_chooses_the_method_of_each_loader(dataset, monkeypatch):
    monkeypatch.setenv(workers.ENV_START_METHOD, "fork")
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(ds, num_workers=2, workers="processes")
    assert loader.start_method == "fork" and _keys(loader) == sorted(f"s{i:06d}" for i in range(120))
    monkeypatch.setenv(workers.ENV_START_METHOD, "spawn")  # read by each loader as it is made
    assert make_loader(ds, num_workers=2, workers="processes").start_method == "spawn"


def test_a_bad_environment_variable_is_a_config_error(dataset, monkeypatch):
    monkeypatch.setenv(workers.ENV_START_METHOD, "threads")
    with pytest.raises(ConfigError, match="SHARDSTREAM_START_METHOD must be one of fork, forkserver, spawn, got 'threads'"):
        make_loader(ShardStream(dataset, batch_size=10), num_workers=2)


class HoldsLock:
    """A transform that holds what cannot travel to a worker (a lock)."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()

    def __call__(self, sample):
        return sample


def test_a_lambda_goes_to_forkserver_workers_and_what_cannot_travel_says_what_to_do(dataset):
    ds = ShardStream(dataset, batch_size=10, transform=lambda s: s)
    assert len(_keys(make_loader(ds, num_workers=1, workers="processes"))) == 120  # by value (shardstream.portable)
    held = make_loader(ShardStream(dataset, batch_size=10, transform=HoldsLock()), num_workers=1, workers="processes")
    for _epoch in range(2):  # the same error in epoch 0 as later: the method does not change
        with pytest.raises(ConfigError, match="the dataset is sent to them pickled.*lock.*start_method='fork'"):
            list(held)
    held_fork = make_loader(ShardStream(dataset, batch_size=10, transform=HoldsLock()), num_workers=1, workers="processes", start_method="fork")
    assert len(_keys(held_fork)) == 120
    assert len(_keys(make_loader(ShardStream(dataset, batch_size=10, transform=HoldsLock()), num_workers=1))) == 120  # threads: nothing travels


class Jitter:
    """A transform holding a torch.Generator, seeded per worker by bind (as docs/training.md shows)."""

    def __init__(self):
        import torch

        self.rng = torch.Generator()

    def bind(self, epoch, rank, worker):
        self.rng.manual_seed(1000 * epoch + worker)

    def __call__(self, sample):
        import torch

        sample["noise"] = int(torch.randint(0, 1 << 30, (1,), generator=self.rng))
        return sample


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_transform_holding_a_torch_generator_reaches_workers_that_are_not_forked(dataset, method):
    """torch sends a generator's state as a shared-memory file its workers could not map: every worker died."""

    def noise(how):
        loader = make_loader(ShardStream(dataset, batch_size=10, transform=Jitter()), num_workers=2, workers="processes", start_method=how)
        return [n for b in loader for n in b["noise"].tolist()]

    fork, got = noise("fork"), noise(method)
    assert len(got) == 120 and sorted(got) == sorted(fork)  # seeded by bind: the same numbers however workers start


# -- the watchdog ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_worker_that_stalls_mid_pass_raises_worker_timeout_naming_it_and_its_step(dataset, method):
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(
        ds, num_workers=2, workers="processes", timeout=3, first_batch_timeout=60, start_method=method, collate_fn=stall_in_worker_0_after_2_batches
    )
    got = []
    with pytest.raises(WorkerTimeout) as info:
        for batch in loader:
            got.append(batch)
    message = str(info.value)
    assert message.startswith("rank 0: no batch from the DataLoader workers in 3 s")
    assert "worker 0 (pid " in message and "made 3 batches this pass; its last step" in message
    assert "made batch 3 of 6 of epoch 0" in message  # its last step: the batch it is stuck handing over
    assert len(got) >= 2  # the bound applies after the first batch, with its own bound before it
    assert isinstance(info.value, TimeoutError)


def stall_thread_worker_1(batch):
    from shardstream import get_worker_info

    info = get_worker_info()
    if info is not None and info.id == 1:
        time.sleep(scaled(8))  # (a thread cannot be stopped: it ends by itself, after the test's wait)
    return batch


def test_a_thread_worker_that_stalls_raises_worker_timeout_naming_it(dataset):
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(ds, num_workers=2, timeout=1, first_batch_timeout=1, collate_fn=stall_thread_worker_1)
    with pytest.raises(WorkerTimeout, match=r"no batch from the thread workers in 1 s; thread worker 1 "):
        list(loader)


def test_a_worker_that_never_starts_its_pass_is_named_by_the_first_batch_bound(dataset):
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(ds, num_workers=1, workers="processes", first_batch_timeout=2, worker_init_fn=hang_at_start)
    with pytest.raises(
        WorkerTimeout,
        match=r"no batch from the DataLoader workers in 2 s; worker 0 \(pid \d+\) made 0 batches"
        r".*started \(forkserver\), running worker_init_fn",
    ):
        next(iter(loader))


# -- workers die with their rank --------------------------------------------------------------------------
def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
                out.append(int(entry))
    return out


def _worker_pids(main: int, method: str) -> list[int]:
    """The DataLoader workers of ``main``: its children, or its forkserver's."""
    kids = _children_of(main)
    if method == "fork":
        return [p for p in kids if b"multiprocessing" not in open(f"/proc/{p}/cmdline", "rb").read()]
    servers = [p for p in kids if b"forkserver" in open(f"/proc/{p}/cmdline", "rb").read()]
    return [w for s in servers for w in _children_of(s)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ", 1)[1][:1] != b"Z"
    except OSError:
        return False


STARTED_SCRIPT = textwrap.dedent("""
    import sys, time
    from multiprocessing import synchronize
    from shardstream import ShardStream, make_loader

    names = []  # every named semaphore this rank makes (a multiprocessing lock, queue or event would)
    init = synchronize.SemLock.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        names.append(self._semlock.name)

    synchronize.SemLock.__init__ = recording  # (the test watches; shardstream replaces nothing)

    if __name__ == "__main__":
        ds = ShardStream(sys.argv[1], batch_size=10)
        it = iter(make_loader(ds, num_workers=2, workers="processes", start_method=sys.argv[2], prefetch_factor=1))
        next(it)
        next(it)
        print(" ".join(["ready", str(len(names))]), flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_workers_die_with_their_rank_after_kill_9_and_leave_no_semaphore(tmp_path, dataset, method):
    script = tmp_path / "rank.py"
    script.write_text(STARTED_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), dataset, method],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        ready, made = proc.stdout.readline().split()
        assert ready == "ready"
        workers = _worker_pids(proc.pid, method)
        assert len(workers) == 2
        assert made == "0"  # no lock, queue or event of multiprocessing's: nothing named to leave in /dev/shm
        os.kill(proc.pid, signal.SIGKILL)  # the rank alone, as a preemption or an OOM kill does
        proc.wait()
        deadline = time.monotonic() + scaled(30)
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)  # the workers' watch thread sees their socket hang up
        assert not [w for w in workers if _alive(w)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- persistent workers that died -------------------------------------------------------------------------
def test_a_persistent_worker_killed_between_passes_is_replaced_on_the_next(dataset, capfd):
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(ds, num_workers=2, workers="processes", persistent_workers=True)
    expected = sorted(f"s{i:06d}" for i in range(120))
    assert _keys(loader) == expected
    procs = loader._runtime.procs
    old = [w.pid for w in procs]
    os.kill(old[0], signal.SIGKILL)
    procs[0].join(scaled(10))
    assert _keys(loader) == expected
    assert not set(w.pid for w in loader._runtime.procs) & set(old)
    del loader, procs
    assert _keys(make_loader(ShardStream(dataset, batch_size=10), num_workers=2)) == expected
    assert "can only test a child process" not in capfd.readouterr().err


def test_a_pass_whose_persistent_worker_dies_fails_and_the_next_pass_starts_new_workers(dataset, capfd):
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(ds, num_workers=2, workers="processes", persistent_workers=True, prefetch_factor=1)
    with pytest.raises(WorkerDied, match=r"DataLoader worker 1 \(pid \d+\) was killed by SIGKILL"):
        for i, _ in enumerate(loader):
            if i == 1:
                os.kill(loader._runtime.procs[1].pid, signal.SIGKILL)
    assert loader._runtime is None
    assert _keys(loader) == sorted(f"s{i:06d}" for i in range(120))
    del loader
    assert _keys(make_loader(ShardStream(dataset, batch_size=10), num_workers=2)) == sorted(f"s{i:06d}" for i in range(120))
    assert "can only test a child process" not in capfd.readouterr().err


# -- endurance ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hundreds_of_passes_beside_native_threads_entering_python_all_finish(tmp_path):
    """The reproduction of gh-112275 that hung a forking loader within 110-216 passes: with the
    default start method every pass finishes (a hang would end in the loader's WorkerTimeout, or
    at worst this test's timeout, with every stack)."""
    url = write_dataset(tmp_path / "ds", n=40, max_count=20)
    ds = ShardStream(url, batch_size=10)
    loader = make_loader(ds, num_workers=1, workers="processes", first_batch_timeout=60, timeout=60)
    expected = sorted(f"s{i:06d}" for i in range(40))
    with a_native_thread(), native_threads_entering_python(2) as entered:  # one always alive, as gloo's are
        passes = 0
        for _ in range(200):
            assert _keys(loader) == expected
            passes += 1
        assert entered[0] > passes  # the native threads kept entering Python the whole time
    assert passes == 200


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_workers_started_from_a_thread_outlive_that_thread(dataset, method):
    """A pass begun in a thread that then ends goes on in the main thread with the same workers alive
    (a worker watches its rank's socket, not the thread that started it)."""
    loader = make_loader(
        ShardStream(dataset, batch_size=10), num_workers=2, workers="processes", start_method=method, persistent_workers=False, prefetch_factor=1
    )
    it = iter(loader)
    first = []
    t = threading.Thread(target=lambda: first.append(next(it)))
    t.start()
    t.join()
    time.sleep(0.5)  # gives a wrongly sent parent-death signal time to land (not a wait for anything)
    rest = list(it)  # WorkerDied if the thread's end killed them
    assert sorted(k for b in first + rest for k in b["__key__"]) == sorted(f"s{i:06d}" for i in range(120))


# -- torch's default_collate in a worker ---------------------------------------------------------------
def small_and_large(sample):
    import torch

    i = int(sample["__key__"][-4:])
    return {"small": torch.full((1024,), i % 251, dtype=torch.uint8), "large": torch.full((96 * 1024,), i % 13, dtype=torch.uint8), "i": i}


def torch_collate(samples):
    from torch.utils.data import default_collate

    return default_collate(samples)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_torch_default_collate_in_a_worker_gives_the_batches_of_no_workers(dataset, method):
    ds = ShardStream(dataset, batch_size=8, shuffle=False, transform=small_and_large, collate=torch_collate)
    got = list(make_loader(ds, num_workers=2, workers="processes", start_method=method, pin_memory=False))
    inline = list(make_loader(ds, num_workers=0, pin_memory=False))
    by_samples = {tuple(b["i"].tolist()): b for b in inline}
    assert sorted(by_samples) == sorted(tuple(b["i"].tolist()) for b in got)
    for a in got:
        b = by_samples[tuple(a["i"].tolist())]
        assert torch_equal(a["small"], b["small"]) and torch_equal(a["large"], b["large"])
        assert a["small"].shape == (8, 1024) and a["large"].shape == (8, 96 * 1024)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_a_plan_before_make_loader_says_the_worker_count_is_not_known_yet(dataset):
    ds = ShardStream(dataset, batch_size=10)
    assert (
        ds.plan()
        .summary()
        .endswith(
            "1 workers per rank (assumed: the worker count is not known yet; make_loader(num_workers=...) sets it, or pass plan(num_workers=...))"
        )
    )
    assert ds.plan(num_workers=2).summary().endswith(", 2 workers per rank")
    make_loader(ds, num_workers=2)
    assert ds.plan().summary().endswith(", 2 workers per rank")  # the loader's count, no longer assumed
