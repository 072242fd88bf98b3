"""Read throughput: ShardStream vs the equivalent webdataset pipeline, side by side in one run,
interleaved, medians over repeats.

    OMP_NUM_THREADS=1 python benchmarks/bench_read.py [--repeats 5] [--workdir /dev/shm/ssbench-read]

Both read the same tar shards (written once, staged in /dev/shm so the page cache is warm) and do
the same work: shard shuffle, a 1000-sample shuffle buffer, decode, batches of 64 as dicts.
  small   ~1-2 KB .bin + .cls per sample: per-sample overhead (parse, shuffle, collate, hand-off)
  images  JPEG ~40-120 KB + .cls: decode and random-resized-crop to 224x224 uint8 tensors;
          shardstream with its RandomResizedCrop decoder (crop chosen from the header, JPEG
          decoded at reduced scale when the crop allows) and without reduced decoding
shardstream also runs with read=Read(verify_stream=True) on small samples (the cost of hashing every shard).
num_workers 0 (one process: per-process cost) and 2 (this machine's 2 cores).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import count

BATCH = 64
BUFFER = 1000


def make_small(root: str, n: int) -> None:
    from shardstream import ShardWriter

    rng = np.random.default_rng(0)
    with ShardWriter(root, max_count=10_000, overwrite=True) as w:
        for i in range(n):
            w.write_encoded(f"{i:08d}", {"bin": rng.bytes(int(rng.integers(1000, 2000))), "cls": str(i % 1000).encode()})


def make_images(root: str, n: int) -> None:
    from PIL import Image, ImageFilter

    from shardstream import ShardWriter

    rng = np.random.default_rng(0)
    bases = []
    for _ in range(16):
        noise = rng.normal(128, 60, (375, 500, 3)).clip(0, 255).astype(np.uint8)
        bases.append(Image.fromarray(noise).filter(ImageFilter.GaussianBlur(1.2)))
    with ShardWriter(root, max_count=500, overwrite=True) as w:
        for i in range(n):
            img = bases[i % 16].rotate(int(rng.integers(0, 360)))
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=int(rng.integers(80, 95)))
            w.write_encoded(f"{i:08d}", {"jpg": buf.getvalue(), "cls": str(i % 1000).encode()})


def shardstream_loader(root: str, kind: str, workers: int, reduced: bool = True, verify: bool = False):
    from shardstream import RandomResizedCrop, Read, ShardStream, Shuffle, Store, World, make_loader

    decode = {"jpg": RandomResizedCrop(224, reduced_decode=reduced)} if kind == "images" else True
    ds = ShardStream(root, batch_size=BATCH, shuffle=Shuffle(BUFFER), decode=decode, world=World(0, 1), store=Store(read=Read(verify_stream=verify)))
    return make_loader(ds, num_workers=workers, pin_memory=False)


def webdataset_loader(root: str, kind: str, workers: int):
    import torch
    import webdataset as wds
    from PIL import Image

    from shardstream import RandomResizedCrop, load_manifest

    urls = [os.path.join(root, s.path) for s in load_manifest(root).shards]
    ds = wds.WebDataset(urls, shardshuffle=100, nodesplitter=wds.single_node_only, workersplitter=wds.split_by_worker, empty_check=False).shuffle(
        BUFFER
    )
    if kind == "images":
        crop = RandomResizedCrop(224, reduced_decode=False)

        def rrc(sample):
            img = sample["jpg"]
            x, y, w, h = crop.crop_box(*img.size)
            out = img.resize((224, 224), Image.BILINEAR, box=(x, y, x + w, y + h))
            sample["jpg"] = torch.from_numpy(np.array(out, copy=True)).permute(2, 0, 1)
            return sample

        ds = ds.decode("pil").map(rrc)
    else:
        ds = ds.decode()
    ds = ds.batched(BATCH, partial=True)
    return wds.WebLoader(ds, batch_size=None, num_workers=workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default="/dev/shm/ssbench-read")
    parser.add_argument("--small", type=int, default=100_000)
    parser.add_argument("--images", type=int, default=1_500)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--only", choices=["small", "images"], default=None)
    args = parser.parse_args()
    worker_counts = [int(w) for w in args.workers.split(",")]
    rows = []
    try:
        for kind, n in (("small", args.small), ("images", args.images)):
            if args.only and kind != args.only:
                continue
            root = os.path.join(args.workdir, kind)
            (make_small if kind == "small" else make_images)(root, n)
            mb = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root)) / 1e6
            for workers in worker_counts:
                contenders = {
                    "shardstream": lambda: shardstream_loader(root, kind, workers),
                    "webdataset": lambda: webdataset_loader(root, kind, workers),
                }
                if kind == "small":
                    contenders["shardstream, verify_stream (sha256)"] = lambda: shardstream_loader(root, kind, workers, verify=True)
                if kind == "images":
                    contenders["shardstream, full-size decode"] = lambda: shardstream_loader(root, kind, workers, reduced=False)
                rates: dict[str, list[float]] = {name: [] for name in contenders}
                for _ in range(args.repeats):
                    for name, make in contenders.items():  # interleaved: noise hits all alike
                        t = time.perf_counter()
                        got = count(make())
                        rates[name].append(got / (time.perf_counter() - t))
                ref = statistics.median(rates["webdataset"])
                for name, values in rates.items():
                    med = statistics.median(values)
                    rows.append((kind, workers, name, med, med * mb / n, med / ref))
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    print("| samples | num_workers | loader | samples/s (median) | MB/s | vs webdataset |")
    print("|---|---|---|---|---|---|")
    for kind, workers, name, rate, mbs, ratio in rows:
        print(f"| {kind} | {workers} | {name} | {rate:,.0f} | {mbs:,.1f} | {ratio:.2f}x |")
    print(f"(medians of {args.repeats} interleaved full passes, batch {BATCH}, shuffle buffer {BUFFER})")


if __name__ == "__main__":
    main()
