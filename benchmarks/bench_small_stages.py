"""Where a small sample's CPU goes with no workers: bench_small.py's samples and user function,
taken apart stage by stage in one process (thread CPU time per sample, min and median of the
rounds, the cases interleaved within each round).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_small_stages.py [--data DIR] [--writer shardstream,webdataset] [--rounds 5]

``--data``: bench_small.py's ``--workdir`` kept with ``--keep`` (``DIR/WRITER/tars`` are read); the
shards are made there (by that script) when missing. Cases, each a whole pass over the samples:

- ``fn``, ``fn + collate``: the floor, the user's function (and torch's ``default_collate``, batch 64)
  over the samples in memory
- ``parse``: ``read_ranges`` over every shard, whole (the read stage: reads, tar parse, sample dicts)
- ``parse, then fn``: the same, the user's function called on each list's samples as they come
- ``pipeline``: ``make_loader`` over a ``ShardStream`` with no transform and a collate that only
  lists the samples (plan, read, the stages after it, batches, the loader)
- ``pipeline + fn``: the same with the user's function as the transform
- ``pipeline + fn + collate``: what bench_small.py runs (less the dataset's construction)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/dev/shm/ssbench-small")
    parser.add_argument("--writer", default="shardstream,webdataset")
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import bench_small
    from torch.utils.data import default_collate

    from shardstream import ShardStream, World, make_loader
    from shardstream.format.manifest import load_manifest
    from shardstream.pipeline.read import RangeSource, read_ranges
    from shardstream.plan.epoch import Range

    fn, n = bench_small.fn, args.samples
    for writer in args.writer.split(","):
        root = os.path.join(args.data, writer, "tars")
        if not os.path.exists(os.path.join(args.data, writer, f"built-{n}")):
            subprocess.run(
                [sys.executable, os.path.join(HERE, "bench_small.py"), "--only", "shardstream", "--workers", "0", "--repeats", "1"]
                + ["--samples", str(n), "--writer", writer, "--workdir", args.data, "--keep"],
                check=True,
            )
        memory = [{"bin": payload, "json": label} for _, payload, label in bench_small.samples(n)]
        manifest = load_manifest(root)
        ranges = [Range(i, 0, int(manifest.counts[i])) for i in range(len(manifest.shards))]

        def floor(collate: bool) -> int:
            for i in range(0, n, bench_small.BATCH):
                out = [fn(s) for s in memory[i : i + bench_small.BATCH]]
                if collate:
                    default_collate(out)
            return n

        def parse(call: bool) -> int:
            got = 0
            for chunk in read_ranges(RangeSource(manifest), ranges):
                if call:
                    for sample in chunk:
                        fn(sample)
                got += len(chunk)
            return got

        def listed(samples: list) -> dict:
            return {"y": samples}

        def pipeline(transform, collate) -> int:
            ds = ShardStream(root, batch_size=bench_small.BATCH, shuffle=False, decode=False, transform=transform, collate=collate, world=World(0, 1))
            got = 0
            for batch in make_loader(ds, num_workers=0, pin_memory=False, log_interval=None):
                got += len(batch["y"])
            return got

        cases = {
            "fn": lambda: floor(False),
            "fn + collate": lambda: floor(True),
            "parse": lambda: parse(False),
            "parse, then fn": lambda: parse(True),
            "pipeline": lambda: pipeline(None, listed),
            "pipeline + fn": lambda: pipeline(fn, listed),
            "pipeline + fn + collate": lambda: pipeline(fn, default_collate),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for case in cases.values():  # warm: imports, the page cache, the allocator
            case()
        for _ in range(args.rounds):
            for name, case in cases.items():
                start = time.thread_time()
                got = case()
                times[name].append((time.thread_time() - start) / got * 1e6)
        print(f"| {writer}-written shards | min us/sample | median |")
        print("|---|---|---|")
        for name, each in times.items():
            print(f"| {name} | {min(each):.2f} | {statistics.median(each):.2f} |")
        print(f"(load average {' '.join(f'{x:.1f}' for x in os.getloadavg())})")


if __name__ == "__main__":
    main()
