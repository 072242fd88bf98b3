"""first-batch: seconds from ``ShardStream(...)`` to the first batch in a fresh process: what a
training script waits for at its first pass (from bench_first_batch.py). Imports are not timed.

The data: ``--samples`` ``.npy`` samples of ``--mb`` MiB in shards of ``--per-shard``, read
undecoded, batch 4; ``--source local`` (the workdir) or ``s3`` (a server as the s3 workload's,
``--server``, ``--latency``). Peers: ``shardstream``.
"""

from __future__ import annotations

import contextlib
import os

UNIT = "s"
PEERS = ("shardstream",)
RATE = "first_batch_s"


def add_arguments(p) -> None:
    from benchmarks.s3 import add_server_arguments

    p.add_argument("--source", choices=("local", "s3"), default="local")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--mb", type=float, default=4.0)
    p.add_argument("--per-shard", type=int, default=8)
    add_server_arguments(p)


@contextlib.contextmanager
def context(args, runner):
    if args.source == "s3":
        from benchmarks.s3 import server_context

        with server_context(args, runner) as extra:
            yield extra
    else:
        yield {}


def prepare(args, runner, peers: list[str], endpoint: str | None = None, writer_endpoint: str | None = None) -> list[dict]:
    from benchmarks.s3 import write_npy

    if endpoint:
        url = "s3://bench/first"
        write_npy(url, writer_endpoint, args.samples, args.mb, args.per_shard)
    else:
        url = os.path.join(args.workdir, f"first-{args.samples}-{args.mb}")
        if not os.path.exists(os.path.join(url, "index.json")):
            write_npy(url, None, args.samples, args.mb, args.per_shard)
    base = {"source": args.source, "samples": args.samples, "mb": args.mb, "runtime": args.runtime}
    if endpoint:
        base.update(server=args.server, latency=args.latency)
    return [{"workers": w, **base, "_url": url, "_endpoint": endpoint} for w in args.workers]


def measure(config: dict) -> dict:
    import time

    import torch  # noqa: F401 - imports are not what this measures

    from benchmarks.harness import cpu_seconds, loader_options
    from shardstream import ShardStream, Store, World, make_loader

    options = {"endpoint_url": config["_endpoint"]} if config["_endpoint"] else None
    t, c = time.perf_counter(), cpu_seconds()
    ds = ShardStream(config["_url"], batch_size=4, shuffle=False, decode=False, world=World(0, 1), store=Store(options=options))
    loader = make_loader(ds, num_workers=config["workers"], **loader_options(config))
    batch = next(iter(loader))
    seconds = time.perf_counter() - t
    return {"items": len(batch["npy"]), "seconds": seconds, "cpu_seconds": cpu_seconds() - c, "first_batch_s": seconds}
