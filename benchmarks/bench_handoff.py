"""The worker -> main process hand-off of large batches, with and without segment reuse, side by
side in one run: 4 MiB float32 ``.npy`` samples from tmpfs (the bench_large dataset), batches of
32 (128 MiB), 2 workers, several passes over one loader.

    OMP_NUM_THREADS=1 python benchmarks/bench_handoff.py [--repeats 5] [--passes 4] [--samples 512]

Contenders: ``make_loader(reuse_shared_memory=True|False)`` x ``persistent_workers=True|False``,
and the same loader with no workers (one process) for scale.
With reuse, a worker writes its batch into a shared segment it used before once the main process
holds no tensor on it; without, every batch gets a fresh segment (torch's own collate does the
same). The main loop touches one float per 4 KiB page of every batch (as a copy to the GPU would
touch them all), then drops it. Reported: GB/s of wall time over all passes, medians of
interleaved repeats, and the ratio of reuse to fresh. Workers new each pass inherit the segments
of the pass before (segments.py), so their later passes reuse segments too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def run(root: str, reuse: bool, persistent: bool, passes: int, workers: int = 2, start_method: str = "fork") -> float:
    from shardstream import ShardStream, World, make_loader

    ds = ShardStream(root, batch_size=32, shuffle=False, world=World(0, 1))
    loader = make_loader(
        ds,
        num_workers=workers,
        pin_memory=False,
        persistent_workers=persistent,
        reuse_shared_memory=reuse,
        log_interval=None,
        start_method=start_method if workers else "auto",
    )
    total = 0
    t = time.perf_counter()
    for _ in range(passes):
        for batch in loader:
            x = batch["npy"]
            float(x.view(-1)[::1024].sum())  # one float per page: every page is touched here
            total += x.nbytes
    return total / (time.perf_counter() - t) / 1e9


def main() -> None:
    from bench_large import make_dataset

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--workdir", default="/dev/shm/ssbench-large", help="shared with benchmarks/bench_large.py")
    args = parser.parse_args()
    root = os.path.join(args.workdir, "npy")
    if not os.path.exists(os.path.join(root, "index.json")):
        make_dataset(root, args.samples)
    contenders = {(reuse, persistent): [] for persistent in (True, False) for reuse in (True, False)}
    alone: list[float] = []  # no workers: the main process reads, decodes and batches itself
    for _ in range(args.repeats):
        for (reuse, persistent), rates in contenders.items():  # interleaved: noise hits all alike
            rates.append(run(root, reuse, persistent, args.passes))
        alone.append(run(root, True, False, args.passes, workers=0))
    print("| workers | segments | GB/s (median) | runs | reuse vs fresh |")
    print("|---|---|---|---|---|")
    for persistent in (True, False):
        fresh = statistics.median(contenders[(False, persistent)])
        for reuse in (True, False):
            rates = contenders[(reuse, persistent)]
            med = statistics.median(rates)
            print(
                f"| {'persistent' if persistent else 'new each pass'} | {'reused' if reuse else 'fresh'} | {med:.2f} | "
                f"{' '.join(f'{r:.2f}' for r in rates)} | {med / fresh:.2f}x |"
            )
    med = statistics.median(alone)
    print(f"| none (num_workers=0) | - | {med:.2f} | {' '.join(f'{r:.2f}' for r in alone)} | - |")
    print(f"({args.passes} passes over {args.samples} x 4 MiB per run, 2 workers, batch 32, medians of {args.repeats})")


if __name__ == "__main__":
    main()
