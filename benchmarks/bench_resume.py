"""Resume cost: time to the first batch when a loader resumes an epoch at 0% and at 90% (exact, same
topology) and at 90% onto another world size (elastic), from local disk (/dev/shm) and from a moto
S3 server on 127.0.0.1; plus the cost of the shuffle simulation that finds the buffer's contents.

    OMP_NUM_THREADS=1 python benchmarks/bench_resume.py [--samples 100000] [--repeats 3]

Rank 0 of 2, make_loader with 2 workers, batch 64, shuffle buffer 1000. Each measurement builds a
fresh ShardStream and loader (as a restarted job does), loads the state, and times until the
first batch arrives. Interleaved repeats, medians. A resume at 90% must not read the 90%: it reads
each worker's buffered samples back (<= one buffer) and the unread rest.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from shardstream import Shuffle, Store, World

sys.path.insert(0, os.path.dirname(__file__))

SETTINGS = dict(batch_size=64, seed=1, shuffle=Shuffle(1000))


def write(url: str, n: int, options: dict | None, per_shard: int) -> None:
    from shardstream import ShardWriter

    rng = np.random.default_rng(0)
    with ShardWriter(url, max_count=per_shard, storage_options=options) as w:
        for i in range(n):
            w.write_encoded(f"{i:08d}", {"bin": rng.bytes(int(rng.integers(500, 1500))), "cls": b"1"})


def first_batch(source: str, options: dict | None, state: dict | None, world: int) -> tuple[float, int, int]:
    """Seconds from constructing the loader to its first batch; bytes read and ranges opened
    (one request each on S3) by then."""
    from shardstream import ShardStream, make_loader

    started = time.perf_counter()
    ds = ShardStream(source, world=World(0, world), **SETTINGS, store=Store(options=options))
    loader = make_loader(ds, num_workers=2, log_interval=None)
    if state is not None:
        loader.load_state_dict(state)
    it = iter(loader)
    next(it)
    elapsed = time.perf_counter() - started
    stats = loader.stats()
    del it
    return elapsed, stats["bytes_read"], stats["ranges_opened"]


def state_at(source: str, options: dict | None, fraction: float) -> dict:
    from shardstream import ShardStream, make_loader

    ds = ShardStream(source, world=World(0, 2), **SETTINGS, store=Store(options=options))
    make_loader(ds, num_workers=2, log_interval=None)
    return ds.state_dict(batches=int(fraction * len(ds)), num_workers=2)


def simulation_cost(lengths: list[int], repeats: int) -> list[str]:
    from shardstream.plan.shuffle import cut_stream

    rows = []
    for n in lengths:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            cut_stream(n, int(0.9 * n), buffer_size=1000, initial=100, rng=random.Random(0))
            times.append(time.perf_counter() - t)
        rows.append(
            f"shuffle simulation, one worker stream of {n:,} samples at 90%: {statistics.median(times) * 1e3:.0f} ms "
            f"({statistics.median(times) / n * 1e9:.0f} ns per sample)"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-samples", type=int, default=2_000)
    parser.add_argument("--no-s3", action="store_true")
    args = parser.parse_args()
    from common import start_moto

    rows = simulation_cost([100_000, 1_000_000], args.repeats)
    for row in rows:
        print(row, flush=True)
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    sources: list[tuple[str, str, dict | None]] = [("local", os.path.join(root, "ds"), None)]
    proc = None
    try:
        write(sources[0][1], args.samples, None, args.shard_samples)
        if not args.no_s3:
            import boto3

            proc, endpoint = start_moto()
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
            options = {"endpoint_url": endpoint}
            write("s3://bench/ds", args.samples, options, args.shard_samples)
            sources.append(("moto S3", "s3://bench/ds", options))
        cases = [
            ("fresh epoch (no state)", None, 2),
            ("exact resume at 0%", 0.0, 2),
            ("exact resume at 90%", 0.9, 2),
            ("elastic resume at 90%, 2 -> 3 ranks", 0.9, 3),
        ]
        states = {(name, f): state_at(src, opts, f) for name, src, opts in sources for f in (0.0, 0.9)}
        times: dict = {}
        for _ in range(args.repeats):
            for name, src, opts in sources:
                for label, fraction, world in cases:
                    state = None if fraction is None else states[name, fraction]
                    times.setdefault((name, label), []).append(first_batch(src, opts, state, world))
        print(
            f"{args.samples:,} samples of ~1 KB in shards of {args.shard_samples}, rank 0 of 2, 2 workers, batch 64, buffer 1000; "
            f"median of {args.repeats} interleaved repeats",
            flush=True,
        )
        for (name, label), values in times.items():
            t = statistics.median(v[0] for v in values)
            read = statistics.median(v[1] for v in values)
            opened = statistics.median(v[2] for v in values)
            print(f"{name:8s} {label:38s} first batch {t:6.2f} s, {read / 1e6:6.1f} MB in {opened:5.0f} ranges by then", flush=True)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
