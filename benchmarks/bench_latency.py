"""Small shards on a high-latency store: read-ahead with 1 thread vs several (``Read(readahead_threads=N)``).

    OMP_NUM_THREADS=1 python benchmarks/bench_latency.py [--latency 0.03] [--shards 100] [--repeats 3]

The moto server (its own process, 127.0.0.1) sits behind the tests' fault proxy, which adds
``--latency`` seconds before answering each GET (as a distant region or a busy store does). Every
shard holds 10 samples of ~1.5 KB, so each one is a round trip that moves almost nothing: the time
per pass is round trips, one after another with one thread, N at a time with N. One process, no
shuffle, undecoded; interleaved passes, medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main() -> None:
    from common import moto_bucket
    from faultproxy import FaultProxy  # type: ignore[import-not-found]

    from shardstream import Read, ShardStream, ShardWriter, Store, World

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2,4,8")
    args = parser.parse_args()
    with moto_bucket() as (endpoint, moto_options, _, _):
        with ShardWriter("s3://bench/small", max_count=10, storage_options=moto_options) as w:
            for i in range(10 * args.shards):
                w.write_encoded(f"{i:08d}", {"bin": os.urandom(1500), "cls": b"1"})
        with FaultProxy(endpoint, latency=args.latency) as proxy:
            options = {"endpoint_url": proxy.url}
            counts = [int(t) for t in args.threads.split(",")]
            times: dict[int, list[float]] = {n: [] for n in counts}
            for _ in range(args.repeats):
                for n in counts:
                    ds = ShardStream(
                        "s3://bench/small",
                        batch_size=50,
                        shuffle=False,
                        decode=False,
                        world=World(0, 1),
                        store=Store(options=options, read=Read(readahead_threads=n)),
                    )
                    t = time.perf_counter()
                    got = sum(len(b["__key__"]) for b in ds)
                    times[n].append(time.perf_counter() - t)
                    assert got == 10 * args.shards, got
        base = statistics.median(times[counts[0]])
        print(f"| read-ahead threads | pass of {args.shards} shards ({args.latency * 1e3:.0f} ms per GET) | samples/s | speed-up |")
        print("|---|---|---|---|")
        for n in counts:
            med = statistics.median(times[n])
            print(f"| {n} | {med:.2f} s | {10 * args.shards / med:,.0f} | {base / med:.1f}x |")


if __name__ == "__main__":
    main()
