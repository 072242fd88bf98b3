"""What a training loop sees when DataLoader workers go wrong under make_loader: a worker killed
by a signal or exiting on its own is a WorkerDied naming it; options that would break exact
resume are refused."""

from __future__ import annotations

import pytest
from conftest import write_dataset

from shardstream import ConfigError, ShardStream, World, make_loader


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("workers") / "ds", n=80, max_count=10)


def test_in_order_false_is_refused_and_true_accepted(root):
    ds = ShardStream(root, batch_size=4, world=World(0, 1), shuffle=False)
    with pytest.raises(ConfigError, match="in_order=True: resume counts the batches"):
        make_loader(ds, num_workers=2, in_order=False)
    loader = make_loader(ds, num_workers=0, in_order=True, log_interval=None)
    assert sum(len(b["__key__"]) for b in loader) == 80


def kill_worker_1(samples):
    """A transform: worker 1 sends itself the signal named in SHARDSTREAM_TEST_SIGNAL."""
    import os
    import signal

    from shardstream import get_worker_info

    info = get_worker_info()
    if info is not None and info.id == 1:
        os.kill(os.getpid(), getattr(signal, os.environ["SHARDSTREAM_TEST_SIGNAL"]))
    return samples


@pytest.mark.parametrize(("method", "sig"), [("fork", "SIGKILL"), ("fork", "SIGSEGV"), ("forkserver", "SIGKILL")])
def test_a_worker_killed_by_a_signal_is_worker_died_naming_it(root, monkeypatch, method, sig):
    import signal

    from shardstream import ShardstreamError, WorkerDied

    monkeypatch.setenv("SHARDSTREAM_TEST_SIGNAL", sig)  # forked and forkserver workers see the rank's environment
    ds = ShardStream(root, batch_size=4, world=World(0, 1), shuffle=False, transform=kill_worker_1)
    loader = make_loader(ds, num_workers=2, workers="processes", start_method=method, log_interval=None)
    with pytest.raises(WorkerDied) as info:
        for _ in loader:
            pass
    exc = info.value
    assert isinstance(exc, ShardstreamError) and isinstance(exc, RuntimeError)  # DataLoader's error was one
    assert exc.worker == 1 and exc.exitcode == -getattr(signal, sig) and exc.pid
    message = str(exc)
    assert message.startswith(f"rank 0: DataLoader worker 1 (pid {exc.pid}) was killed by {sig} after 0 batches this pass")
    assert "its last step" in message and "reading samples" in message  # the watchdog's board: what it was doing
    assert ("OOM killer" if sig == "SIGKILL" else "crash in native code") in message
    assert type(type(exc)(message)) is WorkerDied  # rebuilt from its message, as every class is


UNGUARDED = """
import sys

from shardstream import ShardStream, make_loader

print("ran as", __name__, flush=True)
ds = ShardStream(sys.argv[1], batch_size=4)
loader = make_loader(ds, num_workers=2, workers="processes", start_method=sys.argv[2], log_interval=None)
for batch in loader:
    pass
print("done", flush=True)
"""

GUARDED = """
import sys

from shardstream import ShardStream, make_loader


def main():
    ds = ShardStream(sys.argv[1], batch_size=4)
    loader = make_loader(ds, num_workers=2, workers="processes", start_method=sys.argv[2], log_interval=None)
    print("batches", sum(1 for _ in loader), flush=True)


print("ran as", __name__, flush=True)
if "__main__" == __name__ and len(sys.argv) > 1:
    main()
"""


def _run_script(tmp_path, name: str, text: str, root: str, method: str):
    import os
    import subprocess
    import sys

    from conftest import scaled

    script = tmp_path / name
    script.write_text(text)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), os.getcwd()) if p)}
    return subprocess.run([sys.executable, str(script), root, method], capture_output=True, text=True, timeout=scaled(120), env=env)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_an_unguarded_script_is_told_to_add_the_main_guard(root, tmp_path, method):
    done = _run_script(tmp_path, "train.py", UNGUARDED, root, method)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout.splitlines() == ["ran as __main__"]  # no worker ran the script again
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("shardstream.errors.ConfigError: ") and "train.py, line 9: " in last, done.stderr
    assert (f"add `if __name__ == '__main__':` around your training code (workers start from {method} here, see docs/training.md)") in last
    assert "exited unexpectedly" not in done.stderr and "bootstrapping phase" not in done.stderr


def test_a_guarded_script_runs_its_workers_from_forkserver(root, tmp_path):
    done = _run_script(tmp_path, "train.py", GUARDED, root, "forkserver")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "ran as __main__" and done.stdout.splitlines()[-1] == "batches 20"


def test_a_loader_dropped_mid_pass_goes_with_its_last_reference(root):
    """Starting workers from forkserver looks up the caller's frames (the main-guard check) and
    lets them go: no reference cycle holds the loader, so dropped mid-pass it goes at once, its
    workers stopped with it, not at the garbage collector's next pass."""
    import gc
    import weakref

    ds = ShardStream(root, batch_size=4, world=World(0, 1), shuffle=False)
    gc.collect()
    gc.disable()  # the collector's own passes (any allocation may start one) would hide a cycle
    try:
        loader = make_loader(ds, num_workers=2, workers="processes", start_method="forkserver", log_interval=None, pin_memory=False)
        for n, _ in enumerate(loader):
            if n == 3:
                break
        gone = weakref.ref(loader)
        del loader
        assert gone() is None
    finally:
        gc.enable()


def raise_in_worker_1(worker_id):
    """A worker_init_fn: worker 1 raises a RuntimeError of its own (as a library it sets up may)."""
    if worker_id == 1:
        raise RuntimeError("worker 1's own error: 2 of 3 devices missing")


def test_a_workers_own_runtime_error_stays_itself_not_worker_died(root):
    """A worker's own RuntimeError, its worker alive, reaches the loop as itself, with the worker
    named in a note; a dead worker is a WorkerDied."""
    from shardstream import WorkerDied

    ds = ShardStream(root, batch_size=4, world=World(0, 1), shuffle=False)
    for workers in ("processes", "threads"):
        loader = make_loader(ds, num_workers=2, workers=workers, start_method="fork", worker_init_fn=raise_in_worker_1, log_interval=None)
        with pytest.raises(RuntimeError, match="worker 1's own error") as info:
            for _ in loader:
                pass
        assert type(info.value) is RuntimeError and not isinstance(info.value, WorkerDied)
        assert "worker 1" in info.value.__notes__[0]
