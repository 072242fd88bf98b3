"""``shardstream ls URL``: a dataset (or a mix file's datasets) at a glance from the manifests."""

from __future__ import annotations

import argparse
import json

from .options import add_storage_arguments, human_bytes, storage_config_from, storage_options_from

NAME = "ls"
HELP = "summarize a dataset from its manifest: shards, samples, bytes, fields, labels"
EPILOG = """examples:
  shardstream ls ./shards
  shardstream ls s3://bucket/train --endpoint-url http://127.0.0.1:9000 --json
  shardstream ls mix.yaml                       # every source of a mix file
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="dataset root, index.json URL or mix file (.yaml/.json)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--shards", action="store_true", help="also list every shard")
    add_storage_arguments(p)


def run(args: argparse.Namespace) -> int:
    from shardstream.format.manifest import load_manifest, manifest_url
    from shardstream.mixing import is_mix_url, open_mix

    if is_mix_url(args.url):
        mix = open_mix(args.url, storage_options_from(args), load_manifest)
        if mix is not None:
            return show_mix(args, mix)
    manifest = load_manifest(args.url, storage_options_from(args), config=storage_config_from(args))
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
    if args.json:
        if args.shards:
            summary["shard_list"] = [{"path": s.path, "samples": s.samples, "bytes": s.bytes} for s in manifest.shards]
        print(json.dumps(summary, indent=1))
        return 0
    sizes = [s.samples for s in manifest.shards] or [0]
    print(f"{summary['manifest']}")
    print(f"  {summary['shards']} shards, {summary['samples']} samples, {human_bytes(summary['bytes'])}"
          f" (samples per shard {min(sizes)}..{max(sizes)})")
    print("  fields: " + ", ".join(f"{ext} ({n})" for ext, n in sorted(manifest.extensions.items())))
    if manifest.label_map:
        counts = manifest.label_counts or {}
        print(f"  labels: {len(manifest.label_map)} classes")
        for name, index in sorted(manifest.label_map.items(), key=lambda kv: kv[1]):
            print(f"    {index:>5}  {name}" + (f"  {counts[name]} samples" if name in counts else ""))
    if summary["skipped"]:
        print(f"  skipped while packing: {summary['skipped']}")
    print(f"  written {manifest.created or '?'} by shardstream {manifest.shardstream_version or '?'}")
    if args.shards:
        for s in manifest.shards:
            print(f"  {s.path}  {s.samples} samples  {human_bytes(s.bytes)}")
    return 0


def show_mix(args: argparse.Namespace, mix) -> int:
    """Each source of a mix: its name, what it asks, and its manifest's size."""
    sources = [{"name": name, "url": source.url if isinstance(source.url, str) else source.label,
                "ask": source.ask().describe(), "shards": len(m.shards), "samples": m.total_samples,
                "bytes": m.total_bytes}
               for name, source, m in zip(mix.names, mix.sources, mix.manifests)]
    summary = {"mix": args.url, "sources": sources, "samples": sum(s["samples"] for s in sources),
               "bytes": sum(s["bytes"] for s in sources)}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{args.url}: mix of {len(sources)} sources, {summary['samples']} samples, {human_bytes(summary['bytes'])}")
    for s in sources:
        print(f"  {s['name']}  ({s['ask']})  {s['shards']} shards, {s['samples']} samples, {human_bytes(s['bytes'])}"
              + (f"  {s['url']}" if s["url"] != s["name"] else ""))
    return 0
