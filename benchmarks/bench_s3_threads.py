"""Where a DataLoader worker's CPU goes when large samples stream from S3, thread by thread: the
main process, each worker's Python threads (its main thread: parse, batch, hand-off), obstore's
tokio threads, and the threads that ended during the pass (the pass's read-ahead threads: each
pass starts its own), from /proc; several source trees interleaved.

    OMP_NUM_THREADS=1 python benchmarks/bench_s3_threads.py --trees . /tmp/base [--rounds 3] [--repeats 3]

Each round runs every tree in turn, each in a fresh process (``--child``) with that tree first on
``PYTHONPATH`` (its workers too): s3rver started, ``--samples`` 4 MB float32 ``.npy`` samples
written in 16 MB shards, one loader (``--workers``, batch 4, undecoded, ``read_size`` 17 MiB as in
bench_s3_cpu.py) warmed by one pass, then ``--repeats`` passes measured. A row is one pass: CPU
milliseconds per MB of the main process, of the workers' live Python threads (Linux names them
all after the process: ``pt_data_worker``), of their tokio threads (``tokio-rt-worker``), and of
their threads that ended during the pass (the process's CPU less its live threads'), and the
workers' minor page faults per MB. The table gives medians per tree. The benchmark's own helpers
(s3server.py) come from this file's directory whatever the tree.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TICK = os.sysconf("SC_CLK_TCK")
MB = 1e6


def _stat(path: str) -> list[str] | None:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:  # ended while read
        return None
    return [text[text.index("(") + 1 : text.rindex(")")], *text.rsplit(")", 1)[1].split()]


def threads(pid: int) -> collections.Counter:
    """CPU seconds of a process's live threads by name, ``~process`` (all its threads, ended ones
    included) and ``~faults`` (its minor page faults)."""
    out: collections.Counter = collections.Counter()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        fields = _stat(f"/proc/{pid}/task/{tid}/stat")
        if fields is not None:
            out[fields[0]] += (int(fields[12]) + int(fields[13])) / TICK
    fields = _stat(f"/proc/{pid}/stat")
    if fields is not None:
        out["~process"] = (int(fields[12]) + int(fields[13])) / TICK
        out["~faults"] = int(fields[8])
    return out


def descendants(pid: int, skip: int) -> list[int]:
    """Every process below ``pid`` but ``skip``'s subtree."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat(f"/proc/{name}/stat")
            if fields is not None:
                parents[int(fields[2])].append(int(name))
    out, todo = [], [p for p in parents[pid] if p != skip]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents[p]
    return out


def child(args: argparse.Namespace) -> None:
    import numpy as np

    sys.path.insert(0, HERE)
    from s3server import s3_server  # type: ignore[import-not-found]

    from shardstream import Read, ShardStream, ShardWriter, StorageConfig, Store, World, make_loader

    with s3_server("s3rver") as server:
        with ShardWriter("s3://bench/many", max_size=16_000_000, storage_options=server.storage_options) as w:
            for i in range(args.samples):
                w.write({"__key__": f"{i:06d}", "npy": np.full((1024, 1024), i, dtype=np.float32)})
        admin = server.client()
        total = sum(o["Size"] for o in admin.list_objects_v2(Bucket="bench", Prefix="many/")["Contents"] if o["Key"].endswith(".tar"))
        store = Store(options=server.storage_options, read=Read(read_size=17 << 20), config=StorageConfig())
        ds = ShardStream("s3://bench/many", batch_size=4, shuffle=False, decode=False, world=World(0, 1), store=store)
        loader = make_loader(ds, num_workers=args.workers, pin_memory=False, log_interval=None)
        assert sum(len(b["__key__"]) for b in loader) == args.samples  # warm-up: workers, clients, the server's first reads
        me = os.getpid()

        def look() -> dict[int | str, collections.Counter]:
            seen: dict[int | str, collections.Counter] = {"main": threads(me)}
            for pid in descendants(me, server.pid):
                seen[pid] = threads(pid)
            return seen

        for _ in range(args.repeats):
            before, began = look(), time.perf_counter()
            got = sum(len(b["__key__"]) for b in loader)
            wall, after = time.perf_counter() - began, look()
            assert got == args.samples, got
            row = collections.Counter({"MB/s": total / MB / wall})
            for key, now in after.items():
                then = before.get(key, collections.Counter())
                diff = {name: now[name] - then[name] for name in now}
                live = sum(v for name, v in diff.items() if not name.startswith("~"))
                if key == "main":
                    row["main"] += diff.get("~process", live)
                    continue
                row["workers, Python threads"] += sum(v for name, v in diff.items() if not name.startswith(("~", "tokio")))
                row["workers, tokio threads"] += sum(v for name, v in diff.items() if name.startswith("tokio"))
                row["workers, ended threads"] += diff.get("~process", live) - live
                row["workers' faults"] += diff.get("~faults", 0)
            out = {k: (v if k == "MB/s" else v / (total / MB) * (1 if k == "workers' faults" else 1e3)) for k, v in row.items()}
            out["load"] = os.getloadavg()[0]
            print("ROW " + json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=[os.path.dirname(HERE)], help="source trees (each holds shardstream/), run in turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="passes measured per run")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    print(f"1-minute load {os.getloadavg()[0]:.2f} at the start")
    for _ in range(args.rounds):
        for tree in args.trees:
            tree_abs = os.path.abspath(tree)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree_abs, HERE]))
            command = [sys.executable, os.path.abspath(__file__), "--child", "--repeats", str(args.repeats), "--samples", str(args.samples)]
            command += ["--workers", str(args.workers)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
            if done.returncode:
                sys.exit(f"{tree}: exit {done.returncode}\n{done.stderr[-3000:]}")
            for line in done.stdout.splitlines():
                if line.startswith("ROW "):
                    rows[tree].append(json.loads(line[4:]))
                    print(tree, line[4:], flush=True)
    print(f"1-minute load {os.getloadavg()[0]:.2f} at the end; medians of {args.rounds} x {args.repeats} passes per tree")
    keys = ["MB/s", "main", "workers, Python threads", "workers, tokio threads", "workers, ended threads", "workers' faults"]
    print("| tree | " + " | ".join(k if k in ("MB/s", "workers' faults") else f"{k} ms/MB" for k in keys) + " | reader's total ms/MB |")
    print("|---" * (len(keys) + 2) + "|")
    for tree, seen in rows.items():
        medians = [statistics.median(r.get(k, 0.0) for r in seen) for k in keys]
        total = statistics.median(sum(r.get(k, 0.0) for k in keys[1:5]) for r in seen)
        cells = [f"{medians[0]:,.0f}", *(f"{m:.2f}" for m in medians[1:5]), f"{medians[5]:.0f}"]
        print(f"| {tree} | " + " | ".join(cells) + f" | {total:.2f} |")


if __name__ == "__main__":
    main()
