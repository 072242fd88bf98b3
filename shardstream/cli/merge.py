"""``shardstream merge DEST PART [PART ...]``: one dataset from several packed ones, no copying."""

from __future__ import annotations

import argparse

from .options import add_storage_arguments, storage_config_from, storage_options_from, writer_deadline_help

NAME = "merge"
HELP = "combine separately packed datasets into one manifest (shards stay where they are)"
EPILOG = """examples:
  shardstream merge s3://bucket/train s3://bucket/train/day-01 s3://bucket/train/day-02
  shardstream merge ./all ./all ./all/day-03        # grow ./all by one more part
Shard paths are stored relative to DEST when a part lies under DEST (keep parts in DEST's
sub-folders for a dataset that can be moved as a whole), else as full URLs (local shards by their
absolute path), whichever way the paths are spelled (./day-01, day-01, /abs/day-01). A shard listed twice
is refused. The merged manifest is written last, atomically.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dest", help="dataset root (or .json path) for the merged manifest")
    p.add_argument("parts", nargs="+", help="packed datasets, in the order their samples should come")
    p.add_argument("--overwrite", action="store_true", help="replace a manifest at DEST that is not one of the parts")
    add_storage_arguments(p, deadline_help=writer_deadline_help("a read (each part's manifest, the check of DEST)"))


def run(args: argparse.Namespace) -> int:
    from shardstream.tools.merge import merge_datasets

    manifest, url = merge_datasets(
        args.dest, args.parts, storage_options=storage_options_from(args), overwrite=args.overwrite, config=storage_config_from(args)
    )
    print(f"merged {len(args.parts)} parts: {len(manifest.paths)} shards, {manifest.total_samples} samples; manifest: {url}")
    return 0
