"""A fresh small-sample pass with DataLoader workers, on a timeline: the main process against its
workers (and the forkserver's server), wall and CPU, for source trees and start methods side by side.

    OMP_NUM_THREADS=1 python benchmarks/trace_small_workers.py --data /dev/shm/twoworkers/shardstream/tars \\
        [--trees new=.,base=/tmp/base] [--methods forkserver,fork] [--workers 2] [--rounds 3]

The pass is ``bench_small.py``'s (1 KiB + JSON label, the user's ``fn`` + ``default_collate``, batch
64, no shuffle), over shards ``bench_small.py --keep`` left (``--data``: its ``tars`` folder). Each
round runs, for every (tree, method) in turn, a fresh process in that tree that writes timestamps
(wall clock, shared by all processes) and its CPU seconds: the process's start (from /proc), imports
done, ``ShardStream`` built, ``make_loader`` returned, the forkserver's server up (and its CPU by
then), each worker's ``worker_init_fn`` and its first sample and first 64 (the user's ``fn`` in the
worker), the main process's first batch, and each batch after. The report gives medians over the
rounds, in seconds after the process started: when each stage was reached, the main process's CPU
by then, the steady rate (batches 25%..75% of the pass) and the main process's CPU per batch there,
the workers' CPU over the pass (from /proc before they stop), the end, and the CPU per sample after
``make_loader`` (the main process's and the workers', not the server's). ``--methods`` takes
``fork``, ``forkserver`` or ``spawn``, each maybe with ``:PREFETCH_FACTOR`` (``fork:8``), and
``none`` (no workers: the same pass in one process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TRACE = os.environ.get("TRACE_SMALL")
BATCH = 64


def _cpu() -> float:
    return time.process_time()


def _mark(name: str, **extra: float) -> None:
    if TRACE is None:
        return
    line = json.dumps({"pid": os.getpid(), "name": name, "t": time.time(), "cpu": _cpu(), **extra})
    fd = os.open(TRACE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


_calls = 0


def fn(sample):
    """bench_small's user function, marking the worker's first sample and first batch's worth."""
    global _calls
    import torch

    _calls += 1
    if _calls == 1:
        _mark("worker first sample")
    out = {"x": torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8), "y": json.loads(bytes(sample["json"]))["label"]}
    if _calls == BATCH:
        _mark("worker first batch's samples")
    return out


def worker_init(worker_id: int) -> None:
    _mark("worker init", worker=worker_id)


def _proc_cpu(pid: int) -> float:
    """utime + stime of ``pid`` (and of its children it waited for), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick


def _process_start() -> float:
    """This process's start, wall clock (from /proc: clock ticks after boot)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def one_pass(data: str, method: str, workers: int) -> None:
    method, _, prefetch = method.partition(":")  # "forkserver:4": prefetch_factor 4
    _mark("process start", t=_process_start(), cpu=0.0)
    from torch.utils.data import default_collate

    import shardstream.loader  # noqa: F401
    from shardstream import ShardStream, World, make_loader
    from shardstream.private import resolve

    _mark("imports done")
    ds = ShardStream(data, batch_size=BATCH, shuffle=False, decode=False, transform=fn, collate=default_collate, world=World(0, 1))
    _mark("ShardStream built")
    extra = {"prefetch_factor": int(prefetch)} if prefetch else {}
    if method == "none":  # the same pass with no workers, for the CPU per sample
        workers, method = 0, "auto"
    loader = make_loader(ds, num_workers=workers, pin_memory=False, log_interval=None, start_method=method, worker_init_fn=worker_init, **extra)
    _mark("make_loader returned")
    server = resolve("multiprocessing.forkserver._forkserver") if method == "forkserver" else None
    times, cpus = [], []
    got = 0
    for batch in loader:
        times.append(time.time())
        cpus.append(_cpu())
        if len(times) == 1:
            _mark("main first batch")
            if server is not None and server._forkserver_pid is not None:
                _mark("forkserver pid known", server_cpu=_proc_cpu(server._forkserver_pid))
        got += len(batch["y"])
    _mark("main pass end", samples=got)
    from shardstream.private import iterator_workers, loader_iterator

    it = loader_iterator(loader.pipeline[0])
    for w, proc in enumerate(iterator_workers(it) or []):
        _mark("worker cpu at end", worker=w, worker_cpu=_proc_cpu(proc.pid))
    n = len(times)
    lo, hi = n // 4, 3 * n // 4
    _mark("worker cpu at end", worker=-1, worker_cpu=0.0)  # (none: no workers)
    _mark("steady", rate=(hi - lo) * BATCH / (times[hi] - times[lo]), batches=n, main_us_per_batch=(cpus[hi] - cpus[lo]) / (hi - lo) * 1e6)


def report(rows: dict[str, list[list[dict]]]) -> None:
    stages = [
        "imports done",
        "ShardStream built",
        "make_loader returned",
        "worker init",
        "worker first sample",
        "worker first batch's samples",
        "main first batch",
        "main pass end",
    ]
    for key, runs in rows.items():
        print(f"\n## {key} (medians of {len(runs)}; s after the process started; main CPU s by then)")
        print("| stage | worker 0 | worker 1 | main |")
        print("|---|---|---|---|")
        for stage in stages:
            cells = []
            for who in ("w0", "w1", "main"):
                ts, cs = [], []
                for run in runs:
                    start = next(e["t"] for e in run if e["name"] == "process start")
                    main_pid = next(e["pid"] for e in run if e["name"] == "process start")
                    for e in run:
                        if e["name"] != stage:
                            continue
                        if who == "main" and e["pid"] == main_pid:
                            ts.append(e["t"] - start)
                            cs.append(e["cpu"])
                        elif who != "main" and e["pid"] != main_pid and e.get("worker", _worker_of(run, e["pid"])) == int(who[1]):
                            ts.append(e["t"] - start)
                            cs.append(e["cpu"])
                cells.append(f"{statistics.median(ts):.3f} (cpu {statistics.median(cs):.2f})" if ts else "")
            print(f"| {stage} | " + " | ".join(cells) + " |")
        rate = statistics.median(next(e["rate"] for e in run if e["name"] == "steady") for run in runs)
        per_batch = statistics.median(next(e["main_us_per_batch"] for e in run if e["name"] == "steady") for run in runs)
        server = [e["server_cpu"] for run in runs for e in run if e["name"] == "forkserver pid known"]
        wcpu = [sum(e["worker_cpu"] for e in run if e["name"] == "worker cpu at end") for run in runs]
        per_sample = [
            (w + next(e["cpu"] for e in run if e["name"] == "main pass end") - next(e["cpu"] for e in run if e["name"] == "make_loader returned"))
            / next(e["samples"] for e in run if e["name"] == "main pass end")
            * 1e6
            for w, run in zip(wcpu, runs)
        ]
        total = [_at(run, "main pass end") - _at(run, "process start") for run in runs]
        maincpu = [next(e["cpu"] for e in run if e["name"] == "main pass end") for run in runs]
        print(
            f"steady rate (batches 25-75%): {rate:,.0f} samples/s, main CPU {per_batch:.0f} us/batch; "
            f"whole process {statistics.median(total):.2f} s; "
            f"main CPU {statistics.median(maincpu):.2f} s; workers' CPU (both) {statistics.median(wcpu):.2f} s"
            + (f"; forkserver server CPU {statistics.median(server):.2f} s" if server else "")
            + f"; CPU per sample after make_loader (main + workers) {statistics.median(per_sample):.1f} us "
            + f"({', '.join(f'{x:.1f}' for x in sorted(per_sample))})"
        )


def _at(run: list[dict], name: str) -> float:
    return next(e["t"] for e in run if e["name"] == name)


def _worker_of(run: list[dict], pid: int) -> int:
    for e in run:
        if e["pid"] == pid and e["name"] == "worker init":
            return int(e["worker"])
    return -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--trees", default="new=.")
    parser.add_argument("--methods", default="forkserver,fork", help="start methods, each maybe with :PREFETCH_FACTOR (fork:4); none: no workers")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: one pass with this method
    args = parser.parse_args()
    if args.run:
        one_pass(args.data, args.run, args.workers)
        return
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    rows: dict[str, list[list[dict]]] = {}
    trace = f"/dev/shm/trace-small-{os.getpid()}"
    for _ in range(args.rounds):
        for name, tree in trees.items():
            tree = os.path.abspath(tree)
            for method in args.methods.split(","):
                if os.path.exists(trace):
                    os.unlink(trace)
                env = {**os.environ, "TRACE_SMALL": trace, "PYTHONPATH": tree, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
                script = os.path.abspath(__file__)
                cmd = [sys.executable, script, "--run", method, "--data", os.path.abspath(args.data), "--workers", str(args.workers)]
                subprocess.run(cmd, env=env, cwd=tree, check=True)
                with open(trace) as f:
                    rows.setdefault(f"{name} {method}", []).append([json.loads(line) for line in f])
    os.unlink(trace)
    print(f"load average {os.getloadavg()}")
    report(rows)


if __name__ == "__main__":
    main()
