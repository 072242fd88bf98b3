"""Where the CPU goes when large samples stream from S3: CPU milliseconds per MB of the main
process, of the reader's other processes (DataLoader workers, a reference's pool) and of the S3
server, for shardstream with 0 and 2 workers and for boto3 ``get_object`` and ``obstore.get``
streams of the same objects; no latency (the readers talk to the server directly).

    OMP_NUM_THREADS=1 python benchmarks/bench_s3_cpu.py --server s3rver [--samples 200] [--repeats 3]

On a 2-core machine every process shares the same two cores, so a reader's rate is bounded by
2 / (its CPU per MB + the server's CPU per MB). 4 MB float32 ``.npy`` samples, undecoded, batch 4,
16 MB shards. Each loader and pool is made once, before the clock, and kept (persistent workers,
the default; the pools keep their clients), so a row is the steady state of a pass; the row with
8 samples makes a new loader each run and shows the fixed cost of starting 2 workers. The other
processes' CPU is read from /proc for every process below this one (the forkserver's children
included, live or reaped), less the server's, and so are their minor page faults (fresh memory
mapped and zeroed on first touch: the cost that dominates large samples). Medians of
``--repeats`` interleaved runs. With
``--s3fs`` also shardstream's s3fs path (``StorageConfig(s3_client="s3fs")``; obstore is the default).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # the repository first on sys.path
from common import load_average, stream_objects, wait_for_quiet
from s3server import KINDS, s3_server  # type: ignore[import-not-found]

TICK = os.sysconf("SC_CLK_TCK")


def processes() -> dict[int, tuple[int, float, int]]:
    """Every process's (parent PID, user + system CPU seconds of it and its reaped children, minor
    page faults of it and its reaped children)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended while listed
            continue
        out[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / TICK, int(fields[7]) + int(fields[8]))
    return out


def tree_cpu(root: int, server: int) -> tuple[float, float, int]:
    """CPU seconds of every process below ``root`` (not ``root`` itself), with the reaped children
    of each counted in its parent, from one look at /proc: (all but ``server``'s subtree, ``server``'s,
    the minor page faults of all but ``server``'s subtree)."""
    procs = processes()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)

    def below(top: list[int], field: int = 1) -> float:
        total, todo = 0.0, list(top)
        while todo:
            pid = todo.pop()
            total += procs[pid][field]
            todo.extend(kids.get(pid, []))
        return total

    others = [p for p in kids.get(root, []) if p != server]
    return below(others), below([server] if server in procs else []), int(below(others, 2))


def own_cpu() -> tuple[float, int]:
    """This process's CPU seconds and minor page faults."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK, int(fields[7])


def main() -> None:
    from shardstream import Read, ShardStream, ShardWriter, StorageConfig, Store, World, make_loader

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=KINDS, default="s3rver", help="the S3-compatible server (benchmarks/s3server.py)")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--s3fs", action="store_true", help="add the s3fs-path rows (StorageConfig(s3_client='s3fs'))")
    parser.add_argument("--max-load", type=float, default=3.0, help="wait for the 1-minute load to fall below this")
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for it at most")
    args = parser.parse_args()
    # forkserver children (the reference pools, shardstream's workers) import from here and the repo
    os.environ["PYTHONPATH"] = os.pathsep.join([common.HERE, common.REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
    s3fs_rows = args.s3fs
    with s3_server(args.server) as server:
        url, creds = server.endpoint, (server.bucket, server.access_key, server.secret_key)
        for prefix, n in (("many", args.samples), ("few", 8)):
            with ShardWriter(f"s3://bench/{prefix}", max_size=16_000_000, storage_options=server.storage_options) as w:
                for i in range(n):
                    w.write({"__key__": f"{i:06d}", "npy": np.full((1024, 1024), i, dtype=np.float32)})
        admin = server.client()

        def keys_of(prefix: str) -> list[str]:
            listed = admin.list_objects_v2(Bucket="bench", Prefix=f"{prefix}/")["Contents"]
            return sorted(o["Key"] for o in listed if o["Key"].endswith(".tar"))

        keys = keys_of("many")
        total = sum(admin.head_object(Bucket="bench", Key=k)["ContentLength"] for k in keys)
        few_total = sum(admin.head_object(Bucket="bench", Key=k)["ContentLength"] for k in keys_of("few"))
        ctx = multiprocessing.get_context("forkserver")
        pools = {kind: ProcessPoolExecutor(2, mp_context=ctx) for kind in ("boto3", "obstore")}

        def stream(prefix: str, direct: bool) -> ShardStream:
            config = StorageConfig() if direct else StorageConfig(s3_client="s3fs")
            read = Read(read_size=17 << 20)  # one request per 16 MB shard
            store = Store(options=server.storage_options, read=read, config=config)
            return ShardStream(f"s3://bench/{prefix}", batch_size=4, shuffle=False, decode=False, world=World(0, 1), store=store)

        def ours(workers: int, direct: bool = True):
            loader = make_loader(stream("many", direct), num_workers=workers, pin_memory=False, log_interval=None)
            return lambda: sum(len(b["__key__"]) for b in loader)

        def fresh_two_workers() -> int:
            loader = make_loader(stream("few", True), num_workers=2, pin_memory=False, log_interval=None)
            got = sum(len(b["__key__"]) for b in loader)
            del loader  # its workers end here, inside the measured run
            return got

        def one_stream(kind: str):
            def run() -> int:
                assert stream_objects(kind, url, *creds, keys) == total
                return args.samples

            return run

        def two_streams(kind: str):
            def run() -> int:
                futures = [pools[kind].submit(stream_objects, kind, url, *creds, half) for half in (keys[0::2], keys[1::2])]
                assert sum(f.result() for f in futures) == total
                return args.samples

            return run

        rows = [
            ("boto3 get_object, 1 stream", args.samples, total, one_stream("boto3")),
            ("obstore get, 1 stream", args.samples, total, one_stream("obstore")),
            ("boto3 get_object, 2 processes", args.samples, total, two_streams("boto3")),
            ("obstore get, 2 processes", args.samples, total, two_streams("obstore")),
            ("shardstream, 0 workers", args.samples, total, ours(0)),
            ("shardstream, 2 workers", args.samples, total, ours(2)),
            ("shardstream, 2 workers new per run, 8 samples (start-up)", 8, few_total, fresh_two_workers),
        ]
        if s3fs_rows:
            rows += [
                ("shardstream, 0 workers, GETs through s3fs", args.samples, total, ours(0, direct=False)),
                ("shardstream, 2 workers, GETs through s3fs", args.samples, total, ours(2, direct=False)),
            ]
        for _, _, _, fn in rows:  # warm-up: clients, pools, workers, the server's first reads
            fn()
        load, waited = wait_for_quiet(args.max_load, args.wait)
        print(f"1-minute load {load:.2f} at the start (waited {waited:.0f} s for < {args.max_load}); {server.version()}")
        me = os.getpid()
        seen: dict[str, list[tuple[float, ...]]] = {name: [] for name, *_ in rows}
        for _ in range(args.repeats):
            for name, n, size, fn in rows:
                (kids0, server0, kf0), (own0, of0) = tree_cpu(me, server.pid), own_cpu()
                t = time.perf_counter()
                got = fn()
                wall = time.perf_counter() - t
                (kids1, server1, kf1), (own1, of1) = tree_cpu(me, server.pid), own_cpu()
                assert got == n, (name, got, n)
                mb = size / 1e6
                ms = (mb / wall, (own1 - own0) / mb * 1e3, (kids1 - kids0) / mb * 1e3, (server1 - server0) / mb * 1e3)
                seen[name].append((*ms, (of1 - of0) / mb, (kf1 - kf0) / mb))
        for pool in pools.values():
            pool.shutdown()
        print(f"medians of {args.repeats} interleaved runs, {total / 1e6:.0f} MB per run (8 samples: {few_total / 1e6:.0f} MB)")
        print(f"1-minute load {load_average():.2f} at the end")
        print("| reader | MB/s | main CPU ms/MB | other processes ms/MB | reader's total ms/MB | server ms/MB | page faults per MB, main / others |")
        print("|---|---|---|---|---|---|---|")
        for name, values in seen.items():
            rate, main_ms, kids_ms, server_ms, main_faults, kids_faults = (statistics.median(v[i] for v in values) for i in range(6))
            both = statistics.median(v[1] + v[2] for v in values)
            print(f"| {name} | {rate:,.0f} | {main_ms:.2f} | {kids_ms:.2f} | {both:.2f} | {server_ms:.2f} | {main_faults:.0f} / {kids_faults:.0f} |")
        print('("other processes": DataLoader workers, or the reference\'s two processes; the server is left out of them;')
        print(" a minor page fault is a page of fresh memory mapped and zeroed on first touch)")


if __name__ == "__main__":
    main()
