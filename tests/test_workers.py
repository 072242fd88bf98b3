"""Workers that start safely and die cleanly (shardstream/workers.py): the start method chosen by
whether a fork could deadlock, the watchdog's WorkerTimeout, workers that die with their rank,
no named semaphore left in /dev/shm, and a persistent worker that died replaced on the next pass."""

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
from shardstream.loader import workers
from shardstream.loader.workers import resolve_start_method

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
def forget_the_process_method(monkeypatch):
    """The first loader of a process fixes its start method (workers.resolve_start_method): each
    test here starts as a fresh process would."""
    monkeypatch.setattr(workers, "_process_method", None)
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
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is not None and info.id == 0:
        _seen[0] += 1
        if _seen[0] > 2:
            time.sleep(120)
    return batch


def hang_at_start(worker_id):
    time.sleep(120)


# -- the start method ---------------------------------------------------------------------------------
def test_auto_is_forkserver_and_the_first_loader_fixes_it_for_the_process(dataset, caplog):
    ds = ShardStream(dataset, batch_size=10)
    with a_native_thread():  # threads no longer choose anything
        loader = make_loader(ds, num_workers=2)
    assert loader.start_method == "forkserver"
    assert _keys(loader) == sorted(f"s{i:06d}" for i in range(120))
    assert loader.pipeline[0].multiprocessing_context.get_start_method() == "forkserver"
    assert make_loader(ds, num_workers=1).start_method == "forkserver"
    assert resolve_start_method("spawn") == ("spawn", "asked for")  # asked: given, with a warning
    assert "one start method per process" in caplog.text
    assert resolve_start_method("auto")[0] == "forkserver"  # "auto" stays what the first loader chose
    with pytest.raises(ConfigError, match="start_method must be one of"):
        make_loader(ShardStream(dataset, batch_size=10), num_workers=1, start_method="thread")


def test_the_environment_variable_chooses_fork_for_the_process(dataset, monkeypatch):
    monkeypatch.setenv(workers.ENV_START_METHOD, "fork")
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(ds, num_workers=2)
    assert loader.start_method == "fork" and _keys(loader) == sorted(f"s{i:06d}" for i in range(120))
    monkeypatch.setenv(workers.ENV_START_METHOD, "spawn")  # read by the first loader only: fixed since
    assert make_loader(ds, num_workers=2).start_method == "fork"


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
    assert len(_keys(make_loader(ds, num_workers=1))) == 120  # by value (shardstream.portable)
    held = make_loader(ShardStream(dataset, batch_size=10, transform=HoldsLock()), num_workers=1)
    for _epoch in range(2):  # the same error in epoch 0 as later: the method does not change
        with pytest.raises(ConfigError, match="the dataset is sent to them pickled.*lock.*start_method='fork'"):
            list(held)
    assert len(_keys(make_loader(ShardStream(dataset, batch_size=10, transform=HoldsLock()), num_workers=1, start_method="fork"))) == 120


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
        loader = make_loader(ShardStream(dataset, batch_size=10, transform=Jitter()), num_workers=2, start_method=how)
        return [n for b in loader for n in b["noise"].tolist()]

    fork, got = noise("fork"), noise(method)
    assert len(got) == 120 and sorted(got) == sorted(fork)  # seeded by bind: the same numbers however workers start


# -- the watchdog ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_worker_that_stalls_mid_pass_raises_worker_timeout_naming_it_and_its_step(dataset, method):
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(ds, num_workers=2, timeout=3, first_batch_timeout=60, start_method=method, collate_fn=stall_in_worker_0_after_2_batches)
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


def test_a_worker_that_never_starts_its_pass_is_named_by_the_first_batch_bound(dataset):
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(ds, num_workers=1, first_batch_timeout=2, worker_init_fn=hang_at_start)
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

    names = []  # every named semaphore this rank makes (the queues and events of its DataLoader)
    init = synchronize.SemLock.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self._semlock.name is not None:
            names.append(self._semlock.name)

    synchronize.SemLock.__init__ = recording

    if __name__ == "__main__":
        ds = ShardStream(sys.argv[1], batch_size=10)
        it = iter(make_loader(ds, num_workers=2, start_method=sys.argv[2], prefetch_factor=1))
        next(it)
        next(it)
        print(" ".join(["ready", *names]), flush=True)
        time.sleep(600)
""")


WARM_SCRIPT = textwrap.dedent("""
    import sys, time
    from multiprocessing import forkserver
    from shardstream import ShardStream, make_loader

    if __name__ == "__main__":
        ds = ShardStream(sys.argv[1], batch_size=10)
        loader = make_loader(ds, num_workers=2, start_method="forkserver")
        deadline = time.monotonic() + 120
        while forkserver._forkserver._forkserver_pid is None and time.monotonic() < deadline:
            time.sleep(0.05)  # nothing iterates the loader meanwhile
        up = forkserver._forkserver._forkserver_pid is not None
        print(up, len([k for b in loader for k in b["__key__"]]), flush=True)
""")


def test_make_loader_starts_the_forkserver_before_the_first_pass(tmp_path, dataset):
    """Its start (a new interpreter importing torch) overlaps the script's own set-up instead of
    the first batch; the pass then uses it. In a process of its own: none is running there yet."""
    script = tmp_path / "warm.py"
    script.write_text(WARM_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), dataset], capture_output=True, text=True, timeout=scaled(240), env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "120"], (out.stdout, out.stderr)


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
        ready, *names = proc.stdout.readline().split()
        assert ready == "ready"
        workers = _worker_pids(proc.pid, method)
        assert len(workers) == 2
        if method == "forkserver":
            assert len(names) >= 6  # queues and events that forkserver workers open by name...
        assert not [n for n in names if os.path.exists(f"/dev/shm/sem.{n.lstrip('/')}")]  # ...all unlinked by now
        os.kill(proc.pid, signal.SIGKILL)  # the rank alone, as a preemption or an OOM kill does
        proc.wait()
        deadline = time.monotonic() + scaled(30)
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)  # the kernel's parent-death signal, or the workers' watch thread (1 s polls)
        assert not [w for w in workers if _alive(w)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- persistent workers that died -------------------------------------------------------------------------
def test_a_persistent_worker_killed_between_passes_is_replaced_on_the_next(dataset, capfd):
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(ds, num_workers=2, persistent_workers=True)
    expected = sorted(f"s{i:06d}" for i in range(120))
    assert _keys(loader) == expected
    it = loader.pipeline[0]._iterator
    old = [w.pid for w in it._workers]
    # DataLoader's SIGCHLD handler may report the death at once, wherever the main thread is
    with contextlib.suppress(RuntimeError):
        os.kill(old[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while it._workers[0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert _keys(loader) == expected
    assert not set(w.pid for w in loader.pipeline[0]._iterator._workers) & set(old)
    del loader, it
    assert _keys(make_loader(ShardStream(dataset, batch_size=10), num_workers=2)) == expected
    assert "can only test a child process" not in capfd.readouterr().err


def test_a_pass_whose_persistent_worker_dies_fails_and_the_next_pass_starts_new_workers(dataset, capfd):
    ds = ShardStream(dataset, batch_size=10)
    loader = make_loader(ds, num_workers=2, persistent_workers=True, prefetch_factor=1)
    with pytest.raises(WorkerDied, match=r"DataLoader worker 1 \(pid \d+\) was killed by SIGKILL"):
        for i, _ in enumerate(loader):
            if i == 1:
                os.kill(loader.pipeline[0]._iterator._workers[1].pid, signal.SIGKILL)
    assert loader.pipeline[0]._iterator is None
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
    loader = make_loader(ds, num_workers=1, first_batch_timeout=60, timeout=60)
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
    """PR_SET_PDEATHSIG fires when the thread that started a child exits, not the process: a pass
    begun in a thread that then ends goes on in the main thread with the same workers alive."""
    loader = make_loader(ShardStream(dataset, batch_size=10), num_workers=2, start_method=method, persistent_workers=False, prefetch_factor=1)
    it = iter(loader)
    first = []
    t = threading.Thread(target=lambda: first.append(next(it)))
    t.start()
    t.join()
    time.sleep(0.5)  # gives a wrongly sent parent-death signal time to land (not a wait for anything)
    rest = list(it)  # WorkerDied if the thread's end killed them
    assert sorted(k for b in first + rest for k in b["__key__"]) == sorted(f"s{i:06d}" for i in range(120))


# -- life: a worker's small collated tensors ---------------------------------------------------------
def stacked_with_sharing(samples):
    """The dataset's collate (it runs in the worker): torch's default_collate of a 1 KiB and a 96 KiB
    tensor per sample, and whether each stacked result is in shared memory."""
    import torch
    from torch.utils.data import default_collate

    batch = default_collate(samples)
    return {**batch, "shared": torch.tensor([batch["small"].is_shared(), batch["large"].is_shared()])}


def small_and_large(sample):
    import torch

    i = int(sample["__key__"][-4:])
    return {"small": torch.full((1024,), i % 251, dtype=torch.uint8), "large": torch.full((96 * 1024,), i % 13, dtype=torch.uint8), "i": i}


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_torch_default_collate_in_a_worker_makes_small_tensors_in_private_memory_with_the_same_bytes(dataset, method):
    """torch's default_collate makes a worker's stacked tensors in fresh shared memory; the pack step
    sends those of at most its inline limit (64 KiB) as bytes anyway, so a worker makes them in its
    own memory (WorkerStart: private.worker_new_shared), and larger ones stay shared. The
    batches hold the same values as with no workers."""
    ds = ShardStream(dataset, batch_size=8, shuffle=False, transform=small_and_large, collate=stacked_with_sharing)
    got = list(make_loader(ds, num_workers=2, start_method=method, pin_memory=False))
    inline = list(make_loader(ds, num_workers=0, pin_memory=False))
    assert [b["shared"].tolist() for b in got] == [[False, True]] * 15
    assert [b["shared"].tolist() for b in inline] == [[False, False]] * 15  # (no worker: torch makes no shared memory)
    by_samples = {tuple(b["i"].tolist()): b for b in inline}  # (workers split the pass: another order of the same batches)
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
