"""``shardstream show URL``: the first samples (or one by key), field by field."""

from __future__ import annotations

import argparse
import itertools

from .options import add_storage_arguments, storage_config_from, storage_options_from

NAME = "show"
HELP = "print samples with a preview of every field; --extract writes their files out"
EPILOG = """examples:
  shardstream show ./shards -n 3
  shardstream show s3://bucket/train --key cat/0001 --extract ./out
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="dataset root or index.json URL")
    p.add_argument("-n", type=int, default=5, help="how many samples from the start (default 5)")
    p.add_argument("--key", help="show the sample with this key (found through the manifest's offsets)")
    p.add_argument("--extract", metavar="DIR", help="write the shown samples' fields as files under DIR")
    add_storage_arguments(p)


def run(args: argparse.Namespace) -> int:
    from shardstream.errors import ShardstreamError
    from shardstream.format.manifest import load_manifest
    from shardstream.format.parquet import refuse_table
    from shardstream.tools.preview import describe_field, extract_sample, find_key, iter_dataset_samples

    options = storage_options_from(args)
    config = storage_config_from(args)
    manifest = load_manifest(args.url, options, config=config)
    refuse_table(manifest, "shardstream show")
    if args.key is not None:
        sample = find_key(manifest, args.key, options, config=config)
        if sample is None:
            raise ShardstreamError(f"no sample with key {args.key!r} in {args.url}")
        samples = [sample]
    else:
        samples = list(itertools.islice(iter_dataset_samples(manifest, options, config=config), max(0, args.n)))
    for sample in samples:
        print(f"{sample['__key__']}  ({sample['__url__']})")
        for ext, data in sample.items():
            if not ext.startswith("__"):
                print(f"  .{ext:<10} {len(data):>10} B  {describe_field(ext, data)}")
        if args.extract:
            for path in extract_sample(sample, args.extract):
                print(f"  wrote {path}")
    return 0
