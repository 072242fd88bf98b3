"""Where the CPU goes when large samples stream from S3 with workers: CPU seconds per sample of
the main process, the DataLoader workers and the moto server, for shardstream with 0 and 2 workers
and for the reference of benchmarks/bench_s3.py (two processes streaming ``get_object``).

    OMP_NUM_THREADS=1 python benchmarks/bench_s3_cpu.py [--samples 200] [--repeats 2]

On a 2-core machine every process shares the same two cores, so a reader's rate is bounded by
2 / (its CPU per sample + the server's CPU per sample). 4 MB float32 ``.npy`` samples, undecoded,
batch 4, one read request per 16 MB shard range, as in bench_s3. Worker CPU includes each worker's
start-up (fork, first request); the row with 8 samples shows that fixed part. The last two rows
make their GETs through s3fs/aiobotocore (``StorageConfig(s3_client="s3fs")``) rather than
obstore (the default, ``storage/objects.py``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of a process that is still running (the moto server)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_and_children() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def main() -> None:
    from common import get_object_stream, moto_bucket

    from shardstream import Read, ShardStream, ShardWriter, StorageConfig, Store, World, make_loader

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with moto_bucket() as (endpoint, options, client, server):
        for prefix, n in (("many", args.samples), ("few", 8)):
            with ShardWriter(f"s3://bench/{prefix}", max_size=16_000_000, storage_options=options) as w:
                for i in range(n):
                    w.write({"__key__": f"{i:06d}", "npy": np.full((1024, 1024), i, dtype=np.float32)})

        def shardstream(prefix: str, workers: int, direct: bool = True):
            def run() -> int:
                ds = ShardStream(
                    f"s3://bench/{prefix}",
                    batch_size=4,
                    shuffle=False,
                    decode=False,
                    world=World(0, 1),
                    store=Store(options=options, read=Read(read_size=17 << 20), config=StorageConfig(s3_client="obstore" if direct else "s3fs")),
                )
                return sum(len(b["__key__"]) for b in make_loader(ds, num_workers=workers, pin_memory=False, log_interval=None))

            return run

        def reference(prefix: str):
            keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="bench", Prefix=f"{prefix}/")["Contents"] if o["Key"].endswith(".tar"))

            def run() -> int:
                with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
                    sum(pool.map(get_object_stream, [endpoint, endpoint], [keys[0::2], keys[1::2]]))
                return args.samples if prefix == "many" else 8

            return run

        rows = [
            ("boto3 get_object, 2 processes", args.samples, reference("many")),
            ("shardstream, 0 workers", args.samples, shardstream("many", 0)),
            ("shardstream, 2 workers", args.samples, shardstream("many", 2)),
            ("shardstream, 2 workers, 8 samples (start-up)", 8, shardstream("few", 2)),
            ("shardstream, 0 workers, GETs through s3fs", args.samples, shardstream("many", 0, direct=False)),
            ("shardstream, 2 workers, GETs through s3fs", args.samples, shardstream("many", 2, direct=False)),
        ]
        print("| reader | samples/s | main ms/sample | workers ms/sample | server ms/sample |")
        print("|---|---|---|---|---|")
        for _ in range(args.repeats):
            for name, n, fn in rows:
                server0, (own0, kids0) = cpu_of(server), own_and_children()
                t = time.perf_counter()
                got = fn()
                wall = time.perf_counter() - t
                server1, (own1, kids1) = cpu_of(server), own_and_children()
                assert got == n, (name, got, n)
                print(
                    f"| {name} | {n / wall:.0f} | {(own1 - own0) / n * 1e3:.1f} | {(kids1 - kids0) / n * 1e3:.1f} | "
                    f"{(server1 - server0) / n * 1e3:.1f} |",
                    flush=True,
                )
        print('("workers" for the reference is its two processes; 4 MB samples; a row per run, interleaved)')


if __name__ == "__main__":
    main()
