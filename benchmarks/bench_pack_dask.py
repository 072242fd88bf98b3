"""Packing throughput on a Dask cluster next to the local pool, one directory tree, interleaved
repeats, medians; every output checked byte-identical to the one-process pack.

    OMP_NUM_THREADS=1 python benchmarks/bench_pack_dask.py [--samples 20000] [--repeats 3]

Contenders: ``pack(..., workers=1)`` and ``workers=2`` (the streaming writer with a local process
pool), shard tasks on a ``ProcessPoolExecutor(2)``, and shard tasks on a ``distributed.LocalCluster``
with 1 and 2 worker processes (one thread each; cluster start-up is not timed). Input and output
live in /dev/shm, so the figures are CPU and scheduling cost, not disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def make_tree(root: str, n: int) -> int:
    rng = np.random.default_rng(0)
    total = 0
    for i in range(n):
        d = os.path.join(root, f"{i // 1000:04d}")
        os.makedirs(d, exist_ok=True)
        data = rng.bytes(int(rng.integers(800, 1200)))
        with open(os.path.join(d, f"{i:08d}.bin"), "wb") as f:
            f.write(data)
        with open(os.path.join(d, f"{i:08d}.cls"), "w") as f:
            f.write(str(i % 1000))
        total += len(data) + len(str(i % 1000))
    return total


def files_of(root: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(root)):
        data = open(os.path.join(root, name), "rb").read()
        if name == "index.json":
            doc = json.loads(data)
            doc.pop("created")
            data = json.dumps(doc).encode()
        out[name] = data
    return out


def main() -> None:
    import distributed

    from shardstream.write.pack import pack

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--max-count", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src = os.path.join(tmp, "src")
        nbytes = make_tree(src, args.samples)
        clusters = {}
        t = time.perf_counter()
        for n in (1, 2):
            cluster = distributed.LocalCluster(n_workers=n, processes=True, threads_per_worker=1, dashboard_address="127.0.0.1:0", host="127.0.0.1")
            clusters[n] = (cluster, distributed.Client(cluster))
        startup = (time.perf_counter() - t) / 2
        pool = ProcessPoolExecutor(2, mp_context=get_context("spawn"))
        contenders = {
            "pack --workers 1 (streaming writer)": {"workers": 1},
            "pack --workers 2 (streaming writer, local pool)": {"workers": 2},
            "shard tasks, ProcessPoolExecutor(2)": {"executor": pool},
            "shard tasks, Dask LocalCluster, 1 worker": {"executor": clusters[1][1].get_executor(pure=False)},
            "shard tasks, Dask LocalCluster, 2 workers": {"executor": clusters[2][1].get_executor(pure=False)},
        }
        times: dict[str, list[float]] = {name: [] for name in contenders}
        reference = None
        try:
            for _ in range(args.repeats):
                for name, options in contenders.items():
                    out = os.path.join(tmp, "out")
                    shutil.rmtree(out, ignore_errors=True)
                    t = time.perf_counter()
                    pack(src, out, max_count=args.max_count, **options)
                    times[name].append(time.perf_counter() - t)
                    got = files_of(out)
                    reference = reference or got
                    assert got == reference, f"{name}: output differs from the one-process pack"
        finally:
            pool.shutdown()
            for cluster, client in clusters.values():
                client.close()
                cluster.close()
    print(f"| packing {args.samples:,} samples (~1 KB .bin + .cls), {args.max_count} per shard | seconds | samples/s | MB/s |")
    print("|---|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.2f} | {args.samples / med:,.0f} | {nbytes / med / 1e6:.1f} |")
    print(
        f"(medians of {args.repeats} interleaved runs, output byte-identical in every run; "
        f"LocalCluster start-up {startup:.1f} s, not timed; {os.cpu_count()} CPUs)"
    )


if __name__ == "__main__":
    main()
