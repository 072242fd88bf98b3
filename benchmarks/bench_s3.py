"""S3 read throughput: shardstream from a moto server on 127.0.0.1 versus (a) plain boto3 GETs of
the same objects from the same server and (b) webdataset reading the same shards through its own
remote path (presigned http URLs, read with curl); plus the time to the first batch with a 10,000-shard
manifest.

    OMP_NUM_THREADS=1 python benchmarks/bench_s3.py [--repeats 3]

The moto server runs as a separate process (started and stopped by PID here), so it does not
share the client's GIL. All contenders read every object once per pass, undecoded, no shuffle
buffer; interleaved passes, medians. moto reads a whole object for every ranged GET, so shards
stay <= 16 MB and shardstream reads each range in one request (read_size 16 MiB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import get_object_stream, moto_bucket


def many_shards(client, options: dict, prefix: str, count: int, sample: dict | None = None) -> bytes:
    """``count`` copies of one 10-sample shard (and its offset sidecar) under s3://bench/PREFIX, with
    their manifest; returns the manifest's JSON. Copies are server-side puts of the same bytes."""
    import json

    from shardstream import ShardWriter

    with ShardWriter(f"s3://bench/{prefix}-src", max_count=10, storage_options=options) as w:
        for i in range(10):
            w.write_encoded(f"{i:04d}", sample or {"txt": b"x" * 100})
    body = client.get_object(Bucket="bench", Key=f"{prefix}-src/shard-000000.tar")["Body"].read()
    sidecar = client.get_object(Bucket="bench", Key=f"{prefix}-src/shard-000000.tar.idx")["Body"].read()

    def put(i: int) -> None:
        client.put_object(Bucket="bench", Key=f"{prefix}/shard-{i:06d}.tar", Body=body)
        client.put_object(Bucket="bench", Key=f"{prefix}/shard-{i:06d}.tar.idx", Body=sidecar)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(count)))
    doc = json.loads(client.get_object(Bucket="bench", Key=f"{prefix}-src/index.json")["Body"].read())
    template = {k: v[0] for k, v in doc["shards"].items() if v is not None}
    doc["shards"] = {k: [v] * count for k, v in template.items()}
    doc["shards"]["path"] = [f"shard-{i:06d}.tar" for i in range(count)]
    doc["total_samples"] = 10 * count
    doc["total_bytes"] = template["bytes"] * count
    manifest = json.dumps(doc).encode()
    client.put_object(Bucket="bench", Key=f"{prefix}/index.json", Body=manifest)
    return manifest


def main() -> None:
    import webdataset as wds

    from shardstream import Read, ShardStream, ShardWriter, Store, World, make_loader

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", type=int, default=40_000)
    parser.add_argument("--large", type=int, default=48, help="4 MB samples; larger sizes get the same bytes")
    parser.add_argument("--large-mb", default="4", help="sample sizes in MB, e.g. 4,64,500")
    parser.add_argument("--manifest-shards", type=int, default=10_000, help="0: skip the time-to-first-batch part")
    parser.add_argument("--threads-ab", action="store_true", help="also run shardstream with 4 read-ahead threads")
    args = parser.parse_args()
    with moto_bucket() as (endpoint, options, client, _):
        rng = np.random.default_rng(0)
        sizes_mb = [int(v) for v in args.large_mb.split(",") if v]
        kinds = []  # (prefix, samples, read_size, batch)
        for mb in sizes_mb:
            count = max(2, (args.large * 4) // mb)  # about the same bytes per size (at least 2 samples)
            side = int((mb * (1 << 20) // 4) ** 0.5)
            with ShardWriter(f"s3://bench/large{mb}", max_size=max(16_000_000, mb << 20), storage_options=options) as w:
                for i in range(count):
                    w.write({"__key__": f"{i:06d}", "npy": np.full((side, side), i, dtype=np.float32)})
            kinds.append((f"large{mb}", count, max(16 << 20, (mb + 1) << 20), 4 if mb < 64 else 1))
        with ShardWriter("s3://bench/small", max_count=5_000, storage_options=options) as w:
            for i in range(args.small):
                w.write_encoded(f"{i:08d}", {"bin": rng.bytes(int(rng.integers(1000, 2000))), "cls": b"1"})
        kinds.append(("small", args.small, 16 << 20, 50))
        rows = []
        for kind, n, read_size, batch in kinds:
            keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="bench", Prefix=f"{kind}/")["Contents"] if o["Key"].endswith(".tar"))
            total = sum(client.head_object(Bucket="bench", Key=k)["ContentLength"] for k in keys)

            def raw():
                for key in keys:
                    client.get_object(Bucket="bench", Key=key)["Body"].read()
                return n

            def raw_processes():
                # the same process count as shardstream with 2 workers: two processes, half the objects each
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
                    assert sum(pool.map(get_object_stream, [endpoint, endpoint], [keys[0::2], keys[1::2]])) == total
                return n

            def ours(workers, readahead=None, threads=1):
                def run():
                    ds = ShardStream(
                        f"s3://bench/{kind}",
                        batch_size=batch,
                        shuffle=False,
                        decode=False,
                        world=World(0, 1),
                        store=Store(options=options, read=Read(read_size=read_size, readahead_bytes=readahead, readahead_threads=threads)),
                    )
                    return sum(len(b["__key__"]) for b in make_loader(ds, num_workers=workers, pin_memory=False))

                return run

            def webdataset_run(workers):
                def run():
                    # presigned https-style URLs, the usual way webdataset reads private S3 objects with curl
                    urls = [client.generate_presigned_url("get_object", Params={"Bucket": "bench", "Key": k}, ExpiresIn=3600) for k in keys]
                    ds = wds.WebDataset(
                        urls, shardshuffle=False, nodesplitter=wds.single_node_only, workersplitter=wds.split_by_worker, empty_check=False
                    ).batched(batch, partial=True)
                    return sum(len(b["__key__"]) for b in wds.WebLoader(ds, batch_size=None, num_workers=workers))

                return run

            contenders = {
                "boto3 GET (1 thread)": raw,
                "boto3 GET (2 processes)": raw_processes,
                "shardstream, 0 workers": ours(0),
                "shardstream, 2 workers": ours(2),
                "webdataset, 0 workers": webdataset_run(0),
                "webdataset, 2 workers": webdataset_run(2),
            }
            if args.threads_ab:
                contenders["shardstream, 0 workers, 4 read-ahead threads"] = ours(0, threads=4)
                contenders["shardstream, 2 workers, 4 read-ahead threads"] = ours(2, threads=4)
            if kind.startswith("large") and int(kind[5:]) >= 64:
                contenders["shardstream, 0 workers, read-ahead off"] = ours(0, 0)
            times = {name: [] for name in contenders}
            for _ in range(args.repeats):
                for name, fn in contenders.items():
                    t = time.perf_counter()
                    got = fn()
                    times[name].append(time.perf_counter() - t)
                    assert got == n, (name, got, n)
            ref = statistics.median(times["boto3 GET (1 thread)"])
            ref2 = statistics.median(times["boto3 GET (2 processes)"])
            for name, values in times.items():
                med = statistics.median(values)
                rows.append((kind, name, n / med, total / med / 1e6, ref / med, ref2 / med))
        print("| samples | reader | samples/s | MB/s | vs boto3 GET, 1 process | vs boto3 GET, 2 processes |")
        print("|---|---|---|---|---|---|")
        for kind, name, sps, mbs, ratio, ratio2 in rows:
            print(f"| {kind} | {name} | {sps:,.0f} | {mbs:,.1f} | {ratio:.0%} | {ratio2:.0%} |")
        print(f"(medians of {args.repeats} interleaved passes; largeN = N MB float32 arrays, small = ~1.5 KB)")

        if args.manifest_shards:
            # time to first batch with a manifest of many shards
            count = args.manifest_shards
            manifest = many_shards(client, options, "tiny", count)
            firsts, constructs = [], []
            for _ in range(args.repeats):
                t = time.perf_counter()
                ds = ShardStream("s3://bench/tiny", batch_size=32, world=World(0, 1), store=Store(options=options))
                constructs.append(time.perf_counter() - t)
                next(iter(make_loader(ds, num_workers=2, pin_memory=False)))
                firsts.append(time.perf_counter() - t)
            print(
                f"\ntime to first batch, {count}-shard manifest ({len(manifest) / 1e6:.1f} MB JSON), 2 workers: "
                f"{statistics.median(firsts):.2f} s median (of which manifest read + validate + plan "
                f"{statistics.median(constructs):.2f} s)"
            )


if __name__ == "__main__":
    main()
