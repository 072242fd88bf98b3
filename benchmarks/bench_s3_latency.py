"""S3 with and without latency, on a real S3-compatible server: shardstream against plain
``get_object`` streams (boto3) and ``obstore.get`` streams of the same objects; the time to the
first batch; the GET requests each reader makes.

    OMP_NUM_THREADS=1 python benchmarks/bench_s3_latency.py --server s3rver [--latency 0.03 0] \\
        [--shards 8] [--per-shard 8] [--repeats 5] [--first-batch 5] [--json out.json]

The server (``benchmarks/s3server.py``: s3rver, SeaweedFS or moto, its own process, 127.0.0.1)
holds ``--shards`` shards of ``--per-shard`` 4 MiB float32 ``.npy`` samples (32 MiB shards by
default), read undecoded, in manifest order, batch 4. For each ``--latency`` (seconds) above 0 the
readers go through ``benchmarks/latency_proxy.py`` (its own process), which waits that long before
forwarding each request and counts them; at 0 they talk to the server directly. The contenders,
interleaved, medians of ``--repeats`` passes after one warm-up pass each:

- boto3, 1 stream: one client (made before the clock starts) reads every object in turn with
  ``get_object``, its body in 1 MiB pieces;
- obstore, 1 stream: the same with one ``S3Store`` and ``obstore.get(...).stream()``;
- boto3 and obstore, 2 streams: two processes (a persistent forkserver pool, each with its own
  client kept across passes), half the objects each;
- shardstream with 0 and 2 workers: one ``make_loader`` made before the clock (its workers are
  persistent, the default), ``Store(options={"endpoint_url": ...})`` with the defaults; with
  ``--s3fs`` also the s3fs path (``StorageConfig(s3_client="s3fs")``; obstore is the default).

The goals of issue 35: 0 workers >= one obstore stream, 2 workers >= 0.95 of two obstore streams
(with and without latency), first batch <= 0.3 s at 2 workers at 30 ms. The first batch is a fresh
``ShardStream`` (its manifest read) and loader up to its first batch, after a warm-up. The script
waits for a quiet machine (``--max-load``, up to ``--wait`` seconds) and prints the load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from importlib.metadata import version

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # the repository first on sys.path
from common import load_average, stream_objects, wait_for_quiet
from latency_proxy import proxy_counts, start_proxy  # type: ignore[import-not-found]
from s3server import KINDS, s3_server  # type: ignore[import-not-found]

ONE = {"boto3": "boto3 get_object, 1 stream", "obstore": "obstore get, 1 stream"}
TWO = {"boto3": "boto3 get_object, 2 streams", "obstore": "obstore get, 2 streams"}


def git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", common.REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def main() -> None:
    from shardstream import ShardStream, ShardWriter, StorageConfig, Store, World, make_loader

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=KINDS, default="s3rver", help="the S3-compatible server (benchmarks/s3server.py)")
    parser.add_argument("--latency", type=float, nargs="+", default=[0.03, 0.0], help="seconds added before each request; 0: no proxy")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--per-shard", type=int, default=8, help="4 MiB samples per shard")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--first-batch", type=int, default=5, help="times to the first batch, per worker count")
    parser.add_argument("--s3fs", action="store_true", help="add the s3fs-path rows (StorageConfig(s3_client='s3fs'))")
    parser.add_argument("--max-load", type=float, default=3.0, help="wait for the 1-minute load to fall below this")
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for it at most")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    # forkserver children (the reference pools, shardstream's workers) import from here and the repo
    os.environ["PYTHONPATH"] = os.pathsep.join([common.HERE, common.REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
    n = args.shards * args.per_shard
    s3fs_rows = args.s3fs
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_rev(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in ("torch", "boto3", "obstore")},
        "args": vars(args),
        "latencies": {},
    }
    with s3_server(args.server) as server:
        results["server"] = server.version()
        options = server.storage_options
        with ShardWriter("s3://bench/lat", max_count=args.per_shard, max_size=1 << 40, storage_options=options) as w:
            for i in range(n):
                w.write({"__key__": f"{i:06d}", "npy": np.full((1024, 1024), i, dtype=np.float32)})
        admin = server.client()
        keys = sorted(o["Key"] for o in admin.list_objects_v2(Bucket="bench", Prefix="lat/")["Contents"] if o["Key"].endswith(".tar"))
        total = sum(admin.head_object(Bucket="bench", Key=k)["ContentLength"] for k in keys)
        halves = [keys[0::2], keys[1::2]]
        load, waited = wait_for_quiet(args.max_load, args.wait)
        results["load_at_start"], results["waited_s"] = load, round(waited)
        print(f"1-minute load {load:.2f} at the start (waited {waited:.0f} s for < {args.max_load})", flush=True)
        ctx = multiprocessing.get_context("forkserver")
        for latency in args.latency:
            with contextlib.ExitStack() as stack:
                url = stack.enter_context(start_proxy(server.endpoint, latency))[0] if latency > 0 else server.endpoint
                pools = {kind: stack.enter_context(ProcessPoolExecutor(2, mp_context=ctx)) for kind in ("boto3", "obstore")}
                creds = (server.bucket, server.access_key, server.secret_key)

                def one_stream(kind: str, client):
                    def run() -> int:
                        if kind == "boto3":
                            got = 0
                            for key in keys:
                                body = client.get_object(Bucket="bench", Key=key)["Body"]
                                while chunk := body.read(1 << 20):
                                    got += len(chunk)
                        else:
                            import obstore

                            got = sum(len(c) for key in keys for c in obstore.get(client, key).stream(min_chunk_size=1 << 20))
                        assert got == total, (kind, got, total)
                        return n

                    return run

                def two_streams(kind: str):
                    def run() -> int:
                        futures = [pools[kind].submit(stream_objects, kind, url, *creds, half) for half in halves]
                        assert sum(f.result() for f in futures) == total
                        return n

                    return run

                def stream(direct: bool = True) -> ShardStream:
                    config = StorageConfig() if direct else StorageConfig(s3_client="s3fs")
                    return ShardStream(
                        "s3://bench/lat",
                        batch_size=4,
                        shuffle=False,
                        decode=False,
                        world=World(0, 1),
                        store=Store(options={"endpoint_url": url}, config=config),
                    )

                def ours(workers: int, direct: bool = True):
                    loader = make_loader(stream(direct), num_workers=workers, pin_memory=False, log_interval=None)

                    def run() -> int:
                        return sum(len(b["__key__"]) for b in loader)

                    return run

                contenders = {
                    ONE["boto3"]: one_stream("boto3", server.client(url)),
                    ONE["obstore"]: one_stream("obstore", server.obstore(url)),
                    TWO["boto3"]: two_streams("boto3"),
                    TWO["obstore"]: two_streams("obstore"),
                    "shardstream, 0 workers": ours(0),
                    "shardstream, 2 workers": ours(2),
                }
                if s3fs_rows:
                    contenders["shardstream, 0 workers, s3fs path"] = ours(0, direct=False)
                    contenders["shardstream, 2 workers, s3fs path"] = ours(2, direct=False)
                for fn in contenders.values():  # warm-up: clients, pools, workers, the server's first reads
                    fn()
                times: dict[str, list[float]] = {name: [] for name in contenders}
                gets: dict[str, int | None] = {}
                for _ in range(args.repeats):
                    for name, fn in contenders.items():
                        before = proxy_counts(url).get("GET", 0) if latency > 0 else 0
                        t = time.perf_counter()
                        got = fn()
                        times[name].append(time.perf_counter() - t)
                        gets[name] = proxy_counts(url).get("GET", 0) - before if latency > 0 else None
                        assert got == n, (name, got, n)
                del contenders  # the persistent workers end before the first-batch runs start theirs

                def first_batch(workers: int, direct: bool = True) -> float:
                    t = time.perf_counter()  # the manifest's read included
                    it = iter(make_loader(stream(direct), num_workers=workers, pin_memory=False, log_interval=None))
                    next(it)
                    took = time.perf_counter() - t
                    del it
                    return took

                firsts: dict[str, list[float]] = {}
                kinds = [(0, True), (2, True)] + ([(0, False), (2, False)] if s3fs_rows else [])
                first_batch(0)  # warm-up: the botocore session, the forkserver
                first_batch(2)
                for _ in range(args.first_batch):
                    for workers, direct in kinds:
                        name = f"{workers} workers" + ("" if direct else ", s3fs path")
                        firsts.setdefault(name, []).append(first_batch(workers, direct))
            medians = {name: statistics.median(values) for name, values in times.items()}
            results["latencies"][str(latency)] = {
                "MB/s": {name: total / med / 1e6 for name, med in medians.items()},
                "runs MB/s": {name: [round(total / v / 1e6) for v in values] for name, values in times.items()},
                "GETs per pass": gets,
                "first batch s": {name: statistics.median(values) for name, values in firsts.items()},
            }
            report(results, latency, medians, gets, firsts, total, len(keys), args)
    results["load_at_end"] = load_average()
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    print(f"\n1-minute load {results['load_at_end']:.2f} at the end; {results['server']}, commit {results['commit']}, {versions}")
    goals(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def report(results: dict, latency: float, medians: dict, gets: dict, firsts: dict, total: int, shards: int, args) -> None:
    where = f"{latency * 1e3:.0f} ms added per request (latency_proxy.py)" if latency > 0 else "no latency (no proxy)"
    size = f"{shards} shards of {args.per_shard} x 4 MiB ({total / 1e6:.0f} MB)"
    print(f"\n{size} on {results['server']}, {where}; medians of {args.repeats} interleaved passes")
    print("| reader | MB/s | GETs per pass | vs boto3 (same streams) | vs obstore (same streams) |")
    print("|---|---|---|---|---|")
    for name, med in medians.items():
        two = "2 workers" in name or "2 streams" in name
        ref = TWO if two else ONE
        vs = " | ".join(f"{medians[ref[k]] / med:.2f}" for k in ("boto3", "obstore"))
        print(f"| {name} | {total / med / 1e6:,.0f} | {gets[name] if gets[name] is not None else '-'} | {vs} |")
    print(f"\ntime to the first batch (batch 4 of 4 MiB; medians of {args.first_batch})")
    print("| loader | seconds |")
    print("|---|---|")
    for name, values in firsts.items():
        print(f"| {name} | {statistics.median(values):.3f} |")


def goals(results: dict) -> None:
    """Issue 35's goals against this run's figures."""
    print("\ngoals (issue 35)")
    for latency, r in results["latencies"].items():
        rate = r["MB/s"]
        zero = rate["shardstream, 0 workers"] / rate[ONE["obstore"]]
        two = rate["shardstream, 2 workers"] / rate[TWO["obstore"]]
        at = f"{float(latency) * 1e3:.0f} ms"
        print(f"- {at}: 0 workers / one obstore stream = {zero:.2f} (goal >= 1): {'met' if zero >= 1 else 'MISSED'}")
        print(f"- {at}: 2 workers / two obstore streams = {two:.2f} (goal >= 0.95): {'met' if two >= 0.95 else 'MISSED'}")
        if abs(float(latency) - 0.03) < 1e-9:
            first = r["first batch s"]["2 workers"]
            print(f"- {at}: first batch at 2 workers = {first:.3f} s (goal <= 0.3 s): {'met' if first <= 0.3 else 'MISSED'}")


if __name__ == "__main__":
    main()
