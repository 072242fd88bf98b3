"""Small samples through the user's own pipeline: a user per-sample function and a user collate
(torch's default_collate on dicts, on tuples), ShardStream vs webdataset vs the floor (the same
function and collate over the samples already in memory), side by side, interleaved, medians;
litData too when it is importable (not a dependency of shardstream).

    OMP_NUM_THREADS=1 python benchmarks/bench_user.py [--repeats 5] [--samples 100000] [--workers 0]

Samples: 1 KiB ``.bin`` + ``.cls``. Every contender does the same per-sample work (bytes -> uint8
tensor, label -> int) and the same collate; shardstream with ``decode=False`` (the user decodes),
no shuffle buffer for anyone (shuffling is not what this measures). Reported: samples/s of wall
time and per CPU-second (this process and its finished workers; steadier on a busy machine),
and each loader's gap to the floor.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from shardstream import World

BATCH = 64


def make_dataset(root: str, n: int) -> None:
    from shardstream import ShardWriter

    rng = np.random.default_rng(0)
    with ShardWriter(root, max_count=10_000, overwrite=True) as w:
        for i in range(n):
            w.write_encoded(f"{i:08d}", {"bin": rng.bytes(1024), "cls": str(i % 1000).encode()})


def to_dict(sample):
    import torch

    return {"x": torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8), "y": int(sample["cls"])}


def to_tuple(sample):
    import torch

    return torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8), int(sample["cls"])


def shardstream_run(root: str, fn, workers: int) -> int:
    from torch.utils.data import default_collate

    from shardstream import ShardStream, make_loader

    ds = ShardStream(root, batch_size=BATCH, shuffle=False, decode=False, transform=fn, collate=default_collate, world=World(0, 1))
    return sum(len(b[1] if isinstance(b, (list, tuple)) else b["y"]) for b in make_loader(ds, num_workers=workers, pin_memory=False))


def webdataset_run(root: str, fn, workers: int) -> int:
    import webdataset as wds
    from torch.utils.data import default_collate

    from shardstream import load_manifest

    urls = [os.path.join(root, s.path) for s in load_manifest(root).shards]
    ds = (
        wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.single_node_only, workersplitter=wds.split_by_worker, empty_check=False)
        .map(fn)
        .batched(BATCH, collation_fn=default_collate, partial=False)
    )
    return sum(len(b[1] if isinstance(b, (list, tuple)) else b["y"]) for b in wds.WebLoader(ds, batch_size=None, num_workers=workers))


def _identity(sample):
    return sample


def make_litdata(out: str, samples: list) -> bool:
    """The same samples in litData's format, when litdata is installed (it is not a dependency:
    run this script from an environment that has it, e.g. a venv with shardstream on PYTHONPATH)."""
    try:
        import litdata
    except ImportError:
        return False
    if not os.path.exists(os.path.join(out, "index.json")):
        litdata.optimize(fn=_identity, inputs=samples, output_dir=out, chunk_bytes="64MB", num_workers=2, mode="overwrite")
    return True


def litdata_run(out: str, fn, workers: int) -> int:
    import litdata
    from torch.utils.data import default_collate

    ds = litdata.StreamingDataset(input_dir=out, transform=fn)
    loader = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=default_collate)
    return sum(len(b[1] if isinstance(b, (list, tuple)) else b["y"]) for b in loader)


def floor_run(samples: list, fn) -> int:
    from torch.utils.data import default_collate

    n = 0
    for i in range(0, len(samples) - BATCH + 1, BATCH):
        b = default_collate([fn(s) for s in samples[i : i + BATCH]])
        n += len(b[1] if isinstance(b, (list, tuple)) else b["y"])
    return n


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    from shardstream import load_manifest
    from shardstream.format.tar import iter_samples

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--workers", default="0")
    parser.add_argument("--workdir", default="/dev/shm/ssbench-user")
    args = parser.parse_args()
    root = os.path.join(args.workdir, "small")
    make_dataset(root, args.samples)
    try:
        manifest = load_manifest(root)
        in_memory = []  # the floor's input: every sample already parsed, as {ext: bytes}
        for i, shard in enumerate(manifest.shards):
            with open(manifest.shard_url(i), "rb") as f:
                in_memory += [fields for _, _, _, fields in iter_samples(f.read, url="x", end=shard.span[1])]
        lit = os.path.join(args.workdir, "litdata")
        have_litdata = make_litdata(lit, in_memory)
        rows = []
        for workers in [int(w) for w in args.workers.split(",")]:
            for shape, fn in (("dict", to_dict), ("tuple", to_tuple)):
                contenders = {
                    "floor (in-memory list)": lambda: floor_run(in_memory, fn),
                    "shardstream": lambda: shardstream_run(root, fn, workers),
                    "webdataset": lambda: webdataset_run(root, fn, workers),
                }
                if have_litdata:
                    contenders["litData"] = lambda: litdata_run(lit, fn, workers)
                rates: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
                for _ in range(args.repeats):
                    for name, run in contenders.items():  # interleaved
                        gc.collect()
                        t, c = time.perf_counter(), cpu_seconds()
                        got = run()
                        rates[name].append((got / (time.perf_counter() - t), got / (cpu_seconds() - c)))
                floor = statistics.median(r[1] for r in rates["floor (in-memory list)"])
                web = statistics.median(r[1] for r in rates["webdataset"])
                for name, values in rates.items():
                    wall = statistics.median(r[0] for r in values)
                    cpu = statistics.median(r[1] for r in values)
                    rows.append((workers, shape, name, wall, cpu, cpu / floor, cpu / web))
        print("| num_workers | sample/collate | loader | samples/s wall | samples per CPU-s | of floor | vs webdataset |")
        print("|---|---|---|---|---|---|---|")
        for workers, shape, name, wall, cpu, of_floor, vs_web in rows:
            print(f"| {workers} | {shape}, torch default_collate | {name} | {wall:,.0f} | {cpu:,.0f} | {of_floor:.0%} | {vs_web:.2f}x |")
        print(f"(medians of {args.repeats} interleaved passes over {args.samples} x 1 KiB samples, batch {BATCH})")
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
