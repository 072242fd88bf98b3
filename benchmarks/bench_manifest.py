"""What a dataset of 1 M to 1 B samples costs a rank before it reads a byte: synthetic version-2
manifests (fake counts, no shard data: planning needs none), each measured in fresh processes.

Per size: the index.json size; in a fresh rank process (torch and shardstream imported first, as
in training) the time to construct ``ShardStream(root, batch_size=256, world=World(0, 8))`` (planned for
num_workers=4) and plan every worker's ranges, its peak RSS (``resource.getrusage``) and the
RSS that import alone costs; the pickled dataset (what each DataLoader worker receives); and in a
fresh worker process the RSS that unpickling it and planning its ranges adds.

``--moto`` also measures the first batch of a 10,000-shard dataset (real tiny shards and
sidecars) on a moto server on 127.0.0.1.

    OMP_NUM_THREADS=1 python benchmarks/bench_manifest.py [--moto]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SIZES = [(1_000_000, 100), (10_000_000, 1_000), (10_000_000, 100_000), (100_000_000, 10_000), (1_000_000_000, 100_000)]
SAMPLE_BYTES = 5_000


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_synthetic(root: str, samples: int, shards: int) -> int:
    """A version-2 manifest of ``shards`` shards holding ``samples`` in all (no shard files)."""
    from shardstream.format.manifest import Manifest, ShardInfo

    base, extra = divmod(samples, shards)
    infos = []
    for i in range(shards):
        n = base + (1 if i < extra else 0)
        size = n * SAMPLE_BYTES + 1024
        infos.append(ShardInfo(f"shard-{i:06d}.tar", n, size, f"{i:064x}", index=f"shard-{i:06d}.tar.idx", span=(0, size - 1024)))
    data = Manifest(shards=infos).dumps()
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "index.json"), "wb") as f:
        f.write(data)
    return len(data)


def rank_process(root: str, blob_path: str) -> None:
    import torch  # noqa: F401  (a training process has it loaded)

    from shardstream import ShardStream, World

    base = peak_mb()
    t = time.perf_counter()
    ds = ShardStream(root, batch_size=256, world=World(0, 8), decode=False)
    plan = ds.plan(num_workers=4)
    ranges = [plan.ranges(0, w, ds.counts) for w in range(4)]
    seconds = time.perf_counter() - t
    blob = pickle.dumps(ds)
    with open(blob_path, "wb") as f:
        f.write(blob)
    print(
        json.dumps(
            {
                "import_mb": base,
                "peak_mb": peak_mb(),
                "seconds": seconds,
                "pickle_bytes": len(blob),
                "ranges": sum(len(r) for r in ranges),
                "batches": len(ds),
            }
        )
    )


def worker_process(blob_path: str) -> None:
    import torch  # noqa: F401

    import shardstream.dataset  # noqa: F401

    with open(blob_path, "rb") as f:
        blob = f.read()
    base = peak_mb()
    t = time.perf_counter()
    ds = pickle.loads(blob)
    ranges = ds.plan(num_workers=4).ranges(0, 3, ds.counts)
    print(json.dumps({"added_mb": peak_mb() - base, "seconds": time.perf_counter() - t, "ranges": len(ranges)}))


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def first_batch_on_moto(shards: int, repeats: int) -> None:
    from bench_s3 import many_shards
    from common import moto_bucket

    from shardstream import ShardStream, Store, World, make_loader

    with moto_bucket() as (_, options, client, _):
        many_shards(client, options, "many", shards, {"txt": b"x" * 100, "cls": b"1"})
        firsts, constructs = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            ds = ShardStream("s3://bench/many", batch_size=32, world=World(0, 8), decode=False, store=Store(options=options))
            constructs.append(time.perf_counter() - t)
            next(iter(make_loader(ds, num_workers=2, pin_memory=False)))
            firsts.append(time.perf_counter() - t)
        print(
            f"\nfirst batch, {shards}-shard dataset on moto (rank 0 of 8, 2 workers): {statistics.median(firsts):.2f} s median "
            f"of {repeats} (manifest read + plan {statistics.median(constructs):.2f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moto", action="store_true", help="also time the first batch of a 10,000-shard dataset on moto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()
    print("| samples | shards | index.json | construct + plan | peak RSS of a rank (import alone) | pickled dataset | a worker adds |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for samples, shards in SIZES:
            root = os.path.join(tmp, f"{samples}-{shards}")
            size = write_synthetic(root, samples, shards)
            blob = os.path.join(tmp, "blob.pkl")
            ranks = [run_child("--rank", root, blob) for _ in range(args.repeats)]
            workers = [run_child("--worker", blob) for _ in range(args.repeats)]
            r = ranks[0]
            seconds = statistics.median(x["seconds"] for x in ranks)
            peak = statistics.median(x["peak_mb"] for x in ranks)
            base = statistics.median(x["import_mb"] for x in ranks)
            added = statistics.median(x["added_mb"] for x in workers)
            print(
                f"| {samples:,} | {shards:,} | {size / 1e6:.1f} MB | {seconds:.2f} s | {peak:.0f} MB ({base:.0f} MB) | "
                f"{r['pickle_bytes'] / 1e6:.1f} MB | {added:.1f} MB |",
                flush=True,
            )
    print(f"(medians of {args.repeats} fresh processes each; batch_size=256, world_size=8, rank 0, num_workers=4)")
    if args.moto:
        first_batch_on_moto(10_000, args.repeats)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_process(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_process(sys.argv[2])
    else:
        main()
