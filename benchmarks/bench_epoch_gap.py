"""The gap between one epoch's last batch and the next epoch's first, with new workers each pass
against persistent ones, however the workers start.

    OMP_NUM_THREADS=1 python benchmarks/bench_epoch_gap.py [--method forkserver] [--workers 2] [--epochs 6]

A small local dataset (120 samples of 32 KiB, 6 shards, batch 10) is made in a temporary folder;
the loop does nothing with a batch. For each setting it prints the gap of every epoch after the
first, then min/median/max. The first epoch's first batch is left out: it pays for the forkserver's
own start (which make_loader overlaps with the script's set-up) and the first imports.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def make_data(folder: str) -> str:
    import numpy as np

    from shardstream import ShardWriter

    rng = np.random.default_rng(0)
    with ShardWriter(folder, max_count=20) as w:
        for i in range(120):
            w.write({"__key__": f"s{i:06d}", "bin": rng.bytes(32 << 10), "cls": i % 7})
    return folder


def gaps(root: str, method: str, workers: int, epochs: int, persistent: bool) -> list[float]:
    from shardstream import ShardStream, make_loader

    loader = make_loader(ShardStream(root, batch_size=10), num_workers=workers, start_method=method, persistent_workers=persistent, log_interval=None)
    out, last = [], None
    for epoch in range(epochs):
        first = True
        for _ in loader:
            if first and last is not None:
                out.append(time.perf_counter() - last)
            first = False
        last = time.perf_counter()
        del epoch
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="forkserver", choices=["fork", "forkserver", "spawn"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = make_data(os.path.join(tmp, "ds"))
        for persistent in (False, True):
            g = gaps(root, args.method, args.workers, args.epochs, persistent)
            print(
                f"{args.method}, {args.workers} workers, persistent_workers={persistent}: epoch gap "
                f"min {min(g):.3f} s, median {statistics.median(g):.3f} s, max {max(g):.3f} s  ({', '.join(f'{x:.3f}' for x in g)})",
                flush=True,
            )


if __name__ == "__main__":
    main()
