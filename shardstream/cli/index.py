"""``shardstream index SHARDS... DEST``: a manifest for shards written by others."""

from __future__ import annotations

import argparse

from .options import add_storage_arguments, storage_options_from

NAME = "index"
HELP = "write a shardstream manifest for existing tar shards without rewriting them"
EPILOG = """examples:
  shardstream index './wds/train-{000000..000099}.tar' ./wds
  shardstream index 's3://bucket/laion/*.tar' s3://bucket/laion/index.json --threads 16
  shardstream index ./downloads ./downloads           (a directory: its *.tar, *.tar.gz, ... shards)
  shardstream index 'a/*.tar' 'b/*.tgz' shards.txt ./all   (several inputs; shards.txt lists URLs)
DEST is a directory (index.json is written there) or a .json path. Shard paths are stored
relative to DEST's directory when they are under it (however either is spelled: relative, ./,
absolute or file://), else as absolute paths or full URLs.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shards", nargs="+", help="shard URLs (.tar, .tar.gz, .tgz, .tar.zst, ...), brace patterns, globs, "
                   "directories, or text files listing shard URLs")
    p.add_argument("dest", help="directory or .json path for the manifest")
    p.add_argument("--threads", type=int, default=8, help="shards read at once (default 8)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing manifest at DEST")
    add_storage_arguments(p)


def run(args: argparse.Namespace) -> int:
    from shardstream.tools.index import write_index

    options = storage_options_from(args)
    manifest, url = write_index(args.shards, args.dest, storage_options=options, threads=args.threads, overwrite=args.overwrite)
    print(f"indexed {len(manifest.shards)} shards, {manifest.total_samples} samples; manifest: {url}")
    return 0
