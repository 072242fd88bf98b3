"""``shardstream bench URL``: the loader's throughput for this dataset on this machine, and advice.

In training the main process is busy with the model, so it cannot also decode: ``--step-ms``
makes it spend that long per batch (a CPU busy loop, or with ``--step-wait`` an idle wait as for a
GPU step), and the advice is the fewest workers that keep that step fed.

Memory is read from ``/proc`` (Linux): the main process's peak RSS (``VmHWM``, reset before each
measurement where the kernel allows), each DataLoader worker's peak RSS, and the peak of their sum
(sampled every 0.1 s while batches come). The workers are the processes started under this one
during the measurement, children or, when they start from a forkserver, its children:
``getrusage(RUSAGE_CHILDREN)`` saw neither (forkserver workers are not this process's children, and
forked ones only once reaped), so the table and plot said 0 MB for every worker count. Without
``/proc`` the figures read n/a.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from shardstream.errors import ConfigError
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig

from .options import add_storage_arguments, storage_config_from, storage_options_from

NAME = "bench"
HELP = "measure loader throughput: samples/s, MB/s, time to first batch, peak memory, consumer wait"
EPILOG = """examples:
  shardstream bench ./shards --workers 2 --batch-size 64 --seconds 20
  shardstream bench s3://bucket/train --workers 8 --decode raw --endpoint-url http://127.0.0.1:9000
  shardstream bench ./shards --workers 4 --plot workers.png     # throughput and memory for 0..4 workers
  shardstream bench ./shards --workers 4 --plot w.png --repeats 3      # medians of 3 runs, spread as error bars
  shardstream bench ./shards --workers 4 --plot w.png --step-ms 120   # with a 120 ms training step per batch
  shardstream bench mix.yaml --workers 4                         # a mix of datasets
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="dataset root, index.json URL, shard pattern or mix file (.yaml/.json)")
    p.add_argument("--workers", type=int, default=2, help="workers per rank (default 2)")
    p.add_argument(
        "--runtime", choices=["threads", "processes"], default="threads", help="what a worker is (make_loader's workers=; default threads)"
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--decode", choices=["auto", "raw"], default="auto", help="decode by extension (auto) or not (raw)")
    p.add_argument("--seconds", type=float, default=10.0, help="measure for this long at most (default 10)")
    p.add_argument("--shuffle-buffer", type=int, default=1000)
    p.add_argument("--plot", metavar="FILE.png", help="measure 0..--workers workers and draw throughput and memory per worker count")
    p.add_argument(
        "--repeats", type=int, default=1, metavar="N", help="measure each worker count N times: medians, and the spread as error bars (default 1)"
    )
    p.add_argument(
        "--step-ms", type=float, default=0.0, metavar="MS", help="time the main process spends per batch, as a training step would (default 0: none)"
    )
    p.add_argument("--step-wait", action="store_true", help="the step waits idle (a GPU step) instead of keeping a CPU core busy (a CPU step)")
    add_storage_arguments(p)


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc (empty where there is no /proc)."""
    tree: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return tree
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # after "pid (comm) state"
        tree.setdefault(ppid, []).append(int(name))
    return tree


def descendants(pid: int) -> set[int]:
    """The processes under ``pid``: its children, theirs (a forkserver's workers), and so on."""
    tree = _children()
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def rss_mb(pid: int | str) -> tuple[float, float] | None:
    """(current RSS, peak RSS) of a process in MB (VmRSS, VmHWM of /proc/PID/status), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]) / 1000, int(fields["VmHWM"].split()[0]) / 1000  # kB
    except (OSError, KeyError, ValueError):
        return None


class MemoryWatch:
    """Peak RSS of this process, of each process started under it since, and of their sum, sampled
    with ``sample()`` (read from /proc; ``available`` False where there is none)."""

    def __init__(self) -> None:
        self.available = rss_mb("self") is not None
        try:  # the main process's peak from here on, not since it started (Linux 4.0+, "5": reset VmHWM)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.before = descendants(os.getpid()) if self.available else set()
        self.workers: dict[int, float] = {}
        self.total = 0.0
        self.last = 0.0

    def sample(self, every: float = 0.1) -> None:
        now = time.perf_counter()
        if not self.available or now - self.last < every:
            return
        self.last = now
        main = rss_mb("self")
        total = main[0] if main else 0.0
        for pid in descendants(os.getpid()) - self.before:
            mem = rss_mb(pid)
            if mem is not None:
                self.workers[pid] = max(self.workers.get(pid, 0.0), mem[1])
                total += mem[0]
        self.total = max(self.total, total)

    def figures(self) -> dict:
        main = rss_mb("self")
        return {
            "peak_rss_mb": main[1] if main else None,
            "peak_worker_rss_mb": max(self.workers.values(), default=0.0) if self.available else None,
            "peak_total_rss_mb": max(self.total, main[1] if main else 0.0) if self.available else None,
        }


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
    runtime: str = "threads",
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
    memory = MemoryWatch()
    loader = make_loader(dataset, num_workers=workers, workers=runtime, pin_memory=False)
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
            memory.sample(0.0 if batches == 1 else 0.1)
            if live and now - last_print > 0.5:
                last_print = now
                rate = samples / max(now - started - first, 1e-9)
                print(f"\r  {workers} workers: {samples} samples, {rate:,.0f} samples/s", end="", file=sys.stderr, flush=True)
            if now >= deadline:
                memory.sample(0.0)  # the workers are still there
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
        **memory.figures(),
    }


def combine(runs: list[dict]) -> dict:
    """One worker count's repeats as one row: the median of every figure, and the spread (lowest,
    highest) of throughput and of total memory for the error bars."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(value, (int, float)) and key != "workers" and all(v is not None for v in values):
            row[key] = statistics.median(values)
    rates = [r["samples_per_s"] for r in runs]
    row["samples_per_s_range"] = (min(rates), max(rates))
    totals = [r["peak_total_rss_mb"] for r in runs if r.get("peak_total_rss_mb") is not None]
    row["peak_total_rss_mb_range"] = (min(totals), max(totals)) if totals else None
    row["repeats"] = len(runs)
    return row


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


def _panel(draw, box: tuple[int, int, int, int], results: list[dict], value: str, spread: str, unit: str, heading: str) -> None:
    """Bars of ``results[i][value]`` per worker count inside ``box`` (x0, y0, x1, y1), each with
    the range ``results[i][spread]`` as an error bar and its value written above."""
    x0, y0, x1, y1 = box
    tops = [r[value] or 0.0 for r in results] + [(r.get(spread) or (0.0, 0.0))[1] for r in results]
    top = max(tops) or 1.0
    slot = (x1 - x0) / len(results)
    draw.line([(x0, y1), (x1, y1)], fill="black")
    draw.line([(x0, y0), (x0, y1)], fill="black")
    draw.text((x0, y0 - 28), heading, fill="black")
    draw.text((x0 - 60, y0 - 12), unit, fill="black")

    def y(v: float) -> float:
        return y1 - (y1 - y0) * v / top

    for i, r in enumerate(results):
        v = r[value] or 0.0
        a, b = x0 + i * slot + slot * 0.2, x0 + (i + 1) * slot - slot * 0.2
        draw.rectangle([a, y(v), b, y1], fill=(70, 110, 190))
        low_high = r.get(spread)
        if low_high is not None and low_high[1] > low_high[0]:
            mid = (a + b) / 2
            draw.line([(mid, y(low_high[0])), (mid, y(low_high[1]))], fill="black", width=2)
            for end in low_high:
                draw.line([(mid - 6, y(end)), (mid + 6, y(end))], fill="black", width=2)
        label = f"{v:,.0f}" if r[value] is not None else "n/a"
        draw.text((a, min(y(v), y((low_high or (v, v))[1])) - 14), label, fill="black")
        draw.text((a, y1 + 8), workers_label(r["workers"]), fill="black")
    draw.text(((x0 + x1) // 2 - 90, y1 + 30), "workers (num_workers)", fill="black")


def draw_plot(results: list[dict], path: str, title: str = "") -> None:
    """Throughput and memory against worker count, side by side, drawn with PIL (no plotting
    library): bars are medians over the repeats, error bars their lowest and highest."""
    from PIL import Image, ImageDraw

    width, height, margin = 1120, 440, 80
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    half = width // 2
    repeats = max(r.get("repeats", 1) for r in results)
    spread = f"error bars: lowest..highest of {repeats} runs" if repeats > 1 else "one run per count (--repeats N for error bars)"
    _panel(draw, (margin, margin + 20, half - 30, height - margin), results, "samples_per_s", "samples_per_s_range", "samples/s", "throughput")
    _panel(
        draw,
        (half + margin, margin + 20, width - 30, height - margin),
        results,
        "peak_total_rss_mb",
        "peak_total_rss_mb_range",
        "MB",
        "peak memory (RSS), main process + workers",
    )
    draw.text((margin, 10), "shardstream bench: throughput and memory by number of workers", fill="black")
    draw.text((margin, 26), f"{title}; {spread}", fill="black")
    img.save(path)


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} MB"


def run(args: argparse.Namespace) -> int:
    options = storage_options_from(args)
    config = storage_config_from(args)
    live = sys.stderr.isatty()
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    counts = list(range(0, args.workers + 1)) if args.plot else [args.workers]
    results = [
        combine(
            [
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
                    runtime=args.runtime,
                )
                for _ in range(args.repeats)
            ]
        )
        for w in counts
    ]
    print("| workers | samples/s | MB/s | first batch | consumer waited | peak RSS main / per worker / all |")
    print("|---|---|---|---|---|---|")
    for r in results:
        low, high = r["samples_per_s_range"]
        rate = f"{r['samples_per_s']:,.0f}" + (f" ({low:,.0f}-{high:,.0f})" if r["repeats"] > 1 else "")
        print(
            f"| {r['workers']} | {rate} | {r['mb_per_s']:,.1f} | {r['first_batch_s']:.2f} s | "
            f"{r['consumer_wait_s']:.2f} s of {r['seconds']:.1f} s | "
            f"{_mb(r['peak_rss_mb'])} / {_mb(r['peak_worker_rss_mb'])} / {_mb(r['peak_total_rss_mb'])} |"
        )
    if args.repeats > 1:
        print(f"(medians of {args.repeats} runs per count; samples/s: lowest-highest in brackets)")
    print(recommend(results, args.step_ms))
    if args.plot:
        cores = os.cpu_count() or 1
        step = f"{args.step_ms:g} ms {'wait' if args.step_wait else 'CPU'} step" if args.step_ms else "no step"
        title = f"batch {args.batch_size}, decode {args.decode}, {cores} {'core' if cores == 1 else 'cores'}, {step}, {args.seconds:g} s per count"
        draw_plot(results, args.plot, title)
        print(f"plot: {args.plot}")
    return 0
