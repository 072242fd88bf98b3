"""Tar parse time by member size: the parser in the working tree against another version of
``shardstream/format/tar.py`` (for before/after), side by side in one run, interleaved, medians.

    OMP_NUM_THREADS=1 python benchmarks/bench_tarparse.py [--before /tmp/tar_before.py] [--sizes 4,64,500] \
        [--repeats 3] [--piece 1] [--workdir /dev/shm/ssbench-tarparse]

For each size (MB) one shard holding one member of that size (plus a small label member) is
written to tmpfs and parsed with ``iter_sample_batches``, its bytes handed over in pieces of
``--piece`` MiB (as the read-ahead thread and the S3 reader hand them over), so a parser that
rebuilds its buffer per piece shows its quadratic cost. A run of 20,000 1.5 KB samples checks the
small-sample path (samples/s). webdataset's tarfile-based reader is shown for reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def load_parser(path: str):
    spec = importlib.util.spec_from_file_location(f"tar_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_shard(path: str, members: list[tuple[str, int]]) -> None:
    from shardstream.format.tar import END_OF_ARCHIVE, member_header, padding

    with open(path, "wb") as f:
        for name, size in members:
            f.write(member_header(name, size))
            block = os.urandom(min(size, 1 << 20))
            left = size
            while left:
                f.write(block[: min(left, len(block))])
                left -= min(left, len(block))
            f.write(padding(size))
        f.write(END_OF_ARCHIVE)


def parse_time(module, path: str, piece: int) -> tuple[float, int]:
    size = os.path.getsize(path)
    with open(path, "rb", buffering=0) as f:

        def read(n: int) -> bytes:
            return f.read(min(n, piece))

        t0 = time.perf_counter()
        count = 0
        for batch in module.iter_sample_batches(read, url=path, start=0, end=size, require_end_marker=True):
            count += len(batch)
        return time.perf_counter() - t0, count


def wds_time(path: str) -> float:
    import webdataset as wds

    t0 = time.perf_counter()
    for _ in wds.WebDataset(path, shardshuffle=False, empty_check=False):
        pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None, help="path of another tar.py to compare against")
    ap.add_argument("--sizes", default="4,64,500")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--piece", type=float, default=1.0, help="MiB handed over per read() call")
    ap.add_argument("--workdir", default="/dev/shm/ssbench-tarparse")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    here = os.path.join(os.path.dirname(__file__), "..", "shardstream", "format", "tar.py")
    parsers = {"after": load_parser(here)}
    if args.before:
        parsers = {"before": load_parser(args.before), **parsers}
    piece = int(args.piece * (1 << 20))
    shards = {}
    for mb in [int(s) for s in args.sizes.split(",")]:
        path = os.path.join(args.workdir, f"one-{mb}mb.tar")
        write_shard(path, [("s0.bin", mb << 20), ("s0.cls", 1)])
        shards[f"{mb} MB member"] = path
    small = os.path.join(args.workdir, "small.tar")
    write_shard(small, [(f"{i:06d}.{ext}", 1500 if ext == "bin" else 1) for i in range(20_000) for ext in ("bin", "cls")])
    shards["20k x 1.5 KB"] = small
    print(f"piece {args.piece} MiB, repeats {args.repeats}, medians in seconds (small: samples/s)")
    for label, path in shards.items():
        times: dict[str, list[float]] = {name: [] for name in [*parsers, "webdataset"]}
        for _ in range(args.repeats):
            for name, module in parsers.items():
                seconds, _count = parse_time(module, path, piece if "member" in label else 4 << 20)
                times[name].append(seconds)
            times["webdataset"].append(wds_time(path))
        if "member" in label:
            row = "  ".join(f"{name} {statistics.median(v):7.3f}s" for name, v in times.items())
        else:
            row = "  ".join(f"{name} {20_000 / statistics.median(v):9,.0f}/s" for name, v in times.items())
        print(f"{label:>16}: {row}", flush=True)
    for path in shards.values():
        os.remove(path)


if __name__ == "__main__":
    main()
