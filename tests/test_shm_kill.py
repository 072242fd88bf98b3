"""A kill -9 of a whole job leaves nothing in /dev/shm, wherever it lands: each job runs in a
private /dev/shm (a mount namespace with a tmpfs of its own: ``unshare -m``, as root), signals
the point it reached through its stdout, and every process of the job (its descendants found in
/proc, whatever their session: a forkserver, a resource tracker, the workers) is killed at once,
as a cgroup, SLURM or a container runtime kills a job. A training loader's worker processes make
no named object at all (their segments are anonymous memory: loader/handoff.py), and
``shardstream pack --workers 2``'s workers talk over pipes only (``write/procs.py``), so nothing
can be left, with no one left to clean up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import scaled, write_dataset

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs Linux, root and unshare for a private /dev/shm",
)

JOB = textwrap.dedent("""
    import sys, time
    from shardstream import ShardStream, make_loader

    def stop_in_worker(worker_id):
        print("point", flush=True)  # the workers are starting
        time.sleep(600)

    if __name__ == "__main__":
        root, point = sys.argv[1], sys.argv[2]
        init = stop_in_worker if point == "start" else None
        loader = make_loader(ShardStream(root, batch_size=10), num_workers=2, workers="processes", start_method=sys.argv[3],
                             worker_init_fn=init, prefetch_factor=1)
        for i, batch in enumerate(loader):
            if i == 1 and point == "mid":
                print("point", flush=True)
                time.sleep(600)
""")

# Runs inside the namespace: mounts the private /dev/shm, starts the job, and at the point stops
# then kills every process of the job at once (none lives to clean up after another).
HARNESS = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time

    def descendants(root):
        children = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = open(f"/proc/{entry}/stat", "rb").read()
                except OSError:
                    continue
                children.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(entry))
        found, todo = [], [root]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo.extend(children.get(pid, []))
        return found

    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/dev/shm"], check=True)
    job = subprocess.Popen([sys.executable, *sys.argv[2:]], stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = job.stdout.readline()
    time.sleep(0.2)  # (the workers' start under way)
    everyone = descendants(job.pid)
    for pid in everyone:
        os.kill(pid, signal.SIGSTOP)  # frozen first: no process reacts to another's death
    for pid in everyone:
        os.kill(pid, signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + float(sys.argv[1])
    while any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(") ")[1][0] != "Z" for p in everyone):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)  # until the kernel has taken them all
    print(json.dumps({"line": line.strip(), "processes": len(everyone), "after": sorted(os.listdir("/dev/shm"))}))
""")


@pytest.mark.parametrize(("point", "method"), [("start", "forkserver"), ("mid", "forkserver"), ("mid", "spawn")])
def test_a_killed_job_leaves_nothing_in_dev_shm(tmp_path, point, method):
    root = write_dataset(tmp_path / "ds", n=60, max_count=10)
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "harness.py").write_text(HARNESS)
    out = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            sys.executable,
            str(tmp_path / "harness.py"),
            str(scaled(60)),
            str(tmp_path / "job.py"),
            root,
            point,
            method,
        ],
        capture_output=True,
        text=True,
        timeout=scaled(240),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # (each of the 2 workers says it reached the point; beside CPU hogs their words can share a line)
    assert result["line"] and result["line"].replace("point", "") == "", out.stderr
    assert result["processes"] >= 3  # the rank and its two workers (and a forkserver): all killed at once
    assert result["after"] == []


# Runs inside the namespace: mounts the private /dev/shm, starts `shardstream pack --workers 2` in its
# own session over a source of many files, and waits for the point: its first shard is written (the
# workers are up, the pack is mid-way). Then every process of the job is killed at once, as a cgroup,
# SLURM or a container runtime kills a job: all of its descendants (multiprocessing's resource
# tracker too, wherever it would run) are found in /proc, stopped (SIGSTOP: none can react to the
# others' deaths), then killed. Nothing is left to clean up after them: /dev/shm must be empty.
PACK_HARNESS = textwrap.dedent("""
    import glob, json, os, signal, subprocess, sys, time
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/dev/shm"], check=True)
    bound, out = float(sys.argv[1]), sys.argv[2]
    job = subprocess.Popen([sys.executable, "-m", "shardstream", *sys.argv[3:]], start_new_session=True)
    deadline, reached = time.monotonic() + bound, False
    while not reached and job.poll() is None and time.monotonic() < deadline:
        reached = bool(glob.glob(os.path.join(out, "shard-*.tar")))  # written from the workers' loads
        time.sleep(0.01)

    def parents():
        found = {}
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    found[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (ValueError, OSError):
                pass
        return found

    def job_processes():
        ppid, tree = parents(), {job.pid}
        grew = True
        while grew:
            more = {pid for pid, parent in ppid.items() if parent in tree} - tree
            tree |= more
            grew = bool(more)
        return tree

    before = sorted(os.listdir("/dev/shm"))
    procs = job_processes()
    for pid in procs:  # frozen first: no process of the job outlives another to clean up after it
        os.kill(pid, signal.SIGSTOP)
    procs |= job_processes()  # (one started in the meantime is frozen too)
    for pid in procs:
        os.kill(pid, signal.SIGSTOP)
    for pid in procs:
        os.kill(pid, signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + bound
    while any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
              for pid in procs if pid != job.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel takes the killed processes down (their parent reaps them)
    print(json.dumps({"reached": reached, "processes": len(procs), "before": before, "after": sorted(os.listdir("/dev/shm"))}))
""")


def test_a_killed_pack_with_workers_leaves_nothing_in_dev_shm(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(1500):  # ~75 shards of 10: the kill comes at the first, mid-way
        (src / f"s{i:04d}.bin").write_bytes(rng.bytes(20_000))
    (tmp_path / "harness.py").write_text(PACK_HARNESS)
    pack = ["pack", str(src), str(tmp_path / "out"), "--workers", "2", "--max-count", "10", "--no-progress"]
    out = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, str(tmp_path / "harness.py"), str(scaled(60)), str(tmp_path / "out"), *pack],
        capture_output=True,
        text=True,
        timeout=scaled(240),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["reached"], out.stderr
    assert result["processes"] >= 3  # the pack and its two workers, killed together
    assert result["after"] == [], result  # on main: the pool's sem.mp-* (their unlinker, the resource tracker, died too)
