"""Packing throughput: shardstream vs webdataset.ShardWriter, side by side, interleaved, medians.

    OMP_NUM_THREADS=1 python benchmarks/bench_pack.py [--repeats 5] [--workdir /dev/shm/ssbench]

Two inputs: small samples (~1 KB: .bin + .cls) and images (~100 KB JPEG + .cls). Two paths each:
  api  - the writer alone, fed the same in-memory sample dicts (bytes already encoded)
  dir  - from a directory tree on disk to shards: `shardstream pack` (pack(), 1 worker) versus
         the loop a webdataset user writes (walk the files, read them, wds.ShardWriter.write)
Output goes to --workdir (default /dev/shm, so disk speed does not mask CPU cost).

    OMP_NUM_THREADS=1 python benchmarks/bench_pack.py --scaling [--files 20000] [--repeats 3]

--scaling: `shardstream pack --workers 1` against `--workers 2` (each run a fresh process, as a user
runs it; 1 and 2 interleaved; medians), on --files small JPEGs (32x32, ~1.5 KB, made with PIL in an
ImageFolder tree) and on a Parquet table of the same images (key, jpg bytes, cls; row groups of
1,000 rows). Checks that both worker counts write byte-identical shards; prints wall seconds, CPU
seconds (the pack and its workers) and the speed-up, plus versions and the load average.
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


def make_jpegs(workdir: str, n: int) -> tuple[str, str]:
    """n small JPEGs in an ImageFolder tree (10 classes), and the same images as a Parquet table."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    base = [rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for _ in range(16)]
    tree, table = os.path.join(workdir, "jpegs"), os.path.join(workdir, "jpegs.parquet")
    keys, images, labels = [], [], []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(np.roll(base[i % 16], i, axis=0)).save(buf, format="JPEG", quality=90)
        folder = os.path.join(tree, f"class_{i % 10:02d}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{i:06d}.jpg"), "wb") as f:
            f.write(buf.getvalue())
        keys.append(f"{i:06d}")
        images.append(buf.getvalue())
        labels.append(i % 10)
    pq.write_table(pa.table({"key": keys, "jpg": images, "cls": labels}), table, row_group_size=1000)
    return tree, table


def run_scaling(args) -> None:
    import hashlib
    import platform
    import resource
    import subprocess

    import shardstream

    os.makedirs(args.workdir, exist_ok=True)
    tree, table = make_jpegs(args.workdir, args.files)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), ".."), os.environ.get("PYTHONPATH", "")])}
    sources = {"jpegs": [tree, "--label-from-dir"], "parquet": [table, "--key", "key"]}
    times: dict = {(s, w): [] for s in sources for w in (1, 2)}
    cpu: dict = {k: [] for k in times}
    digests: dict = {}
    loads = [os.getloadavg()[0]]
    try:
        for _ in range(args.repeats):
            for name, src in sources.items():
                for w in (1, 2):  # interleaved: noise hits both alike
                    out = os.path.join(args.workdir, f"out-{name}-{w}")
                    shutil.rmtree(out, ignore_errors=True)
                    cmd = [sys.executable, "-m", "shardstream", "pack", src[0], out, *src[1:], "--workers", str(w), "--no-progress"]
                    before = resource.getrusage(resource.RUSAGE_CHILDREN)
                    t = time.perf_counter()
                    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                    times[(name, w)].append(time.perf_counter() - t)
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    cpu[(name, w)].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
                    shards = sorted(f for f in os.listdir(out) if f.endswith(".tar"))
                    digests[(name, w)] = [hashlib.sha256(open(os.path.join(out, f), "rb").read()).hexdigest() for f in shards]
                    loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    versions = f"python {platform.python_version()}, shardstream {shardstream.__version__}, {os.cpu_count()} CPUs"
    print(f"{versions}, load average {min(loads):.2f}-{max(loads):.2f}")
    print("| source | files | --workers 1 s (runs) | --workers 2 s (runs) | CPU s 1 / 2 | speed-up | same bytes |")
    print("|---|---|---|---|---|---|---|")
    for name in sources:
        one, two = statistics.median(times[(name, 1)]), statistics.median(times[(name, 2)])
        runs1 = " ".join(f"{t:.2f}" for t in times[(name, 1)])
        runs2 = " ".join(f"{t:.2f}" for t in times[(name, 2)])
        c1, c2 = statistics.median(cpu[(name, 1)]), statistics.median(cpu[(name, 2)])
        same = digests[(name, 1)] == digests[(name, 2)]
        print(f"| {name} | {args.files} | {one:.2f} ({runs1}) | {two:.2f} ({runs2}) | {c1:.2f} / {c2:.2f} | {one / two:.2f}x | {same} |")
    print(f"(medians of {args.repeats} interleaved runs, each a fresh `python -m shardstream pack` process)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default="/dev/shm/ssbench-pack")
    parser.add_argument("--small", type=int, default=50_000)
    parser.add_argument("--images", type=int, default=3_000)
    parser.add_argument("--scaling", action="store_true", help="--workers 1 against 2 on small JPEGs and a Parquet table")
    parser.add_argument("--files", type=int, default=20_000, help="with --scaling: the number of JPEGs (and table rows)")
    args = parser.parse_args()
    if args.scaling:
        run_scaling(args)
        return
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
