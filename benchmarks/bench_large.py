"""Large samples (4 MB float32 ``.npy``) from tmpfs: ShardStream vs webdataset, side by side in one
run, interleaved, medians over repeats, and the floor (the same files read with ``readinto``).

    OMP_NUM_THREADS=1 python benchmarks/bench_large.py [--repeats 3] [--samples 256] [--batch 32]

Every loader decodes the same ``.npy`` fields and batches them to one float32 tensor per batch:
  shardstream            its own ``.npy`` decoder (array over the member's buffer) + its default collate
  shardstream, np.load   the user's per-sample ``np.load(BytesIO)`` as decoder, default collate
  webdataset             the same ``np.load`` per sample, ``batched`` (np.stack) then ``torch.from_numpy``
  torch default_collate  shardstream's decoder with torch's default_collate as collate
num_workers 0 (per-process rate) and 2. GB/s counts the payload (decoded float32 bytes).

``--copies`` instead times each step of one sample's path at num_workers 0 (read, cut out of the
read block, decode, batch) against a plain 4 MB memcpy, to show how many copies per byte remain.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import cpu_seconds

from shardstream import Shuffle, World

SHAPE = (1024, 1024)  # float32: 4 MiB per sample


def make_dataset(root: str, n: int) -> None:
    from shardstream import ShardWriter

    rng = np.random.default_rng(0)
    base = rng.standard_normal(SHAPE, dtype=np.float32)
    with ShardWriter(root, max_count=64, max_size=1 << 40, overwrite=True) as w:
        for i in range(n):
            buf = io.BytesIO()
            np.save(buf, base + np.float32(i))
            w.write_encoded(f"{i:08d}", {"npy": buf.getvalue(), "cls": str(i % 10).encode()})


def user_npy(data: bytes):
    import torch

    return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))


def shardstream_loader(root: str, workers: int, batch: int, mode: str):
    from torch.utils.data import default_collate

    from shardstream import ShardStream, make_loader

    decode: bool | dict = {"npy": user_npy} if mode == "np.load" else True
    collate = None
    if mode == "torch-collate":

        def collate(samples):
            return default_collate([{"npy": s["npy"], "cls": s["cls"]} for s in samples])

    ds = ShardStream(root, batch_size=batch, shuffle=Shuffle(64), decode=decode, collate=collate, world=World(0, 1))
    return make_loader(ds, num_workers=workers, pin_memory=False)


def webdataset_loader(root: str, workers: int, batch: int):
    import torch
    import webdataset as wds

    from shardstream import load_manifest

    urls = [os.path.join(root, s.path) for s in load_manifest(root).shards]

    def decode(sample):
        return {"npy": np.load(io.BytesIO(sample["npy"]), allow_pickle=False), "cls": int(sample["cls"])}

    def to_torch(b):
        return {"npy": torch.from_numpy(b["npy"]), "cls": torch.as_tensor(b["cls"])}

    ds = (
        wds.WebDataset(urls, shardshuffle=100, nodesplitter=wds.single_node_only, workersplitter=wds.split_by_worker, empty_check=False)
        .shuffle(64)
        .map(decode)
        .batched(batch, partial=False)
        .map(to_torch)
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=workers)


def floor_read(root: str) -> int:
    """The same shard files, read with readinto into one reused buffer: tmpfs at memory speed."""
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    total = 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".tar"):
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return total


def timed(fn) -> tuple[float, float]:
    """(GB/s of wall time, GB per CPU-second) of ``fn()``, which returns a byte count."""
    gc.collect()
    t, c = time.perf_counter(), cpu_seconds()
    got = fn()
    wall, cpu = time.perf_counter() - t, cpu_seconds() - c
    return got / wall / 1e9, got / cpu / 1e9


def consume(loader) -> int:
    payload = 0
    for b in loader:
        payload += b["npy"].nelement() * b["npy"].element_size()
    return payload


def copies(root: str, batch: int) -> None:
    """CPU time of each step of the path (num_workers 0), per 4 MiB sample, against a 4 MiB copy
    into fresh memory (what a copy costs in a pipeline: first-touch page faults included)."""
    import torch

    from shardstream import load_manifest
    from shardstream.format.tar import iter_sample_batches
    from shardstream.pipeline.batch import default_collate
    from shardstream.pipeline.decode import default_decoders
    from shardstream.storage.ranges import FileReader

    clock = time.process_time
    manifest = load_manifest(root)
    shard = manifest.shards[0]
    path = manifest.shard_url(0)
    nbytes = SHAPE[0] * SHAPE[1] * 4
    src = np.ones(nbytes, np.uint8)
    reps = 32
    t = clock()
    kept = [bytearray(src) for _ in range(reps)]  # a bytes-like copy into fresh memory, as the parser's
    fresh_copy = (clock() - t) / reps
    del kept
    npy = default_decoders()["npy"]
    with open(path, "rb", buffering=0) as f:
        t0 = clock()
        as_bytes = [fs["npy"] for batch_ in iter_sample_batches(f.read, url=path, end=shard.span[1]) for _, _, _, fs in batch_]
        t_parse_bytes = clock() - t0  # read + tar parse, members as bytes (no readinto, no viewing decoder)
    del as_bytes
    with open(path, "rb", buffering=0) as f:
        t0 = clock()
        fields = [
            fs["npy"]
            for batch_ in iter_sample_batches(FileReader(f, None, None), url=path, end=shard.span[1], keep_buffers={"npy"})
            for _, _, _, fs in batch_
        ]
        t_parse = clock() - t0  # read + tar parse, large members read into their own buffers
    samples = len(fields)
    immutable = [bytes(d) for d in fields[:8]]
    t0 = clock()
    old = [user_npy(d) for d in immutable]
    t_dec_old = (clock() - t0) * samples / len(immutable)
    del old
    t0 = clock()
    copied = [npy(d) for d in immutable]
    t_dec_copy = (clock() - t0) * samples / len(immutable)
    del copied, immutable
    t0 = clock()
    new = [npy(d) for d in fields]
    t_dec_new = clock() - t0
    t_stack = t_col = float("inf")
    for _ in range(3):  # alternating, best of 3: the first touch of fresh memory varies run to run
        t0 = clock()
        stacked = torch.stack(new[:batch])
        t_stack = min(t_stack, clock() - t0)
        del stacked
        t0 = clock()
        collated = default_collate([{"npy": x} for x in new[:batch]])
        t_col = min(t_col, clock() - t0)
        del collated
    per = {
        "read + tar parse, members as bytes (read(n), no viewing decoder)": t_parse_bytes / samples,
        "read + tar parse, own buffers (readinto, .npy kept)": t_parse / samples,
        "np.load(BytesIO) decode": t_dec_old / samples,
        "shardstream .npy decode of bytes (one copy)": t_dec_copy / samples,
        "shardstream .npy decode of its own buffer (a view)": t_dec_new / samples,
        "torch.stack into a fresh batch (before)": t_stack / batch,
        "shardstream default collate (after)": t_col / batch,
    }
    print(f"4 MiB copy into fresh memory: {fresh_copy * 1e3:.2f} ms CPU ({nbytes / fresh_copy / 1e9:.1f} GB per CPU-second)")
    print("| step | CPU ms per 4 MiB sample | copies' worth |")
    print("|---|---|---|")
    for name, sec in per.items():
        print(f"| {name} | {sec * 1e3:.2f} | {sec / fresh_copy:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--workdir", default="/dev/shm/ssbench-large")
    parser.add_argument("--copies", action="store_true", help="time each step against a memcpy instead")
    parser.add_argument("--keep", action="store_true", help="keep the dataset in --workdir for the next run")
    parser.add_argument("--passes", type=int, default=1, help="passes per timing (a fresh loader each): a longer run")
    args = parser.parse_args()
    root = os.path.join(args.workdir, "npy")
    if not os.path.exists(os.path.join(root, "index.json")):
        make_dataset(root, args.samples)
    try:
        if args.copies:
            copies(root, args.batch)
            return
        rows = []
        for workers in [int(w) for w in args.workers.split(",")]:
            contenders = {
                "shardstream": lambda: shardstream_loader(root, workers, args.batch, "default"),
                "shardstream, np.load decoder": lambda: shardstream_loader(root, workers, args.batch, "np.load"),
                "shardstream, torch default_collate": lambda: shardstream_loader(root, workers, args.batch, "torch-collate"),
                "webdataset, np.load": lambda: webdataset_loader(root, workers, args.batch),
            }
            rates: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
            rates = {"floor: readinto of the shard files": [], **rates}
            for _ in range(args.repeats):
                rates["floor: readinto of the shard files"].append(timed(lambda: sum(floor_read(root) for _ in range(args.passes))))
                for name, make in contenders.items():  # interleaved: noise hits all alike
                    rates[name].append(timed(lambda: sum(consume(make()) for _ in range(args.passes))))
            ref = statistics.median(r[1] for r in rates["webdataset, np.load"])
            for name, values in rates.items():
                wall = statistics.median(r[0] for r in values)
                cpu = statistics.median(r[1] for r in values)
                rows.append((workers, name, wall, cpu, cpu / ref))
        print("| num_workers | loader | GB/s wall (median) | GB per CPU-second (median) | CPU-rate vs webdataset |")
        print("|---|---|---|---|---|")
        for workers, name, wall, cpu, ratio in rows:
            print(f"| {workers} | {name} | {wall:.2f} | {cpu:.2f} | {ratio:.2f}x |")
        print(f"(medians of {args.repeats} interleaved passes over {args.samples} x 4 MiB float32 .npy, batch {args.batch})")
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
