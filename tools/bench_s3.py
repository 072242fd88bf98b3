"""S3 read throughput: shardstream from a moto server on 127.0.0.1 versus (a) plain boto3 GETs of
the same objects from the same server and (b) webdataset reading the same shards through its own
remote path (presigned http URLs, read with curl); plus the time to the first batch with a 10,000-shard
manifest.

    OMP_NUM_THREADS=1 python tools/bench_s3.py [--repeats 3]

The moto server runs as a separate process (started and stopped by PID here), so it does not
share the client's GIL. All contenders read every object once per pass, undecoded, no shuffle
buffer; interleaved passes, medians. moto reads a whole object for every ranged GET, so shards
stay <= 16 MB and shardstream reads each range in one request (read_size 16 MiB).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto_server did not start")


def main() -> None:
    import boto3
    import webdataset as wds

    from shardstream import Read, ShardStream, ShardWriter, World, make_loader

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", type=int, default=40_000)
    parser.add_argument("--large", type=int, default=48)
    parser.add_argument("--manifest-shards", type=int, default=10_000)
    args = parser.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    proc, endpoint = start_moto()
    options = {"endpoint_url": endpoint}
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="bench")
        rng = np.random.default_rng(0)
        with ShardWriter("s3://bench/large", max_size=16_000_000, storage_options=options) as w:
            for i in range(args.large):
                w.write({"__key__": f"{i:06d}", "npy": rng.standard_normal((1024, 1024), dtype=np.float32)})
        with ShardWriter("s3://bench/small", max_count=5_000, storage_options=options) as w:
            for i in range(args.small):
                w.write_encoded(f"{i:08d}", {"bin": rng.bytes(int(rng.integers(1000, 2000))), "cls": b"1"})
        rows = []
        for kind in ("large", "small"):
            keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="bench", Prefix=f"{kind}/")["Contents"]
                          if o["Key"].endswith(".tar"))
            total = sum(client.head_object(Bucket="bench", Key=k)["ContentLength"] for k in keys)
            n = args.large if kind == "large" else args.small

            def raw():
                for key in keys:
                    client.get_object(Bucket="bench", Key=key)["Body"].read()
                return n

            def ours(workers):
                def run():
                    ds = ShardStream(f"s3://bench/{kind}", batch_size=4 if kind == "large" else 50, shuffle=False,
                                     decode=False, world=World(0, 1), storage_options=options, read=Read(read_size=16 << 20))
                    return sum(len(b["__key__"]) for b in make_loader(ds, num_workers=workers, pin_memory=False))
                return run

            def webdataset_run(workers):
                def run():
                    # presigned https-style URLs, the usual way webdataset reads private S3 objects with curl
                    urls = [client.generate_presigned_url("get_object", Params={"Bucket": "bench", "Key": k}, ExpiresIn=3600)
                            for k in keys]
                    ds = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.single_node_only,
                                        workersplitter=wds.split_by_worker, empty_check=False).batched(64, partial=True)
                    return sum(len(b["__key__"]) for b in wds.WebLoader(ds, batch_size=None, num_workers=workers))
                return run

            contenders = {"boto3 GET (1 thread)": raw, "shardstream, 0 workers": ours(0), "shardstream, 2 workers": ours(2),
                          "webdataset, 0 workers": webdataset_run(0), "webdataset, 2 workers": webdataset_run(2)}
            times = {name: [] for name in contenders}
            for _ in range(args.repeats):
                for name, fn in contenders.items():
                    t = time.perf_counter()
                    got = fn()
                    times[name].append(time.perf_counter() - t)
                    assert got == n, (name, got, n)
            ref = statistics.median(times["boto3 GET (1 thread)"])
            for name, values in times.items():
                med = statistics.median(values)
                rows.append((kind, name, n / med, total / med / 1e6, ref / med))
        print("| samples | reader | samples/s | MB/s | vs boto3 GET |")
        print("|---|---|---|---|---|")
        for kind, name, sps, mbs, ratio in rows:
            print(f"| {kind} | {name} | {sps:,.0f} | {mbs:,.1f} | {ratio:.0%} |")
        print(f"(medians of {args.repeats} interleaved passes; large = 4 MB float32 arrays, small = ~1.5 KB)")

        # time to first batch with a manifest of many shards
        count = args.manifest_shards
        with ShardWriter("s3://bench/tiny-src", max_count=10, storage_options=options) as w:
            for i in range(10):
                w.write_encoded(f"{i:04d}", {"txt": b"x" * 100})
        body = client.get_object(Bucket="bench", Key="tiny-src/shard-000000.tar")["Body"].read()
        sidecar = client.get_object(Bucket="bench", Key="tiny-src/shard-000000.tar.idx")["Body"].read()

        def put(i: int) -> None:
            client.put_object(Bucket="bench", Key=f"tiny/shard-{i:06d}.tar", Body=body)
            client.put_object(Bucket="bench", Key=f"tiny/shard-{i:06d}.tar.idx", Body=sidecar)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, range(count)))
        import json

        doc = json.loads(client.get_object(Bucket="bench", Key="tiny-src/index.json")["Body"].read())
        template = {k: v[0] for k, v in doc["shards"].items() if v is not None}
        doc["shards"] = {k: [v] * count for k, v in template.items()}
        doc["shards"]["path"] = [f"shard-{i:06d}.tar" for i in range(count)]
        doc["total_samples"] = 10 * count
        doc["total_bytes"] = template["bytes"] * count
        manifest = json.dumps(doc).encode()
        client.put_object(Bucket="bench", Key="tiny/index.json", Body=manifest)
        firsts, constructs = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            ds = ShardStream("s3://bench/tiny", batch_size=32, world=World(0, 1), storage_options=options)
            constructs.append(time.perf_counter() - t)
            next(iter(make_loader(ds, num_workers=2, pin_memory=False)))
            firsts.append(time.perf_counter() - t)
        print(f"\ntime to first batch, {count}-shard manifest ({len(manifest) / 1e6:.1f} MB JSON), 2 workers: "
              f"{statistics.median(firsts):.2f} s median (of which manifest read + validate + plan "
              f"{statistics.median(constructs):.2f} s)")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
