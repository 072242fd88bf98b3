"""A table's read-ahead across window boundaries, on S3 behind a first-byte latency: a pass of
``--epochs`` data epochs (``Schedule(steps=...)``: one window each) over a Parquet table served
by a real S3-compatible server (``s3server.py``, default s3rver) through ``latency_proxy.py``
(``--latency`` seconds before each request), no DataLoader workers, columnar batches.

Trees are compared, each pass a fresh process, interleaved: ``--before`` (copies of earlier
shardstream trees, e.g. ``git archive COMMIT shardstream | tar -x -C DIR``) and this checkout. Per
pass: rows per wall second and per CPU second, the first batch of the pass, and the wait for the
first batch of each later window (the gap between the last batch of a window and the next
window's first) beside the median gap between batches inside a window and the gap before a row
group's first batch inside a window (unshuffled: its decode, and any wait for its bytes).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_table_windows.py --before before=/tmp/before \\
        [--rows 1048576] [--files 8] [--group 131072] [--batch 4096] [--epochs 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_tables import COLUMNS, make_table  # this folder is a script's first path entry

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def one_pass(args) -> dict:
    """In the tree on sys.path: one pass, each batch's arrival time."""
    from shardstream import Schedule, ShardStream, Shuffle, Store, Table, World

    t, c = time.perf_counter(), time.process_time()
    ds = ShardStream(
        Table(args.url, columns=COLUMNS),
        batch_size=args.batch,
        shuffle=Shuffle(10_000) if args.shuffled else False,
        world=World(0, 1),
        store=Store(options={"endpoint_url": args.endpoint}),
        schedule=Schedule(steps=args.epochs * (args.rows // args.batch)),
    )
    built = time.perf_counter() - t
    arrivals, rows = [], 0
    for batch in ds:
        arrivals.append(time.perf_counter() - t)
        rows += len(batch["label"])
    stats = ds.stats()
    return {
        "built": built,
        "arrivals": arrivals,
        "rows": rows,
        "wall": time.perf_counter() - t,
        "cpu": time.process_time() - c,
        "requests": stats["requests"],
        "bytes_read": stats["bytes_read"],
        "peak": stats["readahead_peak"],
    }


def summarise(got: dict, per_epoch: int, epochs: int, per_group: int) -> dict:
    arrivals = got["arrivals"]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    inside = [g for i, g in enumerate(gaps, 1) if i % per_epoch]  # gap before batch i, i not a window's first
    window_waits = [gaps[k * per_epoch - 1] for k in range(1, epochs)]
    # the gap before the first batch of a row group inside a window (unshuffled: its decode, and any wait for its bytes)
    group_gaps = [g for i, g in enumerate(gaps, 1) if i % per_epoch and per_group and i % per_group == 0]
    return {
        "rows_per_s": got["rows"] / got["wall"] / 1e6,
        "rows_per_cpu_s": got["rows"] / got["cpu"] / 1e6,
        "first": arrivals[0] - got["built"],
        "window_wait": statistics.median(window_waits),
        "inside_gap": statistics.median(inside),
        "group_gap": statistics.median(group_gaps) if group_gaps else 0.0,
        "requests": got["requests"],
        "bytes_read": got["bytes_read"],
        "peak": got["peak"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="copies of earlier shardstream trees (folders holding shardstream/): PATH or NAME=PATH,NAME=PATH")
    parser.add_argument("--rows", type=int, default=1 << 20)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--group", type=int, default=131_072)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--server", default="s3rver")
    parser.add_argument("--shuffled", default="0,1", help="passes unshuffled (0) and/or with Shuffle(10000) (1)")
    # internal: one pass
    parser.add_argument("--pass", dest="one", action="store_true")
    parser.add_argument("--url")
    parser.add_argument("--endpoint")
    args = parser.parse_args()
    if args.one:
        args.shuffled = args.shuffled == "1"
        print(json.dumps(one_pass(args)))
        return

    sys.path.insert(0, HERE)
    from latency_proxy import start_proxy  # type: ignore[import-not-found]
    from s3server import s3_server  # type: ignore[import-not-found]

    trees = {}  # --before PATH, or NAME=PATH,NAME=PATH: earlier trees; "after": this checkout
    for k, item in enumerate(filter(None, (args.before or "").split(","))):
        name, _, path = item.rpartition("=")
        trees[name or ("before" if k == 0 else f"before{k + 1}")] = path
    trees["after"] = REPO
    per_epoch = args.rows // args.batch
    with tempfile.TemporaryDirectory(prefix="bench-table-windows-") as tmp, s3_server(args.server) as server:
        paths = make_table(os.path.join(tmp, "t"), args.rows, args.files, args.group)
        client = server.client()
        for p in paths:
            client.upload_file(p, server.bucket, f"table/{os.path.basename(p)}")
        with start_proxy(server.endpoint, args.latency) as (endpoint, _):
            print(f"# {args.rows} rows x 8 columns in {args.files} files, row groups of {args.group}; batch {args.batch}, 0 workers")
            print(f"# {args.epochs} windows a pass ({per_epoch} batches each); {server.version()} behind {args.latency * 1000:.0f} ms per request")
            print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}")
            results: dict[tuple[str, str], list[dict]] = {}
            loads = []
            for _ in range(args.repeats):
                for shuffled in args.shuffled.split(","):
                    for name, tree in trees.items():
                        env = dict(os.environ, PYTHONPATH=tree)
                        argv = [sys.executable, os.path.abspath(__file__), "--pass", "--url", f"s3://{server.bucket}/table/", "--endpoint", endpoint]
                        argv += ["--rows", str(args.rows), "--batch", str(args.batch), "--epochs", str(args.epochs), "--shuffled", shuffled]
                        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
                        if done.returncode:
                            raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
                        got = json.loads(done.stdout.strip().splitlines()[-1])
                        per_group = args.group // args.batch if args.group % args.batch == 0 and (args.rows // args.files) % args.group == 0 else 0
                        results.setdefault((shuffled, name), []).append(summarise(got, per_epoch, args.epochs, per_group))
                        loads.append(os.getloadavg()[0])
            print(f"# load average during the runs: {min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f})")
            print(f"{'shuffle':7} {'tree':8} {'M rows/s':>8} {'M rows/CPU-s':>12} {'first batch s':>13} {'window wait s':>13} ", end="")
            print(f"{'gap inside s':>12} {'group gap s':>11} {'GETs':>5} {'MB read':>8} {'peak MB':>7}")
            for (shuffled, name), runs in sorted(results.items()):

                def med(key: str, runs=runs) -> float:
                    return statistics.median(r[key] for r in runs)

                print(
                    f"{'yes' if shuffled == '1' else 'no':7} {name:8} {med('rows_per_s'):8.2f} {med('rows_per_cpu_s'):12.2f} {med('first'):13.3f} "
                    f"{med('window_wait'):13.3f} {med('inside_gap'):12.4f} {med('group_gap'):11.3f} {med('requests'):5.0f} "
                    f"{med('bytes_read') / 1e6:8.1f} {med('peak') / 1e6:7.1f}"
                )
                waits = ", ".join(f"{r['window_wait']:.3f}" for r in runs)
                rates = ", ".join(f"{r['rows_per_s']:.2f}" for r in runs)
                print(f"  runs: window wait {waits}; M rows/s {rates}")


if __name__ == "__main__":
    main()
