"""``shardstream bench URL``: the loader's throughput for this dataset on this machine."""

from __future__ import annotations

import argparse
import resource
import sys
import time

from .options import add_storage_arguments, storage_options_from

NAME = "bench"
HELP = "measure loader throughput: samples/s, MB/s, time to first batch, peak memory, consumer wait"
EPILOG = """examples:
  shardstream bench ./shards --workers 2 --batch-size 64 --seconds 20
  shardstream bench s3://bucket/train --workers 8 --decode raw --endpoint-url http://127.0.0.1:9000
  shardstream bench ./shards --workers 4 --plot workers.png     # throughput for 0..4 workers
  shardstream bench mix.yaml --workers 4                         # a mix of datasets
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="dataset root, index.json URL, shard pattern or mix file (.yaml/.json)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--decode", choices=["auto", "raw"], default="auto", help="decode by extension (auto) or not (raw)")
    p.add_argument("--seconds", type=float, default=10.0, help="measure for this long at most (default 10)")
    p.add_argument("--shuffle-buffer", type=int, default=1000)
    p.add_argument("--plot", metavar="FILE.png", help="measure 0..--workers workers and draw throughput per worker count")
    add_storage_arguments(p)


def measure(url: str, *, workers: int, batch_size: int, decode: bool, seconds: float, shuffle_buffer: int,
            storage_options: dict, live: bool = False) -> dict:
    """Run the loader for up to ``seconds`` (whole epochs repeat) and return its figures."""
    from shardstream.dataset import ShardStream
    from shardstream.loader import make_loader

    started = time.perf_counter()
    dataset = ShardStream(url, batch_size=batch_size, decode=decode, shuffle_buffer=shuffle_buffer,
                          rank=0, world_size=1, storage_options=storage_options)
    manifests = [dataset.manifest] if dataset.mix is None else dataset.mix.manifests
    bytes_per_sample = sum(m.total_bytes for m in manifests) / max(1, sum(m.total_samples for m in manifests))
    loader = make_loader(dataset, num_workers=workers, pin_memory=False)
    samples = batches = epoch = 0
    first = None
    waited = 0.0
    deadline = started + seconds
    last_print = 0.0
    done = False
    while not done:
        dataset.set_epoch(epoch)
        it = iter(loader)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            if first is None:
                first = now - started
            else:
                waited += now - t
            samples += len(batch["__key__"]) if isinstance(batch, dict) else batch_size
            batches += 1
            if live and now - last_print > 0.5:
                last_print = now
                rate = samples / max(now - started - first, 1e-9)
                print(f"\r  {workers} workers: {samples} samples, {rate:,.0f} samples/s", end="", file=sys.stderr, flush=True)
            if now >= deadline:
                done = True
                break
        del it
        epoch += 1
    elapsed = time.perf_counter() - started
    if live:
        print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    steady = max(elapsed - (first or 0.0), 1e-9)
    return {
        "workers": workers,
        "samples": samples,
        "batches": batches,
        "seconds": elapsed,
        "samples_per_s": max(samples - batch_size, 0) / steady if samples > batch_size else samples / elapsed,
        "mb_per_s": (max(samples - batch_size, 0) / steady) * bytes_per_sample / 1e6,
        "first_batch_s": first or 0.0,
        "consumer_wait_s": waited,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def draw_plot(results: list[dict], path: str) -> None:
    """Throughput against worker count as a small bar chart, drawn with PIL (no plotting library)."""
    from PIL import Image, ImageDraw

    width, height, margin = 640, 400, 60
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    top = max(r["samples_per_s"] for r in results) or 1.0
    slot = (width - 2 * margin) / len(results)
    draw.line([(margin, height - margin), (width - margin, height - margin)], fill="black")
    draw.line([(margin, margin), (margin, height - margin)], fill="black")
    for i, r in enumerate(results):
        h = (height - 2 * margin) * r["samples_per_s"] / top
        x0 = margin + i * slot + slot * 0.2
        x1 = margin + (i + 1) * slot - slot * 0.2
        draw.rectangle([x0, height - margin - h, x1, height - margin], fill=(70, 110, 190))
        draw.text((x0, height - margin + 8), f"{r['workers']} workers", fill="black")
        draw.text((x0, height - margin - h - 14), f"{r['samples_per_s']:,.0f}", fill="black")
    draw.text((margin, 20), "shardstream bench: samples/s by DataLoader workers", fill="black")
    img.save(path)


def run(args: argparse.Namespace) -> int:
    options = storage_options_from(args)
    live = sys.stderr.isatty()
    counts = list(range(0, args.workers + 1)) if args.plot else [args.workers]
    results = [measure(args.url, workers=w, batch_size=args.batch_size, decode=args.decode == "auto", seconds=args.seconds,
                       shuffle_buffer=args.shuffle_buffer, storage_options=options, live=live) for w in counts]
    print("| workers | samples/s | MB/s | first batch | consumer waited | peak RSS main / worker |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workers']} | {r['samples_per_s']:,.0f} | {r['mb_per_s']:,.1f} | {r['first_batch_s']:.2f} s | "
              f"{r['consumer_wait_s']:.2f} s of {r['seconds']:.1f} s | {r['peak_rss_mb']:.0f} / {r['peak_worker_rss_mb']:.0f} MB |")
    if args.plot:
        draw_plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0
