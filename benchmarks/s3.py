"""s3: large samples (``--mb`` MiB ``.npy``, read undecoded, batch 4) from an S3-compatible server
on 127.0.0.1, MB per second (from bench_s3.py, bench_s3_latency.py).

``--server moto`` (default: moto's server from this venv; it copies a whole object for every
ranged GET, so it is no stand-in for a real store) or ``s3rver`` / ``seaweedfs`` (real servers,
``benchmarks/install_s3server.sh KIND``); ``--latency S`` puts the latency proxy
(``benchmarks/latency_proxy.py``) in front, S seconds before each request. Peers:
``shardstream`` (``ShardStream(s3://...)`` through ``make_loader``), ``boto3`` and ``obstore``
(each shard's whole object read to its end in 1 MiB pieces, the shards dealt to torch
``DataLoader`` workers: the reference streams).
"""

from __future__ import annotations

import contextlib
import os

UNIT = "MB/s"
PEERS = ("shardstream", "boto3", "obstore")
BUCKET = "bench"


def add_arguments(p) -> None:
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--mb", type=float, default=4.0, help="MiB per sample")
    p.add_argument("--per-shard", type=int, default=8)
    add_server_arguments(p)


def add_server_arguments(p) -> None:
    p.add_argument("--server", choices=("moto", "s3rver", "seaweedfs"), default="moto")
    p.add_argument("--latency", type=float, default=0.0, help="seconds the proxy waits before each request (0: no proxy)")


@contextlib.contextmanager
def server_context(args, runner):
    """A server (its credentials in this process's environment, which every child inherits) and,
    with ``--latency``, the proxy in front: yields ``{"endpoint": URL}`` for ``prepare``."""
    from benchmarks.latency_proxy import start_proxy
    from benchmarks.s3server import s3_server

    with s3_server(args.server, bucket=BUCKET) as server:
        if args.latency > 0:
            with start_proxy(server.endpoint, args.latency) as (url, _):
                yield {"endpoint": url, "writer_endpoint": server.endpoint}
        else:
            yield {"endpoint": server.endpoint, "writer_endpoint": server.endpoint}


context = server_context


def write_npy(url: str, endpoint: str | None, n: int, mb: float, per_shard: int) -> None:
    import io

    import numpy as np

    from shardstream import ShardWriter

    base = np.random.default_rng(0).standard_normal(int(mb * (1 << 20)) // 4, dtype=np.float32)
    with ShardWriter(
        url, max_count=per_shard, max_size=1 << 40, storage_options={"endpoint_url": endpoint} if endpoint else None, overwrite=True
    ) as w:
        for i in range(n):
            buf = io.BytesIO()
            np.save(buf, base + np.float32(i))
            w.write_encoded(f"{i:08d}", {"npy": buf.getvalue(), "cls": str(i % 10).encode()})


def prepare(args, runner, peers: list[str], endpoint: str, writer_endpoint: str) -> list[dict]:
    url = f"s3://{BUCKET}/large"
    write_npy(url, writer_endpoint, args.samples, args.mb, args.per_shard)
    from shardstream import load_manifest

    keys = [f"large/{s.path}" for s in load_manifest(url, storage_options={"endpoint_url": writer_endpoint}).shards]  # for the peers' venvs
    base = {"samples": args.samples, "mb": args.mb, "server": args.server, "latency": args.latency, "runtime": args.runtime}
    return [{"workers": w, **base, "_url": url, "_endpoint": endpoint, "_keys": keys} for w in args.workers]


class _Objects:
    """Each of a worker's share of the shard objects read to its end, in 1 MiB pieces."""

    def __init__(self, kind: str, endpoint: str, keys: list[str]):
        self.kind, self.endpoint, self.keys = kind, endpoint, keys

    def __iter__(self):
        import torch

        info = torch.utils.data.get_worker_info()
        mine = self.keys[info.id :: info.num_workers] if info else self.keys
        env = os.environ
        if self.kind == "boto3":
            import boto3

            client = boto3.client("s3", endpoint_url=self.endpoint, region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"))
            for key in mine:
                body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
                while chunk := body.read(1 << 20):
                    yield len(chunk)
        else:
            import obstore

            from benchmarks.s3server import obstore_store

            store = obstore_store(self.endpoint, BUCKET, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
            for key in mine:
                for chunk in obstore.get(store, key).stream(min_chunk_size=1 << 20):
                    yield len(chunk)


def measure(config: dict) -> dict:
    import torch

    from benchmarks.harness import timed_pass

    peer, workers, url, endpoint = config["peer"], config["workers"], config["_url"], config["_endpoint"]
    if peer == "shardstream":
        from benchmarks.harness import loader_options
        from shardstream import ShardStream, Store, World, make_loader

        def make():
            ds = ShardStream(url, batch_size=4, shuffle=False, decode=False, world=World(0, 1), store=Store(options={"endpoint_url": endpoint}))
            return make_loader(ds, num_workers=workers, **loader_options(config))

        result = timed_pass(make, lambda b: sum(len(x) for x in b["npy"]))
    else:
        objects = type("Objects", (_Objects, torch.utils.data.IterableDataset), {})(peer, endpoint, config["_keys"])
        result = timed_pass(lambda: torch.utils.data.DataLoader(objects, batch_size=None, num_workers=workers), lambda n: n)
    result["rate"] = result["items"] / result["seconds"] / 1e6
    return result
