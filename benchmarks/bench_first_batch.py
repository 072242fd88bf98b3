"""The time to the first batch from S3 in a process of its own, for each start method and for
trees side by side: what a training script waits for at its first pass.

    OMP_NUM_THREADS=1 python benchmarks/bench_first_batch.py [--trees base=/tmp/base,new=.] \
        [--methods forkserver,fork] [--workers 2] [--rounds 6] [--loaders 3] [--latency 0.03]

The server (``benchmarks/s3server.py``, s3rver by default) holds the dataset of
``bench_s3_latency.py`` (8 shards of 8 x 4 MiB ``.npy`` samples, read undecoded, batch 4), behind
``latency_proxy.py`` (``--latency`` seconds before each request). Each round runs, for every tree
and start method in turn (interleaved), a fresh Python process with that tree first on
``PYTHONPATH`` which makes ``--loaders`` streams and loaders one after the other, each a fresh
``ShardStream`` (its manifest read) and ``make_loader(..., start_method=METHOD)`` up to its first
batch. It reports two medians over the rounds: the process's first loader (everything cold:
imports, clients, a forkserver's start), and its last (what ``bench_s3_latency.py --first-batch``
measures after its warm-up), each as wall seconds and as CPU seconds (the process and its live
processes it started, from /proc: on a loaded machine the steadier of the two). The writer runs in this process,
so the readers' processes start with no S3 client of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # the repository first on sys.path
from common import load_average
from latency_proxy import start_proxy  # type: ignore[import-not-found]
from s3server import KINDS, s3_server  # type: ignore[import-not-found]


def descendants_cpu() -> dict[str, float]:
    """CPU seconds of each live process descended from this one (workers, a forkserver and its
    workers), by pid, from /proc."""
    tick, parent, cpu = os.sysconf("SC_CLK_TCK"), {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[pid], cpu[pid] = fields[1], (int(fields[11]) + int(fields[12])) / tick
    mine, found = {str(os.getpid())}, True
    while found:
        found = False
        for pid, ppid in parent.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                found = True
    mine.discard(str(os.getpid()))
    return {pid: cpu[pid] for pid in mine}


def _tree_of(module) -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))


def check_tree(worker_id: int) -> None:
    """The loaders' worker_init_fn: a worker runs the tree measured, as the main process does."""
    import shardstream

    if _tree_of(shardstream) != os.path.abspath(os.environ["FIRST_BATCH_TREE"]):
        raise RuntimeError(f"worker {worker_id} imported shardstream from {_tree_of(shardstream)}, not the tree measured")


def one_process(method: str, workers: int, endpoint: str, loaders: int) -> None:
    """``--one``: the loaders of one process; prints one JSON line, [wall, CPU] per loader."""
    sys.path.insert(0, os.environ["FIRST_BATCH_TREE"])  # the tree measured, before this checkout (common put it first)
    import shardstream
    from shardstream import ShardStream, Store, World, make_loader

    assert _tree_of(shardstream) == os.path.abspath(os.environ["FIRST_BATCH_TREE"])

    out = []
    for _ in range(loaders):
        t, c, before = time.perf_counter(), time.process_time(), set(descendants_cpu())
        stream = ShardStream(
            "s3://bench/first", batch_size=4, shuffle=False, decode=False, world=World(0, 1), store=Store(options={"endpoint_url": endpoint})
        )
        loader = make_loader(stream, num_workers=workers, pin_memory=False, log_interval=None, start_method=method, worker_init_fn=check_tree)
        it = iter(loader)
        next(it)
        wall, own = time.perf_counter() - t, time.process_time() - c
        out.append([wall, own + sum(v for pid, v in descendants_cpu().items() if pid not in before)])  # (the processes it started)
        del it, loader, stream  # its workers stop before the next loader starts
    print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default=f"this={common.REPO}", help="NAME=PATH,...: source trees (each holding shardstream/)")
    parser.add_argument("--methods", default="forkserver,fork")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--loaders", type=int, default=3, help="loaders per process, one after the other")
    parser.add_argument("--latency", type=float, default=0.03, help="seconds added before each request; 0: no proxy")
    parser.add_argument("--server", choices=KINDS, default="s3rver")
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "WORKERS", "ENDPOINT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_process(args.one[0], int(args.one[1]), args.one[2], args.loaders)
        return
    import numpy as np

    from shardstream import ShardWriter

    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    with s3_server(args.server) as server, contextlib.ExitStack() as stack:
        with ShardWriter("s3://bench/first", max_count=8, max_size=1 << 40, storage_options=server.storage_options) as w:
            for i in range(64):
                w.write({"__key__": f"{i:06d}", "npy": np.full((1024, 1024), i, dtype=np.float32)})
        endpoint = stack.enter_context(start_proxy(server.endpoint, args.latency))[0] if args.latency > 0 else server.endpoint
        loads = [load_average()]
        runs: dict[tuple[str, str], list[list[list[float]]]] = {}
        for _ in range(args.rounds):
            for name, path in trees.items():
                for method in args.methods.split(","):
                    tree = os.path.abspath(path)
                    # Run in the tree, with the tree's own copy of this script where it has one: a
                    # forkserver's workers imported shardstream from the driver's working directory
                    # (or the checkout of the script the server preloads), not from the tree measured.
                    script = os.path.join(tree, "benchmarks", os.path.basename(__file__))
                    script = script if os.path.exists(script) else os.path.abspath(__file__)
                    here = os.path.dirname(script)
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, here]), FIRST_BATCH_TREE=tree, OMP_NUM_THREADS="1")
                    command = [sys.executable, script, "--one", method, str(args.workers), endpoint]
                    command += ["--loaders", str(args.loaders)]
                    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, timeout=600)
                    if done.returncode != 0:
                        print(f"# {name} {method}: failed\n{done.stderr[-2000:]}", flush=True)
                        continue
                    runs.setdefault((name, method), []).append(json.loads(done.stdout.strip().splitlines()[-1]))
            loads.append(load_average())
    print(f"\n{server.version()}, {args.latency * 1e3:.0f} ms per request, {args.workers} workers, medians of {args.rounds} processes")
    print(f"(1-minute load {min(loads):.1f}-{max(loads):.1f})")
    print("| tree | start method | first loader: wall s | CPU s | last loader: wall s | CPU s |")
    print("|---|---|---|---|---|---|")
    for (name, method), got in runs.items():
        first = [r[0] for r in got]
        last = [r[-1] for r in got]
        cells = [statistics.median(x[k] for x in part) for part in (first, last) for k in (0, 1)]
        print(f"| {name} | {method} | " + " | ".join(f"{v:.3f}" for v in cells) + " |")
    for (name, method), got in runs.items():
        print(f"# {name} {method}, last loader wall s by round: " + " ".join(f"{r[-1][0]:.3f}" for r in got))


if __name__ == "__main__":
    main()
