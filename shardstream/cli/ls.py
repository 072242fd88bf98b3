"""``shardstream ls URL``: a dataset (or a mix file's datasets) at a glance from the manifests."""

from __future__ import annotations

import argparse
import json
import sys

from .options import add_storage_arguments, human_bytes, load_dataset_manifest, parse_size, storage_config_from, storage_options_from

NAME = "ls"
HELP = "summarize a dataset from its manifest: shards, samples, bytes, fields, labels"
EPILOG = """examples:
  shardstream ls ./shards
  shardstream ls s3://bucket/train --endpoint-url http://127.0.0.1:9000 --json
  shardstream ls mix.yaml                       # every source of a mix file
  shardstream ls s3://bucket/train --world 64 --workers 8 --rate 1GB   # GET requests per epoch and per second

--world/--workers: the GET requests an epoch makes on that many ranks with that many DataLoader
workers each (one per shard range, plus offset sidecars), per second when every rank reads --rate
bytes per second, and on the busiest prefix; a warning past S3's 5,500 GET/s per prefix. A dataset
on local disk is counted as if its shards were on S3 (what it would make once uploaded). For a mix
file: every remote source's GETs and their sum, over all its sources' prefixes (as the stream
reads it: local sources make none).

The start: the GETs and bytes before the first batch. Under a process group made before the
ShardStream, rank 0 reads the manifests (a table's footers) once and hands them to every rank
(docs/training.md, Across nodes); where each rank reads them itself, --world times that.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="dataset root, index.json URL or mix file (.yaml/.json)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--shards", action="store_true", help="also list every shard")
    requests = p.add_argument_group("request accounting (any of these shows it)")
    requests.add_argument("--world", type=int, metavar="N", help="ranks reading the dataset (default 1)")
    requests.add_argument("--workers", type=int, metavar="W", help="DataLoader workers per rank (default 1)")
    requests.add_argument(
        "--batch-size",
        type=int,
        default=1,
        metavar="B",
        help="batch size: where worker slices cut shards (default 1; the counts barely depend on it)",
    )
    requests.add_argument(
        "--mode", choices=["drop", "pad"], default="drop", help="the stream's mode: drop the uneven tail or pad to it (default drop)"
    )
    requests.add_argument("--rate", type=parse_size, metavar="BYTES", help="bytes per second each rank reads, e.g. 1GB (default 1GB)")
    add_storage_arguments(p)


def run(args: argparse.Namespace) -> int:
    from shardstream.format.manifest import manifest_url
    from shardstream.sources import is_mix_url, load_source, open_mix

    config = storage_config_from(args)
    if is_mix_url(args.url):  # each source as the stream opens it (a Parquet table too)
        mix = open_mix(args.url, storage_options_from(args), lambda url, options: load_source(url, options, config), config)
        if mix is not None:
            return show_mix(args, mix)
    manifest = load_dataset_manifest(args.url, storage_options_from(args), config)
    summary = {
        "manifest": manifest_url(args.url),
        "shards": len(manifest.shards),
        "samples": manifest.total_samples,
        "bytes": manifest.total_bytes,
        "extensions": manifest.extensions,
        "label_map": manifest.label_map,
        "label_counts": manifest.label_counts,
        "skipped": manifest.skipped.get("count", 0),
        "created": manifest.created,
        "shardstream_version": manifest.shardstream_version,
    }
    accounting = requests_of(args, manifest)
    if accounting is not None:
        summary["requests"] = requests_json(args, *accounting)
    if args.json:
        if args.shards:
            summary["shard_list"] = [{"path": s.path, "samples": s.samples, "bytes": s.bytes} for s in manifest.shards]
        print(json.dumps(summary, indent=1))
        return 0
    sizes = [s.samples for s in manifest.shards] or [0]
    print(f"{summary['manifest']}")
    print(
        f"  {summary['shards']} shards, {summary['samples']} samples, {human_bytes(summary['bytes'])} (samples per shard {min(sizes)}..{max(sizes)})"
    )
    print("  fields: " + ", ".join(f"{ext} ({n})" for ext, n in sorted(manifest.extensions.items())))
    if manifest.tokens is not None:  # a token corpus (docs/tokens.md)
        info = manifest.token_info or {}
        print(
            f"  tokens: {manifest.total_tokens} ({info.get('dtype')}, vocabulary {info.get('vocab_size')}, "
            f"EOS id {info.get('eos_id')}, tokenizer {info.get('tokenizer')})"
        )
    if manifest.label_map:
        counts = manifest.label_counts or {}
        print(f"  labels: {len(manifest.label_map)} classes")
        for name, index in sorted(manifest.label_map.items(), key=lambda kv: kv[1]):
            print(f"    {index:>5}  {name}" + (f"  {counts[name]} samples" if name in counts else ""))
    if summary["skipped"]:
        print(f"  skipped while packing: {summary['skipped']}")
    print(f"  written {manifest.created or '?'} by shardstream {manifest.shardstream_version or '?'}")
    if accounting is not None:
        print_requests(args, *accounting)
    if args.shards:
        for s in manifest.shards:
            print(f"  {s.path}  {s.samples} samples  {human_bytes(s.bytes)}")
    return 0


def requests_of(args: argparse.Namespace, manifest):
    """``(RequestCount, rate, start_cost)`` for the topology the flags give, or None when none was asked for:
    a single dataset is planned as the stream plans it (the one planner; reported as one dataset)."""
    from shardstream.sources import Mix, Source

    return mix_requests_of(args, Mix([Source(manifest)], [manifest], [{}], [""], mixed=False))


def mix_requests_of(args: argparse.Namespace, mix):
    """``requests_of`` for a mix: epoch 0 as ``ShardStream.plan()`` plans it by default (seed 0,
    spread per batch, ``--mode``; ``Mix.report``, the stream's planner), each source counted on
    its own manifest (a local one makes no requests)."""
    if args.world is None and args.workers is None and args.rate is None:
        return None
    from shardstream.plan.requests import DEFAULT_RATE

    plan = mix.report(world_size=args.world or 1, num_workers=args.workers or 1, batch_size=args.batch_size, mode=args.mode)
    return plan.count_requests(mix.manifests), float(args.rate or DEFAULT_RATE), start_cost(mix.manifests, mixed=mix.mixed)


def start_cost(manifests, *, mixed: bool) -> tuple[int, int]:
    """``(GETs, bytes)`` of reading the sources once: one GET of each dataset's index.json (its
    bytes as written: the version-2 JSON), a Parquet table's footers without one (one GET each),
    and the mix file."""
    from shardstream.format.parquet import TableManifest

    gets, size = int(mixed), 0
    for m in manifests:
        if isinstance(m, TableManifest):
            gets, size = gets + len(m.files), size + int(m.footer_sizes.sum())
        else:
            gets, size = gets + 1, size + len(m.dumps())
    return gets, size


def requests_json(args: argparse.Namespace, count, rate: float, start: tuple[int, int]) -> dict:
    prefix, busiest = count.busiest(rate)
    out = {
        "world_size": args.world or 1,
        "workers": args.workers or 1,
        "rate": rate,
        "gets_per_epoch": count.gets,
        "ranges": count.ranges,
        "sidecars": count.sidecars,
        "gets_per_second": round(count.per_second(rate), 1),
        "busiest_prefix": prefix,
        "busiest_prefix_gets_per_second": round(busiest, 1),
        "prefixes": len(count.by_prefix),
        "warning": count.warning(rate),
    }
    gets, size = start
    world = args.world or 1
    out["start"] = {"gets": gets, "bytes": size, "gets_each_rank_reading": gets * world, "bytes_each_rank_reading": size * world}
    if count.parts:  # a mix: each source's GETs, over the same epoch
        seconds = count.seconds(rate)
        out["by_source"] = {
            name: {"local": part.local, "gets_per_epoch": part.gets, "gets_per_second": round(part.gets / seconds, 1) if seconds else 0.0}
            for name, part in count.parts
        }
    return out


def print_requests(args: argparse.Namespace, count, rate: float, start: tuple[int, int]) -> None:
    from shardstream.plan.requests import S3_GETS_PER_PREFIX

    world = args.world or 1
    gets, size = start
    print(f"  {world} ranks x {args.workers or 1} workers, {count.describe(rate)}")
    print(
        f"  start: {gets:,} GETs, {human_bytes(size)} (read by rank 0 and handed over under a process group; "
        f"{gets * world:,} GETs, {human_bytes(size * world)} where each rank reads them itself)"
    )
    if gets * world > S3_GETS_PER_PREFIX:
        print(
            f"shardstream ls: warning: {gets * world:,} GETs of the manifest within seconds, above S3's {S3_GETS_PER_PREFIX:,} "
            "per prefix, where each rank reads it: initialise torch.distributed before making the ShardStream",
            file=sys.stderr,
        )
    warning = count.warning(rate)
    if warning:
        print(f"shardstream ls: warning: {warning}", file=sys.stderr)


def show_mix(args: argparse.Namespace, mix) -> int:
    """Each source of a mix: its name, what it asks, and its manifest's size."""
    sources = [
        {
            "name": name,
            "url": source.url if isinstance(source.url, str) else source.label,
            "ask": source.ask().describe(),
            "shards": len(m.shards),
            "samples": m.total_samples,
            "bytes": m.total_bytes,
        }
        for name, source, m in zip(mix.names, mix.sources, mix.manifests)
    ]
    summary = {"mix": args.url, "sources": sources, "samples": sum(s["samples"] for s in sources), "bytes": sum(s["bytes"] for s in sources)}
    accounting = mix_requests_of(args, mix)
    if accounting is not None:
        summary["requests"] = requests_json(args, *accounting)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{args.url}: mix of {len(sources)} sources, {summary['samples']} samples, {human_bytes(summary['bytes'])}")
    for s in sources:
        print(
            f"  {s['name']}  ({s['ask']})  {s['shards']} shards, {s['samples']} samples, {human_bytes(s['bytes'])}"
            + (f"  {s['url']}" if s["url"] != s["name"] else "")
        )
    if accounting is not None:
        print_requests(args, *accounting)
    return 0
