"""Packing throughput: shardstream vs webdataset.ShardWriter, side by side, interleaved, medians.

    OMP_NUM_THREADS=1 python benchmarks/bench_pack.py [--repeats 5] [--workdir /dev/shm/ssbench]

Two inputs: small samples (~1 KB: .bin + .cls) and images (~100 KB JPEG + .cls). Two paths each:
  api  - the writer alone, fed the same in-memory sample dicts (bytes already encoded)
  dir  - from a directory tree on disk to shards: `shardstream pack` (pack(), 1 worker) versus
         the loop a webdataset user writes (walk the files, read them, wds.ShardWriter.write)
Output goes to --workdir (default /dev/shm, so disk speed does not mask CPU cost).
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


def make_inputs(workdir: str, kind: str, n: int):
    rng = np.random.default_rng(0)
    samples = []
    if kind == "small":
        for i in range(n):
            samples.append({"__key__": f"{i:08d}", "bin": rng.bytes(int(rng.integers(800, 1200))), "cls": str(i % 1000).encode()})
    else:
        import io

        from PIL import Image

        base = [rng.integers(0, 255, (300, 400, 3), dtype=np.uint8) for _ in range(8)]
        for i in range(n):
            img = np.roll(base[i % 8], i, axis=1)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            samples.append({"__key__": f"{i:08d}", "jpg": buf.getvalue(), "cls": str(i % 1000).encode()})
    src = os.path.join(workdir, f"src-{kind}")
    shutil.rmtree(src, ignore_errors=True)
    for s in samples:
        d = os.path.join(src, s["__key__"][:5])
        os.makedirs(d, exist_ok=True)
        for ext in ("bin", "jpg", "cls"):
            if ext in s:
                with open(os.path.join(d, f"{s['__key__'][5:]}.{ext}"), "wb") as f:
                    f.write(s[ext])
    total = sum(len(v) for s in samples for k, v in s.items() if k != "__key__")
    return samples, src, total


def run_ss_api(samples, out):
    from shardstream import ShardWriter

    with ShardWriter(out, max_count=100_000, max_size=10**12, overwrite=True) as w:
        for s in samples:
            w.write_encoded(s["__key__"], {k: v for k, v in s.items() if k != "__key__"})


def run_wds_api(samples, out):
    import webdataset as wds

    os.makedirs(out, exist_ok=True)
    with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxcount=100_000, maxsize=1e12, verbose=0) as w:
        for s in samples:
            w.write(s)


def run_ss_dir(src, out):
    from shardstream.write.pack import pack

    pack(src, out, max_count=100_000, max_size=10**12, overwrite=True)


def run_wds_dir(src, out):
    import webdataset as wds

    os.makedirs(out, exist_ok=True)
    groups: dict[str, dict[str, str]] = {}
    for root, _, files in os.walk(src):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            key, ext = rel.split(".", 1)
            groups.setdefault(key, {})[ext] = path
    with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxcount=100_000, maxsize=1e12, verbose=0) as w:
        for key in sorted(groups):
            sample = {"__key__": key}
            for ext, path in groups[key].items():
                with open(path, "rb") as f:
                    sample[ext] = f.read()
            w.write(sample)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default="/dev/shm/ssbench-pack")
    parser.add_argument("--small", type=int, default=50_000)
    parser.add_argument("--images", type=int, default=3_000)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    rows = []
    try:
        for kind, n in (("small", args.small), ("images", args.images)):
            samples, src, total = make_inputs(args.workdir, kind, n)
            runs = {
                ("api", "shardstream"): lambda o: run_ss_api(samples, o),
                ("api", "webdataset"): lambda o: run_wds_api(samples, o),
                ("dir", "shardstream"): lambda o: run_ss_dir(src, o),
                ("dir", "webdataset"): lambda o: run_wds_dir(src, o),
            }
            times: dict = {k: [] for k in runs}
            for _ in range(args.repeats):
                for key, fn in runs.items():  # interleaved, so noise hits both alike
                    out = os.path.join(args.workdir, "out")
                    shutil.rmtree(out, ignore_errors=True)
                    t = time.perf_counter()
                    fn(out)
                    times[key].append(time.perf_counter() - t)
            for path in ("api", "dir"):
                ss = statistics.median(times[(path, "shardstream")])
                wd = statistics.median(times[(path, "webdataset")])
                rows.append((kind, path, n, total, ss, wd))
            shutil.rmtree(src, ignore_errors=True)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    print("| input | path | samples | shardstream samples/s | shardstream MB/s | webdataset samples/s | webdataset MB/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, path, n, total, ss, wd in rows:
        print(f"| {kind} | {path} | {n} | {n / ss:,.0f} | {total / ss / 1e6:,.1f} | {n / wd:,.0f} | {total / wd / 1e6:,.1f} | {wd / ss:.2f}x |")
    print(f"(medians of {args.repeats} interleaved runs; ratio = webdataset time / shardstream time)")


if __name__ == "__main__":
    main()
