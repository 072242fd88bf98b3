"""``shardstream show URL``: the first samples (or one by key), field by field; ``--grid FILE.png``:
a picture of the first batch as training sees it (``tools.grid``)."""

from __future__ import annotations

import argparse
import itertools

from .options import add_storage_arguments, load_dataset_manifest, storage_config_from, storage_options_from

NAME = "show"
HELP = "print samples with a preview of every field; --extract writes their files out; --grid draws the first batch"
EPILOG = """examples:
  shardstream show ./shards -n 3
  shardstream show s3://bucket/train --key cat/0001 --extract ./out
  shardstream show ./shards --grid batch.png --batch-size 16               # the first batch, decoded
  shardstream show ./shards --grid batch.png --transform mytransforms:augment   # after your transform
--grid draws one tile per sample with its key and label: CHW/HWC tensors or arrays, grayscale,
uint8 as is, floats in [0, 1] times 255, normalised values rescaled per tile.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="dataset root or index.json URL")
    p.add_argument("-n", type=int, default=5, help="how many samples from the start (default 5)")
    p.add_argument("--key", help="show the sample with this key (found through the manifest's offsets)")
    p.add_argument("--extract", metavar="DIR", help="write the shown samples' fields as files under DIR")
    grid = p.add_argument_group("a picture of a batch")
    grid.add_argument("--grid", metavar="FILE.png", help="draw the first batch (decoded, transformed, collated) as a grid of tiles")
    grid.add_argument("--transform", metavar="MODULE:FUNCTION", help="the per-sample transform training uses (imported; the working directory first)")
    grid.add_argument("--batch-size", type=int, default=16, metavar="N", help="samples in the batch drawn (default 16)")
    grid.add_argument("--tile", type=int, default=128, metavar="PIXELS", help="a tile's image square, in pixels (default 128)")
    add_storage_arguments(p)


def run(args: argparse.Namespace) -> int:
    from shardstream.errors import ShardstreamError
    from shardstream.format.parquet import refuse_table
    from shardstream.tools.preview import describe_field, extract_sample, find_key, iter_dataset_samples

    options = storage_options_from(args)
    config = storage_config_from(args)
    if args.transform and not args.grid:
        raise ShardstreamError("--transform applies to --grid (the picture of a batch); give --grid FILE.png")
    manifest = load_dataset_manifest(args.url, options, config)
    refuse_table(manifest, "shardstream show")
    if args.grid:
        from shardstream.tools.grid import draw_batch_grid, load_transform

        transform = load_transform(args.transform) if args.transform else None
        grid = draw_batch_grid(
            args.url, args.grid, batch_size=args.batch_size, transform=transform, tile=args.tile, storage_options=options, config=config
        )
        rows = -(-grid.tiles // grid.columns)
        print(
            f"grid: {grid.path}: {grid.tiles} samples from {grid.field!r}, {grid.columns} x {rows} tiles of "
            f"{grid.tile[0]}x{grid.tile[1]} pixels (first key {grid.keys[0] if grid.keys else '?'})"
        )
        return 0
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
