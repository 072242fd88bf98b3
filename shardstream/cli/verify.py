"""``shardstream verify URL``: every shard against the manifest; non-zero exit on any problem."""

from __future__ import annotations

import argparse
import importlib
import sys
import threading
import time

from .options import add_storage_arguments, human_bytes, load_dataset_manifest, storage_config_from, storage_options_from

NAME = "verify"
HELP = "check every shard: exists, size, sha256, sample count, offsets (--deep: decode every field)"
EPILOG = """examples:
  shardstream verify ./shards
  shardstream verify s3://bucket/train --deep --endpoint-url http://127.0.0.1:9000
exit status: 0 when intact, 1 when any problem was found (all are listed).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="dataset root or index.json URL")
    p.add_argument("--deep", action="store_true", help="also decode every field by extension")
    p.add_argument("--threads", type=int, default=4, help="shards checked at once (default 4)")
    p.add_argument("--no-progress", action="store_true")
    add_storage_arguments(p)


def run(args: argparse.Namespace) -> int:
    from shardstream.format.parquet import refuse_table
    from shardstream.tools.verify import verify_dataset

    manifest = load_dataset_manifest(args.url, storage_options_from(args), storage_config_from(args))
    refuse_table(manifest, "shardstream verify")
    bar = None
    lock = threading.Lock()
    if not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=manifest.total_bytes, unit="B", unit_scale=True, desc="verifying", file=sys.stderr)

    def progress(n: int) -> None:
        if bar is not None:
            with lock:
                bar.update(n)

    if args.deep:  # the decoders' libraries load before the clock starts: the rate is the check's alone
        for name in ("numpy", "torch", "PIL.Image", "simplejpeg"):
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    started = time.perf_counter()
    try:
        problems = verify_dataset(
            manifest,
            deep=args.deep,
            storage_options=storage_options_from(args),
            progress=progress,
            threads=args.threads,
            config=storage_config_from(args),
        )
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - started
    for problem in problems:
        print(f"PROBLEM {problem}")
    rate = manifest.total_bytes / 1e6 / max(seconds, 1e-9)
    verdict = f"{len(problems)} problems" if problems else "OK"
    print(
        f"{verdict}: {len(manifest.shards)} shards, {manifest.total_samples} samples, "
        f"{human_bytes(manifest.total_bytes)} checked{' deeply' if args.deep else ''} in {seconds:.1f} s "
        f"({rate:.1f} MB/s, {seconds / max(manifest.total_bytes / 1e9, 1e-9):.1f} s per GB)"
    )
    return 1 if problems else 0
