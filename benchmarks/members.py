"""The raw stream over shards with and without member sidecars, in one process, interleaved.

    OMP_NUM_THREADS=1 python -m benchmarks.members [--workdir /dev/shm/off45-small] [--repeats 5]

Reads the data ``bench_small.py --writer shardstream,webdataset --keep`` left in ``--workdir``:
own-packed shards, webdataset-written shards sliced through their member sidecars, and the same
webdataset shards parsed (the manifest's ``member_bytes`` set to -1, as an index without
sidecars reads). ``ShardStream(..., batch_size=64, decode=False)``, no user function, samples/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import shardstream
from shardstream.format.manifest import load_manifest
from shardstream.plan.topology import World


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/dev/shm/off45-small")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    own, wds = os.path.join(args.workdir, "shardstream", "tars"), os.path.join(args.workdir, "webdataset", "tars")
    runs: dict[str, tuple[str, bool]] = {"own-packed": (own, False), "webdataset, sliced": (wds, False), "webdataset, parsed": (wds, True)}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (root, parsed) in runs.items():
            manifest = load_manifest(root)
            if parsed:
                manifest.member_bytes[:] = -1
            ds = shardstream.ShardStream(manifest, batch_size=64, shuffle=False, decode=False, world=World(0, 1), collate=lambda s: s)
            start = time.perf_counter()
            n = sum(len(batch) for batch in ds)
            rates[name].append(n / (time.perf_counter() - start))
    print(f"load average {os.getloadavg()[0]:.2f}")
    for name, values in rates.items():
        print(f"{name}: {statistics.median(values):,.0f} samples/s (runs {', '.join(f'{v:,.0f}' for v in values)})")


if __name__ == "__main__":
    main()
