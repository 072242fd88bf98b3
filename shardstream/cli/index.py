"""``shardstream index SHARDS... DEST``: a manifest for shards written by others;
``shardstream index --upgrade DATASET``: a version-1 manifest to version 2."""

from __future__ import annotations

import argparse
import os
import shlex

from shardstream.errors import ConfigError

from .options import add_storage_arguments, storage_config_from, storage_options_from, writer_deadline_help

NAME = "index"
HELP = "write a shardstream manifest for existing tar shards (or Parquet files) without rewriting them"
EPILOG = """examples:
  shardstream index './wds/train-{000000..000099}.tar' ./wds
  shardstream index 's3://bucket/laion/*.tar' s3://bucket/laion/index.json --threads 16
  shardstream index ./downloads ./downloads           (a directory: its *.tar, *.tar.gz, ... shards)
  shardstream index 'a/*.tar' 'b/*.tgz' shards.txt ./all   (several inputs; shards.txt lists URLs)
DEST is a directory (index.json is written there) or a .json path. Shard paths are stored
relative to DEST's directory when they are under it (however either is spelled: relative, ./,
absolute or file://), else as absolute paths or full URLs. Each shard's offsets go to a sidecar
(SHARD.idx beside it, or offsets/NNNNNN.idx under DEST for shards elsewhere), written before the
manifest.
  shardstream index 's3://bucket/table/*.parquet' s3://bucket/table
writes a Parquet table's manifest (kind "parquet") from the files' footers alone (no data page
read): inputs all .parquet URLs or globs, or one folder holding .parquet files and no tar shards.
  shardstream index --upgrade s3://bucket/old-dataset
turns a version-1 manifest (offsets inline) into version 2 in place, without reading the shards.
  shardstream index './tokenized/shard-{0000..0099}.tar' ./tokenized --tokens npy
counts the token ids of shards written by others (one 1-D integer .npy member per sample) in the
manifest: Tokens('./tokenized', seq_len=2048) streams them as sequences (docs/tokens.md).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "shards",
        nargs="+",
        help="shard URLs (.tar, .tar.gz, .tgz, .tar.zst, ...), brace patterns, globs, directories, or text files listing shard URLs",
    )
    p.add_argument("dest", nargs="?", help="directory or .json path for the manifest")
    p.add_argument("--upgrade", action="store_true", help="rewrite a version-1 manifest (the one input) as version 2")
    p.add_argument("--threads", type=int, default=8, help="shards read at once (default 8)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing manifest at DEST")
    p.add_argument(
        "--tokens",
        metavar="FIELD",
        default=None,
        help="the shards hold token ids, one 1-D integer .npy member FIELD per sample (npy, input_ids.npy): count them per shard (docs/tokens.md)",
    )
    add_storage_arguments(p, deadline_help=writer_deadline_help("a listing or read (the inputs, each shard, the manifest, the check of DEST)"))


def run(args: argparse.Namespace) -> int:
    from shardstream.tools.index import upgrade_manifest, write_index

    options = storage_options_from(args)
    config = storage_config_from(args)
    if args.upgrade:
        given = len(args.shards) + (args.dest is not None)
        if given != 1:
            raise ConfigError(f"index --upgrade takes one dataset root or index.json, got {given}")
        manifest, url, upgraded = upgrade_manifest(args.shards[0], storage_options=options, config=config)
        state = "upgraded to version 2" if upgraded else "already version 2, left as it is"
        print(f"{url}: {state} ({len(manifest.paths)} shards, {manifest.total_samples} samples)")
        return 0
    if args.dest is None:  # argparse gives every positional to SHARDS...; the last one is DEST
        if len(args.shards) < 2:
            raise ConfigError(f"index needs SHARDS... DEST, the manifest's directory or .json path last{_how_to_index(args.shards[0])}")
        args.dest = args.shards.pop()
    manifest, url = write_index(
        args.shards, args.dest, storage_options=options, threads=args.threads, overwrite=args.overwrite, config=config, tokens=args.tokens
    )
    files = getattr(manifest, "files", None)  # a Parquet table (format/parquet.py)
    if files is not None:
        print(f"indexed a Parquet table: {len(files)} files, {len(manifest.counts)} row groups, {manifest.total_samples} rows; manifest: {url}")
    else:
        tokens = f", {manifest.total_tokens} tokens ({(manifest.token_info or {}).get('dtype')})" if manifest.total_tokens is not None else ""
        print(f"indexed {len(manifest.shards)} shards, {manifest.total_samples} samples{tokens}; manifest: {url}")
    return 0


def _how_to_index(given: str) -> str:
    """For a local folder ``given``, the command that indexes its shards (into a folder of their
    own, as the manifest-not-found advice says, or in place)."""
    if "://" in given or not os.path.isdir(given):
        return ""
    folder = shlex.quote(given)
    return f" (this folder's shards: shardstream index {folder} DEST, DEST a folder of its own for the manifest, or {folder} to write it beside them)"
