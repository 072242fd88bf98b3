"""What a worker start method costs, side by side in one run (shardstream/workers.py).

    OMP_NUM_THREADS=1 python benchmarks/bench_workers.py [--repeats 5] [--passes 8]

1. Time to the first batch of each pass with workers new every pass (``persistent_workers=False``,
   asked for here: make_loader's default is persistent workers now), for ``fork``, ``forkserver``
   (what ``start_method="auto"`` picks) and ``spawn``, with 1 and 2 workers, over a small dataset
   (2,000 samples of 1 KiB).
   That is the worker start per epoch. The first pass of a process is reported apart: it starts
   the forkserver's server (which imports torch and shardstream once).
2. The large-sample hand-off (benchmarks/bench_handoff.py: 4 MiB ``.npy`` samples from tmpfs, batches
   of 128 MiB, 2 workers new each pass, segments reused) under ``fork`` and ``forkserver``.

Contenders are interleaved within each repeat; medians are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

METHODS = ("fork", "forkserver", "spawn")


def first_batches(root: str, method: str, workers: int, passes: int) -> list[float]:
    """Seconds from the start of each pass to its first batch, in a fresh process."""
    code = f"""
import sys, time
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), "..")!r})
from shardstream import ShardStream, World, make_loader
if __name__ == "__main__":
    ds = ShardStream({root!r}, batch_size=64, world=World(0, 1))
    loader = make_loader(ds, num_workers={workers}, start_method={method!r}, log_interval=None, persistent_workers=False)
    out = []
    for _ in range({passes}):
        t = time.perf_counter()
        it = iter(loader)
        next(it)
        out.append(time.perf_counter() - t)
        for _ in it:
            pass
    print(" ".join(f"{{x:.4f}}" for x in out))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [float(x) for x in done.stdout.split()]


def make_small(root: str, n: int = 2000) -> None:
    from shardstream import ShardWriter

    with ShardWriter(root, max_count=250, overwrite=True) as w:
        for i in range(n):
            w.write({"__key__": f"{i:06d}", "bin": os.urandom(1024), "cls": i % 10})


def main() -> None:
    from bench_handoff import run as handoff
    from bench_large import make_dataset

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--passes", type=int, default=8)
    parser.add_argument("--samples", type=int, default=256, help="4 MiB samples of the hand-off part")
    parser.add_argument("--workdir", default="/dev/shm/ssbench-workers")
    args = parser.parse_args()
    small = os.path.join(args.workdir, "small")
    if not os.path.exists(os.path.join(small, "index.json")):
        make_small(small)
    starts: dict[tuple[str, int], list[float]] = {(m, w): [] for w in (1, 2) for m in METHODS}
    firsts: dict[tuple[str, int], list[float]] = {k: [] for k in starts}
    for _ in range(args.repeats):
        for (method, workers), later in starts.items():
            times = first_batches(small, method, workers, args.passes)
            firsts[(method, workers)].append(times[0])
            later.extend(times[1:])
    print("| workers | start method | first batch, first pass (s) | first batch, later passes (s, median) | vs fork |")
    print("|---|---|---|---|---|")
    for (method, workers), later in starts.items():
        fork = statistics.median(starts[("fork", workers)])
        med = statistics.median(later)
        print(f"| {workers} | {method} | {statistics.median(firsts[(method, workers)]):.3f} | {med:.3f} | {med / fork:.1f}x |")
    print(f"({args.passes} passes per process, {args.repeats} processes per row; 2,000 samples of 1 KiB, batch 64)")

    large = os.path.join("/dev/shm/ssbench-large", "npy")
    if not os.path.exists(os.path.join(large, "index.json")):
        make_dataset(large, args.samples)
    rates: dict[str, list[float]] = {"fork": [], "forkserver": []}
    for _ in range(args.repeats):
        for method, got in rates.items():
            got.append(handoff(large, True, False, 4, start_method=method))
    print()
    print("| start method | GB/s (median) | runs | vs fork |")
    print("|---|---|---|---|")
    fork = statistics.median(rates["fork"])
    for method, got in rates.items():
        print(f"| {method} | {statistics.median(got):.2f} | {' '.join(f'{r:.2f}' for r in got)} | {statistics.median(got) / fork:.2f}x |")
    print("(4 passes over the 4 MiB .npy set per run, 2 workers new each pass, segments reused, batch 32)")


if __name__ == "__main__":
    main()
