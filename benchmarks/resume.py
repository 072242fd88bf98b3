"""resume: seconds from a fresh ``ShardStream`` and loader with a state loaded to its first batch,
as a restarted job waits (from bench_resume.py). Rank 0 of 2, batch 64, ``Shuffle(1000)``; the
state saved at ``--at`` fractions of the epoch (0 and 0.9 by default) with the same topology, or
with ``--elastic`` saved at world size 2 and loaded at world size 3. A resume at 90% must not
read the 90%: it reads each worker's buffered samples back and the unread rest.

The data: ``--samples`` small samples (500-1500 bytes), shards of ``--per-shard``, in the
workdir (``--source local``) or on a server (``--source s3``, as the s3 workload's). Peers: ``shardstream``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

UNIT = "s"
PEERS = ("shardstream",)
RATE = "first_batch_s"


def add_arguments(p) -> None:
    from benchmarks.s3 import add_server_arguments

    p.add_argument("--source", choices=("local", "s3"), default="local")
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--per-shard", type=int, default=1000)
    p.add_argument("--at", default="0,0.9", help="fractions of the epoch the state is saved at")
    p.add_argument("--elastic", action="store_true", help="saved at world size 2, loaded at 3")
    p.set_defaults(workers=[2])
    add_server_arguments(p)


@contextlib.contextmanager
def context(args, runner):
    from benchmarks.first_batch import context as first_context

    with first_context(args, runner) as extra:
        yield extra


def write(url: str, endpoint: str | None, n: int, per_shard: int) -> None:
    import numpy as np

    from shardstream import ShardWriter

    rng = np.random.default_rng(0)
    options = {"endpoint_url": endpoint} if endpoint else None
    with ShardWriter(url, max_count=per_shard, storage_options=options, overwrite=True) as w:
        for i in range(n):
            w.write_encoded(f"{i:08d}", {"bin": rng.bytes(int(rng.integers(500, 1500))), "cls": b"1"})


def prepare(args, runner, peers: list[str], endpoint: str | None = None, writer_endpoint: str | None = None) -> list[dict]:
    if endpoint:
        url = "s3://bench/resume"
        write(url, writer_endpoint, args.samples, args.per_shard)
    else:
        url = os.path.join(args.workdir, f"resume-{args.samples}-{args.per_shard}")
        if not os.path.exists(os.path.join(url, "index.json")):
            write(url, None, args.samples, args.per_shard)
    base = {"source": args.source, "samples": args.samples, "elastic": args.elastic, "runtime": args.runtime}
    return [{"workers": w, "at": float(at), **base, "_url": url, "_endpoint": endpoint} for w in args.workers for at in args.at.split(",")]


def measure(config: dict) -> dict:
    import time

    from benchmarks.harness import cpu_seconds, loader_options
    from shardstream import ShardStream, Shuffle, Store, World, make_loader

    store = Store(options={"endpoint_url": config["_endpoint"]} if config["_endpoint"] else None)
    settings: dict[str, Any] = dict(batch_size=64, seed=1, shuffle=Shuffle(1000), store=store)
    workers = config["workers"]
    saved = ShardStream(config["_url"], world=World(0, 2), **settings)
    make_loader(saved, num_workers=workers, **loader_options(config))
    state = saved.state_dict(batches=int(config["at"] * len(saved)), num_workers=workers)
    t, c = time.perf_counter(), cpu_seconds()
    ds = ShardStream(config["_url"], world=World(0, 3 if config["elastic"] else 2), **settings)
    loader = make_loader(ds, num_workers=workers, **loader_options(config))
    loader.load_state_dict(state)
    batch = next(iter(loader))
    seconds = time.perf_counter() - t
    return {"items": len(batch["__key__"]), "seconds": seconds, "cpu_seconds": cpu_seconds() - c, "first_batch_s": seconds}
