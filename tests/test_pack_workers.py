"""pack's worker processes (``write/procs.py``): results in task order, a worker's error raised as
itself with its first line, a dead worker one typed line naming its task, Ctrl-C and a parent's
death ending every worker, and nothing but pipes between them (no named semaphore)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import packfns
import pytest
from conftest import scaled

from shardstream.errors import SourceError, WorkerDied
from shardstream.write.procs import map_in_order


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_results_come_in_task_order_and_the_workers_end():
    out = list(map_in_order(packfns.square_slowly, range(60), workers=2, ahead=4))
    assert out == [i * i for i in range(60)]
    assert multiprocessing.active_children() == []


def test_a_workers_error_is_raised_as_itself_and_the_workers_end():
    with pytest.raises(SourceError) as info:
        list(map_in_order(packfns.fail_at_seven, range(40), workers=2, ahead=4))
    assert info.value.where == "item 7" and info.value.what.startswith("cannot be loaded")
    assert multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match=r"^Unpicklable: 1-2$"):  # its type and first line, as text
        list(map_in_order(packfns.fail_unpicklably, range(10), workers=2, ahead=4))


def test_a_killed_worker_is_one_typed_error_naming_its_task():
    started = time.monotonic()
    with pytest.raises(WorkerDied, match=r"^pack worker \d \(pid \d+\) was killed by SIGKILL while on task 5") as info:
        list(map_in_order(packfns.die_at_five, range(40), workers=2, ahead=4, describe=lambda t: f"task {t}"))
    assert info.value.exitcode == -signal.SIGKILL and "\n" not in str(info.value)
    assert time.monotonic() - started < scaled(30)
    assert multiprocessing.active_children() == []


def test_a_closed_map_stops_its_workers_at_once():
    results = map_in_order(packfns.pid_and_wait, range(10), workers=2, ahead=4)
    pid = next(results)  # (given once task 1 is done too) tasks 2 and 3 are 600 s long
    started = time.monotonic()
    results.close()
    assert time.monotonic() - started < scaled(10) and _gone(pid)
    assert multiprocessing.active_children() == []


PARENT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import packfns
    from shardstream.write.procs import Workers

    if __name__ == "__main__":
        pool = Workers(packfns.pid_and_wait, 2, context=sys.argv[2])
        results = pool.map(range(10), ahead=4)
        print(next(results), *(p.pid for p in pool.procs), flush=True)
        list(results)  # waits for good: the test kills this process
""")


@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_workers_exit_when_their_parent_is_killed(tmp_path, context):
    # (a forked worker closes its copies of the parent's pipe ends, or it would never see them end)
    (tmp_path / "parent.py").write_text(PARENT)
    here = os.path.dirname(__file__)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), here, context], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()[1:]]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
    finally:
        parent.kill()  # SIGKILL: nothing of the parent runs; its workers see the end of their pipes
        parent.wait()
    deadline = time.monotonic() + scaled(20)
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids)  # even the one busy in a 600 s task


def _workers_of(pid: int) -> list[int]:
    """The workers among ``pid``'s children: spawned ones, or forked ones (the parent's command
    line), not multiprocessing's resource tracker (which spawn starts beside them)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        own = f.read()
    out = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(ValueError, OSError), open(f"/proc/{entry}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as c:
                    line = c.read()
                if b"spawn_main" in line or line == own:
                    out.append(int(entry))
    return out


def test_a_pack_worker_killed_mid_task_is_one_line_and_a_failure(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(1500):
        (src / f"{i:05d}.bin").write_bytes(rng.bytes(20_000))
    dest = tmp_path / "dest"
    cmd = [sys.executable, "-m", "shardstream", "pack", str(src), str(dest), "--max-count", "20", "--no-progress", "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + scaled(60)
    while not list(dest.glob("shard-*.tar")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "pack finished before a worker could be killed"
    try:
        workers = _workers_of(proc.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)  # as the OOM killer does
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    _, err = proc.communicate(timeout=scaled(60))
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, err.decode()
    # (a local tree into a local folder: each worker writes whole shards, write/localshards.py)
    assert "was killed by SIGKILL while on shard shard-" in lines[0] and str(workers[0]) in lines[0], lines[0]
    assert not (dest / "index.json").exists()
    assert not [p.name for p in dest.rglob("*") if ".partial-" in p.name] if dest.exists() else True


HEAVY = ("numpy", "fsspec", "pyarrow", "torch", "shardstream.storage.fs", "shardstream.format", "shardstream.write.sources")


def test_a_local_trees_items_load_in_a_process_that_imports_nothing_heavy(tmp_path):
    # What a pack worker does with a local tree's items (write/loading.py), in a fresh interpreter:
    # the same encoded samples as in this process, with none of the storage layer, the reader or
    # numpy imported (a spawned worker's start is its imports).
    import pickle

    from shardstream.write.loading import load_encoded
    from shardstream.write.sources import list_source

    for c in ("cat", "dog"):
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(3):
            (tmp_path / "src" / c / f"{i}.jpg").write_bytes(bytes([i]) * (100 + i))
    (tmp_path / "src" / "dog" / "1.json").write_bytes(b"{}")
    items = list_source(str(tmp_path / "src"), label_from_dir=True).items
    assert {payload[0] for _, payload in items} == {"local"}
    script = textwrap.dedent(
        f"""
        import pickle, sys
        from shardstream.write.loading import load_encoded
        out = load_encoded(pickle.loads(sys.stdin.buffer.read()))
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        sys.stdout.buffer.write(pickle.dumps((out, heavy)))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(items), capture_output=True, env=env, timeout=scaled(60))
    assert done.returncode == 0, done.stderr.decode()
    out, heavy = pickle.loads(done.stdout)
    assert heavy == []
    assert out == load_encoded(items)
    assert [key for ok, key, _ in out] == ["cat/0", "cat/1", "cat/2", "dog/0", "dog/1", "dog/2"] and all(ok for ok, _, _ in out)
    assert out[4][2][1] == ["cls", "jpg", "json"]  # (members, extensions, cls)


def test_a_local_file_gone_since_the_listing_is_the_same_error_in_a_worker(tmp_path):
    from shardstream.write.loading import load_encoded
    from shardstream.write.sources import list_source, load_items

    (tmp_path / "src").mkdir()
    for i in range(2):
        (tmp_path / "src" / f"{i}.bin").write_bytes(b"x")
    items = list_source(str(tmp_path / "src")).items
    os.unlink(tmp_path / "src" / "1.bin")
    gone = str(tmp_path / "src" / "1.bin")
    assert load_encoded(items)[1] == (False, gone, f"file not found: {gone}")
    assert list(load_items(items))[1] == (False, gone, f"file not found: {gone}")


def test_the_command_line_imports_nothing_heavy_until_a_command_runs():
    # A spawned pack worker re-runs the console script (multiprocessing rebuilds __main__ from its
    # path), whose first line imports shardstream.cli.main: what it imports, every worker does.
    script = f"import sys, shardstream.cli.main; print([m for m in {HEAVY!r} if m in sys.modules])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=scaled(60))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
