"""``shardstream bench URL``: the loader's throughput for this dataset on this machine, and advice.

In training the main process is busy with the model, so it cannot also decode: ``--step-ms``
makes it spend that long per batch (a CPU busy loop, or with ``--step-wait`` an idle wait as for a
GPU step), and the advice is the fewest workers that keep that step fed.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig

from .options import add_storage_arguments, storage_config_from, storage_options_from

NAME = "bench"
HELP = "measure loader throughput: samples/s, MB/s, time to first batch, peak memory, consumer wait"
EPILOG = """examples:
  shardstream bench ./shards --workers 2 --batch-size 64 --seconds 20
  shardstream bench s3://bucket/train --workers 8 --decode raw --endpoint-url http://127.0.0.1:9000
  shardstream bench ./shards --workers 4 --plot workers.png     # throughput for 0..4 workers
  shardstream bench ./shards --workers 4 --plot w.png --step-ms 120   # with a 120 ms training step per batch
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
    p.add_argument(
        "--step-ms", type=float, default=0.0, metavar="MS", help="time the main process spends per batch, as a training step would (default 0: none)"
    )
    p.add_argument("--step-wait", action="store_true", help="the step waits idle (a GPU step) instead of keeping a CPU core busy (a CPU step)")
    add_storage_arguments(p)


def busy(seconds: float) -> None:
    """Keep this process's CPU busy for ``seconds``, as the Python side of a training step does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(
    url: str,
    *,
    workers: int,
    batch_size: int,
    decode: bool,
    seconds: float,
    shuffle_buffer: int,
    storage_options: dict,
    live: bool = False,
    step_ms: float = 0.0,
    step_wait: bool = False,
    config: StorageConfig = DEFAULT_STORAGE,
) -> dict:
    """Run the loader for up to ``seconds`` (whole epochs repeat) and return its figures.
    ``config``: the storage policy of every read (the manifest's and the workers')."""
    from shardstream.dataset import ShardStream
    from shardstream.loader import make_loader
    from shardstream.options import Shuffle, Store
    from shardstream.plan.topology import World

    started = time.perf_counter()
    dataset = ShardStream(
        url,
        batch_size=batch_size,
        decode=decode,
        shuffle=Shuffle(shuffle_buffer),
        world=World(0, 1),
        store=Store(options=storage_options, config=config),
    )
    manifests = dataset.sources.manifests
    bytes_per_sample = sum(m.total_bytes for m in manifests) / max(1, sum(m.total_samples for m in manifests))
    loader = make_loader(dataset, num_workers=workers, pin_memory=False)
    samples = batches = epoch = 0
    first = None
    waited = 0.0
    step = step_ms / 1000
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
            if step:
                if step_wait:
                    time.sleep(step)
                else:
                    busy(step)
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


def workers_label(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def recommend(results: list[dict], step_ms: float) -> str:
    """The fewest workers within 5% of the best throughput, and how long the step waits there."""
    best = max(r["samples_per_s"] for r in results)
    pick = min((r for r in results if r["samples_per_s"] >= 0.95 * best), key=lambda r: r["workers"])
    wait = pick["consumer_wait_s"] / max(pick["seconds"], 1e-9)
    text = f"recommendation: num_workers={pick['workers']} ({pick['samples_per_s']:,.0f} samples/s"
    if len(results) == 1:
        text += "; measured only this count, --plot measures 0..--workers)"
    else:
        text += f", within 5% of the best of {len(results)} counts measured)"
    if step_ms:
        verdict = "the step would wait for data" if wait > 0.05 else "data keeps up with the step"
        text += f"; with a {step_ms:g} ms step {verdict} ({100 * wait:.0f}% of the time waiting)"
        if wait > 0.05 and pick["workers"] == max(r["workers"] for r in results):
            text += "; try more workers (--workers), cheaper decoding (draft_size, --decode raw) or more cores"
    else:
        text += "; nothing ran in the main process: give --step-ms (a training step's time) for advice that holds in training"
    return text


def draw_plot(results: list[dict], path: str, title: str = "") -> None:
    """Throughput against worker count as a small bar chart, drawn with PIL (no plotting library)."""
    from PIL import Image, ImageDraw

    width, height, margin = 720, 420, 70
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
        draw.text((x0, height - margin + 8), workers_label(r["workers"]), fill="black")
        draw.text((x0, height - margin - h - 14), f"{r['samples_per_s']:,.0f}", fill="black")
    draw.text((8, margin - 18), "samples/s", fill="black")
    draw.text((width // 2 - 90, height - margin + 30), "DataLoader workers (num_workers)", fill="black")
    draw.text((margin, 12), "shardstream bench: throughput (samples/s) by number of DataLoader workers", fill="black")
    draw.text((margin, 28), title, fill="black")
    img.save(path)


def run(args: argparse.Namespace) -> int:
    options = storage_options_from(args)
    config = storage_config_from(args)
    live = sys.stderr.isatty()
    counts = list(range(0, args.workers + 1)) if args.plot else [args.workers]
    results = [
        measure(
            args.url,
            workers=w,
            batch_size=args.batch_size,
            decode=args.decode == "auto",
            seconds=args.seconds,
            shuffle_buffer=args.shuffle_buffer,
            storage_options=options,
            live=live,
            step_ms=args.step_ms,
            step_wait=args.step_wait,
            config=config,
        )
        for w in counts
    ]
    print("| workers | samples/s | MB/s | first batch | consumer waited | peak RSS main / worker |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['workers']} | {r['samples_per_s']:,.0f} | {r['mb_per_s']:,.1f} | {r['first_batch_s']:.2f} s | "
            f"{r['consumer_wait_s']:.2f} s of {r['seconds']:.1f} s | {r['peak_rss_mb']:.0f} / {r['peak_worker_rss_mb']:.0f} MB |"
        )
    print(recommend(results, args.step_ms))
    if args.plot:
        cores = os.cpu_count() or 1
        step = f"{args.step_ms:g} ms {'wait' if args.step_wait else 'CPU'} step" if args.step_ms else "no step"
        title = f"batch {args.batch_size}, decode {args.decode}, {cores} {'core' if cores == 1 else 'cores'}, {step}, {args.seconds:g} s per count"
        draw_plot(results, args.plot, title)
        print(f"plot: {args.plot}")
    return 0
