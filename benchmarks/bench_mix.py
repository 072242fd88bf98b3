"""What mixing costs: ShardStream over one dataset vs the same samples as a three-source mix,
with webdataset (one dataset, and RandomMix over three) side by side; interleaved full passes,
medians.

    OMP_NUM_THREADS=1 python benchmarks/bench_mix.py [--samples 100000] [--repeats 5] [--workers 0,2]

The data (small samples, ~1-2 KB .bin + .cls, the per-sample-overhead case where mixing's extra
work shows most) is written once to /dev/shm: one dataset of N samples, and the same kind of
samples as three datasets of 0.5 N, 0.3 N and 0.2 N mixed with weights 0.5 / 0.3 / 0.2, so a
mixed epoch reads N samples too. Every loader shuffles (1000-sample buffer; the mix has one per
source), decodes and batches 64 as dicts. The target: the mix within 5% of one dataset.

Two figures per loader: samples per wall-clock second, and CPU microseconds per sample (this
process plus its DataLoader workers, which are joined at the end of each pass): on a shared,
loaded machine the CPU figure is the steadier measure of what mixing adds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import count, cpu_seconds

from shardstream import Schedule, Shuffle, World

BATCH = 64
BUFFER = 1000
SHARES = (0.5, 0.3, 0.2)


def make_small(root: str, first: int, n: int) -> None:
    from shardstream import ShardWriter

    rng = np.random.default_rng(first)
    with ShardWriter(root, max_count=10_000, overwrite=True) as w:
        for i in range(first, first + n):
            w.write_encoded(f"{i:08d}", {"bin": rng.bytes(int(rng.integers(1000, 2000))), "cls": str(i % 1000).encode()})


def shardstream_loader(source, workers: int, per_batch: str = "spread"):
    from shardstream import ShardStream, make_loader

    ds = ShardStream(source, batch_size=BATCH, shuffle=Shuffle(BUFFER), world=World(0, 1), schedule=Schedule(per_batch=per_batch))
    return make_loader(ds, num_workers=workers, pin_memory=False)


def webdataset_pipeline(root: str):
    import webdataset as wds

    from shardstream import load_manifest

    urls = [os.path.join(root, s.path) for s in load_manifest(root).shards]
    return (
        wds.WebDataset(urls, shardshuffle=100, nodesplitter=wds.single_node_only, workersplitter=wds.split_by_worker, empty_check=False)
        .shuffle(BUFFER)
        .decode()
    )


def webdataset_loader(roots: list[str], workers: int):
    import webdataset as wds

    if len(roots) == 1:
        ds = webdataset_pipeline(roots[0]).batched(BATCH, partial=True)
    else:
        mixed = wds.RandomMix([webdataset_pipeline(r) for r in roots], probs=list(SHARES))
        ds = wds.DataPipeline(mixed, wds.batched(BATCH, partial=True))
    return wds.WebLoader(ds, batch_size=None, num_workers=workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--workdir", default="/dev/shm/ssbench-mix")
    args = parser.parse_args()
    from shardstream import Source

    single = os.path.join(args.workdir, "single")
    parts = [os.path.join(args.workdir, f"part{i}") for i in range(3)]
    rows = []
    try:
        make_small(single, 0, args.samples)
        first = 0
        for root, share in zip(parts, SHARES):
            make_small(root, first, int(args.samples * share))
            first += int(args.samples * share)
        mix = [Source(root, weight=share, name=f"part{i}") for i, (root, share) in enumerate(zip(parts, SHARES))]
        for workers in [int(w) for w in args.workers.split(",")]:
            contenders = {
                "shardstream, one dataset": lambda: shardstream_loader(single, workers),
                "shardstream, mix of 3 (spread)": lambda: shardstream_loader(mix, workers),
                "shardstream, mix of 3 (exact per batch)": lambda: shardstream_loader(mix, workers, "exact"),
                "webdataset, one dataset": lambda: webdataset_loader([single], workers),
                "webdataset, RandomMix of 3": lambda: webdataset_loader(parts, workers),
            }
            rates: dict[str, list[float]] = {name: [] for name in contenders}
            cpu: dict[str, list[float]] = {name: [] for name in contenders}
            for make in contenders.values():  # warm-up: imports, page cache, first worker start-up
                count(make())
            for _ in range(args.repeats):
                for name, make in contenders.items():  # interleaved: noise hits all alike
                    t, c = time.perf_counter(), cpu_seconds()
                    got = count(make())
                    rates[name].append(got / (time.perf_counter() - t))
                    cpu[name].append((cpu_seconds() - c) / got * 1e6)
            refs = {
                k: (statistics.median(rates[f"{k}, one dataset"]), statistics.median(cpu[f"{k}, one dataset"])) for k in ("shardstream", "webdataset")
            }
            for name, values in rates.items():
                med, us = statistics.median(values), statistics.median(cpu[name])
                ref_rate, ref_us = refs[name.split(",")[0]]
                rows.append((workers, name, med, min(values), max(values), med / ref_rate, us, us / ref_us))
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    print("| num_workers | loader | samples/s (median) | min..max | vs one dataset | CPU us/sample | vs one dataset |")
    print("|---|---|---|---|---|---|---|")
    for workers, name, med, lo, hi, ratio, us, us_ratio in rows:
        print(f"| {workers} | {name} | {med:,.0f} | {lo:,.0f}..{hi:,.0f} | {ratio:.3f} | {us:.1f} | {us_ratio:.3f} |")
    print(f"(medians of {args.repeats} interleaved full passes of {args.samples} samples, batch {BATCH}, shuffle buffer {BUFFER})")


if __name__ == "__main__":
    main()
