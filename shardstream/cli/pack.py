"""``shardstream pack SRC DEST``: a dataset into WebDataset tar shards plus index.json."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shardstream.errors import ConfigError
from shardstream.write.limits import DEFAULT_MAX_COUNT, DEFAULT_MAX_SIZE

from .options import add_storage_arguments, human_bytes, parse_size, storage_config_from, storage_options_from, writer_deadline_help

NAME = "pack"
HELP = "pack a folder, a JSONL file, Parquet tables or existing shards into tar shards with a manifest"
EPILOG = """sources:
  a directory tree   files group by path without extension: cat/0001.jpg + cat/0001.json -> key cat/0001
  a .jsonl file      one object per line: {"__key__": "a1", "txt": "hi", "jpg": {"$file": "img/a1.jpg"}}
  tar shards         a packed dataset root, a .tar URL, a brace pattern or a glob
  Parquet tables     a .parquet file, a glob of them or a folder of them (pip install 'shardstream[tables]'):
                     a row per sample, a column per field by type (image bytes -> .jpg/.png/.webp,
                     strings -> .txt, integers -> .cls, floats/bools/lists/structs -> .json,
                     fixed-size numeric lists -> .npy); --columns selects, --key names the key column

examples:
  shardstream pack ./imagenet/train ./shards --label-from-dir --max-size 256MB --workers 4
  shardstream pack captions.jsonl s3://bucket/captions --endpoint-url http://127.0.0.1:9000
  shardstream pack 's3://old/train-{000000..000099}.tar' ./repacked --shuffle --seed 7
  shardstream pack s3://raw/laion.jsonl s3://bucket/laion --dask tcp://scheduler:8786 --max-count 10000
  shardstream pack 's3://raw/laion/*.parquet' ./laion --columns image,caption --key id --workers 8
  shardstream pack ./train s3://bucket/train --prefixes 16   # shards under 00/ .. 15/: 16 S3 prefixes to read from
  shardstream pack corpus.jsonl ./tokens --tokenizer tokenizer.json --text-field text --eos --workers 8

--tokenizer packs a token corpus (pip install 'shardstream[tokens]'): each document of a .jsonl
file (its --text-field) or of Parquet files (that column) becomes its token ids, read back as
fixed-length sequences with shardstream.Tokens (docs/tokens.md). The tokenizer is a Hugging Face
tokenizer.json or module:function (a function returning a tokenizer). With --dask a .jsonl corpus
packs one task per shard of --max-count documents (the tokenizer file must be readable from the
workers); Parquet documents pack with --workers only.

--dask ADDRESS runs one task per shard on a Dask cluster (pip install 'shardstream[dask]'); the
output is byte-identical to --workers 1. Sources must be readable from the workers (S3, a shared
file system). Under --dask shards are cut by --max-count only (sizes are not known before the
samples are loaded); --max-size then only warns about shards above it.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="directory, .jsonl file, .parquet file(s), or tar shards (local path or URL)")
    p.add_argument("dest", help="output directory or URL (s3://bucket/prefix)")
    p.add_argument("--kind", choices=["auto", "dir", "jsonl", "parquet", "shards"], default="auto", help="source kind (default: detect)")
    p.add_argument("--max-count", type=int, default=DEFAULT_MAX_COUNT, help=f"samples per shard at most (default {DEFAULT_MAX_COUNT})")
    p.add_argument("--max-size", type=parse_size, default=DEFAULT_MAX_SIZE, help="bytes per shard at most, e.g. 256MB (default 256MB)")
    p.add_argument("--prefix", default="shard", help="shard file name stem (default: shard)")
    p.add_argument(
        "--prefixes",
        type=int,
        default=1,
        metavar="N",
        help="spread shards over N directories (S3 prefixes): shard i goes to DEST/(i mod N)/, zero-padded, "
        "e.g. 03/shard-000003.tar (default 1: all in DEST)",
    )
    p.add_argument("--columns", type=_column_list, metavar="A,B,C", help="Parquet: the columns to pack, comma-separated (default: all but --key)")
    p.add_argument("--key", metavar="COLUMN", help="Parquet: the column holding each sample's key (default: file path and row number)")
    p.add_argument("--label-from-dir", action="store_true", help="add 'cls' from the first-level folder name (ImageFolder layout)")
    p.add_argument("--shuffle", action="store_true", help="shuffle the sample order at pack time")
    p.add_argument("--seed", type=int, default=0, help="seed for --shuffle (default 0)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes writing shards (a local folder) or loading samples; output is the same for any N "
        "(default: a local folder into a local DEST gets one per idle CPU, at most one per shard and per 32 MB; any other source 1; "
        "docs/packing.md#workers)",
    )
    p.add_argument("--dask", metavar="ADDRESS", help="run shard tasks on this Dask scheduler (tcp://host:8786)")
    p.add_argument("--retries", type=int, default=2, help="with --dask: times a failed task is retried (default 2)")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset or files already at DEST")
    p.add_argument("--on-error", choices=["raise", "skip"], default="raise", help="bad samples: stop (default) or skip and report")
    p.add_argument(
        "--allow-outside",
        action="append",
        default=[],
        metavar="ROOT",
        help="a folder or URL prefix outside the source's own root that $file references and symlinks may read from "
        "(repeatable; default: none, they are refused)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tokenizer", metavar="FILE|MODULE:FUNCTION", help="tokenize documents into a token corpus (docs/tokens.md)")
    p.add_argument(
        "--text-field", default="text", metavar="NAME", help="with --tokenizer: the JSON field or Parquet column of the text (default: text)"
    )
    p.add_argument(
        "--eos",
        nargs="?",
        const=True,
        default=False,
        metavar="TOKEN",
        help="with --tokenizer: end every document with this token (alone: the vocabulary's <|endoftext|>, </s>, <eos>, ...)",
    )
    add_storage_arguments(
        p, deadline_help=writer_deadline_help("a listing or read of the source (each item too) or the check of the destination (one listing)")
    )


def _column_list(text: str) -> list[str]:
    columns = [c.strip() for c in text.split(",") if c.strip()]
    if not columns:
        raise argparse.ArgumentTypeError("give one or more column names, comma-separated")
    return columns


def run(args: argparse.Namespace) -> int:
    from shardstream.write.pack import pack

    bar = None
    if not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit=" samples", desc="packing", dynamic_ncols=True, file=sys.stderr)
    last = [0]

    def listed(items: int) -> None:  # the total: tqdm then shows the rate and the time left
        if bar is not None:
            bar.reset(total=items)
            last[0] = 0

    def progress(samples: int, nbytes: int) -> None:
        if bar is not None:
            bar.update(samples - last[0])
            last[0] = samples
            if samples % 64 == 0:
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.set_postfix_str(f"{nbytes / 1e6:.1f} MB, {nbytes / 1e6 / elapsed:.1f} MB/s", refresh=False)

    if args.tokenizer:
        return _run_tokens(args, progress, bar)
    client = executor = None
    if args.dask:
        client, executor = _dask_executor(args)
    try:
        result = pack(
            args.src,
            args.dest,
            kind=args.kind,
            max_count=args.max_count,
            max_size=args.max_size,
            shuffle=args.shuffle,
            seed=args.seed,
            workers=args.workers,
            label_from_dir=args.label_from_dir,
            columns=args.columns,
            key=args.key,
            overwrite=args.overwrite,
            on_error=args.on_error,
            prefix=args.prefix,
            prefixes=args.prefixes,
            storage_options=storage_options_from(args),
            progress=progress,
            on_listed=listed,
            executor=executor,
            config=storage_config_from(args),
            allow_outside=args.allow_outside,
        )
    except KeyboardInterrupt:
        print("shardstream pack: interrupted; no manifest was written (run again to complete)", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
        if client is not None:
            client.close()
    rate = result.bytes / 1e6 / max(result.seconds, 1e-9)
    print(
        f"packed {result.samples} samples into {result.shards} shards, {human_bytes(result.bytes)} "
        f"in {result.seconds:.1f} s ({rate:.1f} MB/s, {result.samples / max(result.seconds, 1e-9):.0f} samples/s)"
    )
    exts = ", ".join(f"{k} ({v})" for k, v in sorted(result.manifest.extensions.items()))
    print(f"fields: {exts}")
    if result.manifest.label_map:
        print(f"labels: {len(result.manifest.label_map)} classes from folder names")
    if result.skipped_count:
        print(f"skipped {result.skipped_count} bad samples (listed in the manifest):")
        for entry in result.skipped[:10]:
            print(f"  {entry['source']}: {entry['error']}")
    if result.hidden:
        print(f"left out {result.hidden} hidden files (a part of their path starts with '.')")
    print(f"manifest: {result.manifest_url}")
    return 0


def _dask_executor(args: argparse.Namespace) -> tuple[Any, Any]:
    """A client of the ``--dask`` scheduler and its executor (tasks retried ``--retries`` times)."""
    try:
        from distributed import Client
    except ImportError:
        raise ConfigError("--dask needs Dask's distributed package: pip install 'shardstream[dask]'") from None
    client = Client(args.dask)
    return client, client.get_executor(pure=False, retries=args.retries)


def _run_tokens(args: argparse.Namespace, progress, bar) -> int:
    from shardstream.write.tokens import pack_tokens

    if args.shuffle or args.label_from_dir or args.columns or args.key or args.prefixes != 1 or args.kind not in ("auto", "jsonl", "parquet"):
        raise ConfigError(
            "--tokenizer packs documents in order: --shuffle, --label-from-dir, --columns, --key, --prefixes and --kind dir/shards do not apply"
        )
    client = executor = None
    if args.dask:
        client, executor = _dask_executor(args)
    try:
        result = pack_tokens(
            args.src,
            args.dest,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
            eos=args.eos,
            workers=args.workers if args.workers is not None else 1,
            max_count=args.max_count,
            max_size=args.max_size,
            prefix=args.prefix,
            overwrite=args.overwrite,
            storage_options=storage_options_from(args),
            progress=progress,
            config=storage_config_from(args),
            executor=executor,
        )
    except KeyboardInterrupt:
        print("shardstream pack: interrupted; no manifest was written (run again to complete)", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
        if client is not None:
            client.close()
    info = result.manifest.token_info or {}
    print(
        f"packed {result.samples} documents, {result.tokens} tokens ({info.get('dtype')}, vocabulary {info.get('vocab_size')}, "
        f"EOS id {info.get('eos_id')}) into {result.shards} shards, {human_bytes(result.bytes)} in {result.seconds:.1f} s"
    )
    print(f"manifest: {result.manifest_url}")
    return 0
