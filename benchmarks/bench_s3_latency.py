"""S3 with real latency: shardstream against plain ``get_object`` streams of the same objects, through
a proxy that adds a first-byte latency to every request (``benchmarks/latency_proxy.py``, its own
process, 127.0.0.1), in front of a moto server (its own process, 127.0.0.1); plus the time to the
first batch and the GET requests each reader makes.

    OMP_NUM_THREADS=1 python benchmarks/bench_s3_latency.py [--latency 0.03] [--shards 8] [--repeats 5]

The data: ``--shards`` shards of ``--per-shard`` 4 MiB float32 ``.npy`` samples (32 MiB shards by
default), read undecoded, in manifest order, batch 4. The contenders, interleaved, medians:

- boto3, 1 stream: one client (made before the clock starts) reads every object in turn with
  ``get_object``, its body in 1 MiB pieces;
- boto3, 2 streams: two forked processes (forked per pass, a client each), half the objects each;
- shardstream with 0 and 2 workers (``make_loader``, workers forked per pass), one ``ShardStream``
  made before the clock starts; GETs through obstore (the default) and s3fs's path
  (``StorageConfig(s3_client="s3fs")``).

Ratios are to one stream for 0 workers and to two streams for 2 workers. The time to the first
batch is a fresh ``ShardStream`` (its manifest read) and loader up to the first batch, in this
process, after a warm-up (the botocore session is loaded, as after a first dataset).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import get_object_stream


def main() -> None:
    from common import moto_bucket
    from latency_proxy import proxy_counts, start_proxy  # type: ignore[import-not-found]

    from shardstream import ShardStream, ShardWriter, StorageConfig, Store, World, make_loader

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", type=float, default=0.03, help="seconds added before each request")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--per-shard", type=int, default=8, help="4 MiB samples per shard")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--first-batch", type=int, default=5, help="times to the first batch, per worker count")
    parser.add_argument("--no-s3fs", action="store_true", help="leave out the s3fs-path rows")
    args = parser.parse_args()
    n = args.shards * args.per_shard
    with moto_bucket() as (endpoint, moto_options, client, _):
        with ShardWriter("s3://bench/lat", max_count=args.per_shard, max_size=1 << 40, storage_options=moto_options) as w:
            for i in range(n):
                w.write({"__key__": f"{i:06d}", "npy": np.full((1024, 1024), i, dtype=np.float32)})
        keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="bench", Prefix="lat/")["Contents"] if o["Key"].endswith(".tar"))
        total = sum(client.head_object(Bucket="bench", Key=k)["ContentLength"] for k in keys)
        with start_proxy(endpoint, args.latency) as (url, _):
            import boto3

            options = {"endpoint_url": url}
            one = boto3.client("s3", endpoint_url=url)

            def one_stream() -> int:
                got = 0
                for key in keys:
                    body = one.get_object(Bucket="bench", Key=key)["Body"]
                    while chunk := body.read(1 << 20):
                        got += len(chunk)
                assert got == total
                return n

            def two_streams() -> int:
                with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
                    assert sum(pool.map(get_object_stream, [url, url], [keys[0::2], keys[1::2]])) == total
                return n

            def stream(direct: bool) -> ShardStream:
                return ShardStream(
                    "s3://bench/lat",
                    batch_size=4,
                    shuffle=False,
                    decode=False,
                    world=World(0, 1),
                    store=Store(options=options, config=StorageConfig(s3_client="obstore" if direct else "s3fs")),
                )

            def ours(workers: int, direct: bool = True):
                loader = make_loader(stream(direct), num_workers=workers, pin_memory=False, log_interval=None)

                def run() -> int:
                    return sum(len(b["__key__"]) for b in loader)

                return run

            contenders = {
                "boto3 get_object, 1 stream": one_stream,
                "boto3 get_object, 2 streams (processes)": two_streams,
                "shardstream, 0 workers": ours(0),
                "shardstream, 2 workers": ours(2),
            }
            if not args.no_s3fs:
                contenders["shardstream, 0 workers, s3fs path"] = ours(0, direct=False)
                contenders["shardstream, 2 workers, s3fs path"] = ours(2, direct=False)
            for fn in contenders.values():  # warm-up: sessions, connections, the moto server's first reads
                fn()
            times: dict[str, list[float]] = {name: [] for name in contenders}
            gets: dict[str, int] = {}
            for _ in range(args.repeats):
                for name, fn in contenders.items():
                    before = proxy_counts(url).get("GET", 0)
                    t = time.perf_counter()
                    got = fn()
                    times[name].append(time.perf_counter() - t)
                    gets[name] = proxy_counts(url).get("GET", 0) - before
                    assert got == n, (name, got, n)

            def first_batch(workers: int, direct: bool = True) -> float:
                t = time.perf_counter()  # the manifest's read included
                it = iter(make_loader(stream(direct), num_workers=workers, pin_memory=False, log_interval=None))
                next(it)
                took = time.perf_counter() - t
                del it
                return took

            firsts: dict[str, list[float]] = {}
            kinds = [(0, True), (2, True)] + ([] if args.no_s3fs else [(0, False), (2, False)])
            for _ in range(args.first_batch):
                for workers, direct in kinds:
                    name = f"{workers} workers" + ("" if direct else ", s3fs path")
                    firsts.setdefault(name, []).append(first_batch(workers, direct))

        one_ref = statistics.median(times["boto3 get_object, 1 stream"])
        two_ref = statistics.median(times["boto3 get_object, 2 streams (processes)"])
        print(
            f"{len(keys)} shards of {args.per_shard} x 4 MiB ({total / 1e6:.0f} MB), {args.latency * 1e3:.0f} ms "
            f"added per request; medians of {args.repeats} interleaved passes"
        )
        print("| reader | MB/s | GETs per pass | vs 1 stream | vs 2 streams |")
        print("|---|---|---|---|---|")
        for name, values in times.items():
            med = statistics.median(values)
            print(f"| {name} | {total / med / 1e6:,.0f} | {gets[name]} | {one_ref / med:.2f} | {two_ref / med:.2f} |")
        print(f"\ntime to the first batch (batch 4 of 4 MiB; medians of {args.first_batch})")
        print("| loader | seconds |")
        print("|---|---|")
        for name, values in firsts.items():
            print(f"| {name} | {statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
