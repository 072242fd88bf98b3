"""Where the first batch from S3 waits, stage by stage: timestamps from every process (the main
one and each DataLoader worker), for trees side by side.

    OMP_NUM_THREADS=1 python benchmarks/trace_first_batch.py [--trees base=/tmp/base,new=.] \\
        [--rounds 5] [--loaders 3] [--latency 0.03]

The server and dataset are ``bench_first_batch.py``'s (s3rver behind ``latency_proxy.py``, 8 shards
of 8 x 4 MiB ``.npy`` samples read undecoded, batch 4, 2 forkserver workers). Each round runs, for
every tree in turn, a fresh process (in that tree) that makes ``--loaders`` streams and loaders
one after the other up to their first batch, with a few functions wrapped to write a timestamp
(wall clock, shared by all processes) when first called and when they return: DataLoader's worker
loop, the loader's ``worker_init_fn``, the S3 client, each GET and its first piece, the pack step
and its ``WorkerPool.take``, and the main process's unpack. The wraps are made at import of this
script, which a forkserver imports too (``loader/mainpreload.py``), so its workers run them. The
report gives, per tree, the median and range of each stage of worker 0 (whose batch is the first)
over every loader but each process's first (cold: imports, the server's start), in ms after
``ShardStream(...)`` begins. Names a tree lacks are not wrapped (their stages are left out).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TRACE = os.environ.get("TRACE_FIRST_BATCH")
_seen: set[str] = set()


def mark(name: str) -> None:
    """Append ``pid name time`` to the trace file (once per name per loader)."""
    if TRACE is None or name in _seen:
        return
    _seen.add(name)
    fd = os.open(TRACE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{os.getpid()} {name} {time.time():.6f}\n".encode())
    finally:
        os.close(fd)


def _wrap(owner: Any, attr: str, name: str, end: bool = True) -> None:
    fn = getattr(owner, attr, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mark(name + ">")
        out = fn(*args, **kwargs)
        if end:
            mark(name + "<")
        return out

    setattr(owner, attr, wrapped)


def _instrument() -> None:
    import torch.utils.data._utils.worker as torch_worker

    import shardstream.loader as loader
    from shardstream.loader import segments, workers
    from shardstream.storage import objects

    _wrap(torch_worker, "_worker_loop", "worker loop", end=False)
    _wrap(workers.WorkerStart, "__call__", "worker_init_fn")
    _wrap(objects.Client, "_make", "S3 client")
    _wrap(objects.ObjectBody, "__init__", "GET sent", end=False)
    _wrap(segments.WorkerPool, "take", "segment")
    _wrap(loader.PackInWorker, "__call__", "pack")
    _wrap(loader, "unpack_batch", "unpack")
    first_piece = getattr(objects.ObjectBody, "_next", None)
    if first_piece is not None:

        def next_piece(self: Any, timeout: Any) -> Any:
            out = first_piece(self, timeout)
            mark("first piece")
            return out

        objects.ObjectBody._next = next_piece


if TRACE is not None:
    _instrument()


def one_process(endpoint: str, loaders: int) -> None:
    from shardstream import ShardStream, Store, World, make_loader

    for i in range(loaders):
        _seen.clear()
        mark(f"== loader {i}")
        mark("start")
        stream = ShardStream(
            "s3://bench/first", batch_size=4, shuffle=False, decode=False, world=World(0, 1), store=Store(options={"endpoint_url": endpoint})
        )
        loader = make_loader(stream, num_workers=2, pin_memory=False, log_interval=None, start_method="forkserver")
        it = iter(loader)
        next(it)
        mark("first batch")
        del it, loader, stream


STAGES = [
    ("worker 0 starts", "W", "worker loop>"),
    ("its worker_init_fn returns", "W", "worker_init_fn<"),
    ("its S3 client made", "W", "S3 client<"),
    ("its first GET sent", "W", "GET sent>"),
    ("its first piece", "W", "first piece"),
    ("its pack begins", "W", "pack>"),
    ("its pack ends", "W", "pack<"),
    ("the main process unpacks it", "M", "unpack>"),
    ("the main process has the first batch", "M", "first batch"),
]


def stages(path: str) -> list[dict[str, float]]:
    """{stage: ms after start} of worker 0 and the main process, per loader but the first."""
    blocks: list[list[tuple[str, str, float]]] = []
    with open(path) as f:
        for line in f:
            pid, rest = line.split(None, 1)
            name, t = rest.rsplit(None, 1)
            if name.startswith("=="):
                blocks.append([])
            elif blocks:
                blocks[-1].append((pid, name, float(t)))
    out = []
    for block in blocks[1:]:
        main = next(p for p, n, _ in block if n == "start")
        t0 = next(t for _, n, t in block if n == "start")
        first = {(p, n): (t - t0) * 1e3 for p, n, t in block}
        workers = sorted({p for p, _, _ in block if p != main}, key=lambda p: first.get((p, "worker loop>"), 1e9))
        if not workers:
            continue
        row = {}
        for label, who, name in STAGES:
            value = first.get((main if who == "M" else workers[0], name))
            if value is not None:
                row[label] = value
        took, given = first.get((workers[0], "segment>")), first.get((workers[0], "segment<"))
        if took is not None and given is not None:
            row["its first WorkerPool.take (ms it took)"] = given - took
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default=f"this={os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loaders", type=int, default=3, help="loaders per process (the first of each is left out)")
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--one", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_process(args.one, args.loaders)
        return
    import common  # the repository first on sys.path (not in --one: the tree measured goes first there)

    # isort: split
    import numpy as np
    from latency_proxy import start_proxy  # type: ignore[import-not-found]
    from s3server import s3_server  # type: ignore[import-not-found]

    from shardstream import ShardWriter

    trees = {name: os.path.abspath(path) for name, path in (item.split("=", 1) for item in args.trees.split(","))}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    with s3_server("s3rver") as server, contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        with ShardWriter("s3://bench/first", max_count=8, max_size=1 << 40, storage_options=server.storage_options) as w:
            for i in range(64):
                w.write({"__key__": f"{i:06d}", "npy": np.full((1024, 1024), i, dtype=np.float32)})
        endpoint = stack.enter_context(start_proxy(server.endpoint, args.latency))[0] if args.latency > 0 else server.endpoint
        loads = [common.load_average()]
        for r in range(args.rounds):
            for name, tree in trees.items():
                script = os.path.join(tree, "benchmarks", os.path.basename(__file__))
                script = script if os.path.exists(script) else os.path.abspath(__file__)
                path = os.path.join(tmp, f"{name}-{r}.log")
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.dirname(script)]), TRACE_FIRST_BATCH=path, OMP_NUM_THREADS="1")
                command = [sys.executable, script, "--one", endpoint, "--loaders", str(args.loaders)]
                done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    print(f"# {name}: failed\n{done.stderr[-2000:]}", flush=True)
                    continue
                rows[name].extend(stages(path))
            loads.append(common.load_average())
    print(f"\n{args.latency * 1e3:.0f} ms per request, 2 forkserver workers, 1-minute load {min(loads):.1f}-{max(loads):.1f}")
    print("ms after ShardStream(...) begins, median (range); " + ", ".join(f"{name}: {len(got)} loaders" for name, got in rows.items()))
    labels = [label for label, _, _ in STAGES] + ["its first WorkerPool.take (ms it took)"]
    print("| stage | " + " | ".join(trees) + " |")
    print("|---|" + "---|" * len(trees))
    for label in labels:
        cells = []
        for got in rows.values():
            values = [row[label] for row in got if label in row]
            cells.append(f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})" if values else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
