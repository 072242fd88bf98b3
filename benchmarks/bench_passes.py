"""Consecutive passes over large samples in one fresh process, pass by pass, with numpy's
transparent-huge-page advice on and off (interleaved runs, each a new process).

    OMP_NUM_THREADS=1 python benchmarks/bench_passes.py [--runs 3] [--passes 3] [--workers 0]

The data is benchmarks/bench_large.py's (4 MiB float32 ``.npy`` in /dev/shm, batch 32, ``Shuffle(64)``,
shardstream's own decoder and collate; made if missing). The first pass of a process touches every
buffer for the first time; later passes reuse that memory. numpy advises the kernel to back arrays
of 4 MiB and more with 2 MiB pages (``NUMPY_MADVISE_HUGEPAGE``, on by default on Linux): each run
prints GB/s per pass and the process's huge-page faults (``thp_fault_alloc`` in /proc/vmstat).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def thp_faults() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("thp_fault_alloc "):
                return int(line.split()[1])
    return 0


def one_run(root: str, passes: int, workers: int) -> None:
    from bench_large import consume, shardstream_loader

    for i in range(passes):
        loader = shardstream_loader(root, workers, 32, "own")
        before, t = thp_faults(), time.perf_counter()
        payload = consume(loader)
        wall = time.perf_counter() - t
        print(f"pass {i}: {payload / wall / 1e9:.2f} GB/s, {thp_faults() - before} huge-page faults", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--workdir", default="/dev/shm/ssbench-large")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one run
    args = parser.parse_args()
    root = os.path.join(args.workdir, "npy")
    if args.one:
        one_run(root, args.passes, args.workers)
        return
    if not os.path.exists(os.path.join(root, "index.json")):
        from bench_large import make_dataset

        make_dataset(root, args.samples)
    print(f"{args.passes} passes over {root}, {args.workers} workers, a new process per run")
    for run in range(args.runs):
        for advice in ("1", "0"):
            env = dict(os.environ, NUMPY_MADVISE_HUGEPAGE=advice)
            out = subprocess.run(
                [sys.executable, __file__, "--one", "--workdir", args.workdir, "--passes", str(args.passes), "--workers", str(args.workers)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            print(f"run {run}, NUMPY_MADVISE_HUGEPAGE={advice}: " + "; ".join(out.stdout.split("\n")[:-1]), flush=True)


if __name__ == "__main__":
    main()
