"""Figures for the CLI tools: `shardstream bench` on the demo dataset from local disk and from a
moto S3 server on 127.0.0.1, and `shardstream verify` time per GB.

    OMP_NUM_THREADS=1 python benchmarks/bench_cli.py [--seconds 10] [--verify-mb 500]

Packs the demo dataset (10 classes x 100 PNG 32x32) unless data/demo/shards exists, uploads it to
a moto server this script starts (and stops), and stages a --verify-mb dataset of ~100 KB
samples in /dev/shm for verify.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import moto_server


def run_cli(argv: list[str]) -> str:
    from shardstream.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"shardstream {' '.join(argv)} failed with {code}")
    return out.getvalue()


def main() -> None:
    import boto3
    import numpy as np

    from shardstream import ShardWriter
    from shardstream.write.pack import pack

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--verify-mb", type=int, default=500)
    args = parser.parse_args()
    demo = "data/demo/shards"
    if not os.path.exists(os.path.join(demo, "index.json")):
        os.system(f"{sys.executable} benchmarks/make_synthetic.py data/demo/src --classes 10 --per-class 100 --size 32")
        pack("data/demo/src", demo, label_from_dir=True, max_count=100, shuffle=True, overwrite=True)
    with moto_server() as endpoint:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="demo")
        pack(demo, "s3://demo/shards", storage_options={"endpoint_url": endpoint})
        for where, url, extra in (("local disk", demo, []), ("moto S3 (loopback)", "s3://demo/shards", ["--endpoint-url", endpoint])):
            print(f"## shardstream bench {url} ({where})")
            for workers in ("0", "2"):
                print(run_cli(["bench", url, "--workers", workers, "--batch-size", "64", "--seconds", str(args.seconds)] + extra))
    root = "/dev/shm/ssbench-verify"
    try:
        rng = np.random.default_rng(0)
        with ShardWriter(root, max_size=100_000_000, overwrite=True) as w:
            for i in range(args.verify_mb * 10):
                w.write_encoded(f"{i:08d}", {"bin": rng.bytes(100_000), "cls": b"1"})
        for flags in ([], ["--deep"]):
            t = time.perf_counter()
            out = run_cli(["verify", root, "--no-progress"] + flags)
            print(
                f"## shardstream verify {' '.join(flags)} ({args.verify_mb} MB in /dev/shm): {out.strip().splitlines()[-1]}"
                f" [wall {time.perf_counter() - t:.1f} s]"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
