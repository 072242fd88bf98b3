"""The last hop on a real GPU: pinned batches from make_loader, to_device's copy-ahead on a side CUDA
stream overlapping the training step, and every byte checked on the device.

    OMP_NUM_THREADS=1 python -m benchmarks.device [--samples 8192] [--batch 128] [--workers 0,4,8]

Writes one JSON object per measurement to stdout (and to ``--out FILE`` if given):

  h2d        host-to-device copy rate of one batch and of a 256 MiB block, pinned vs pageable
  overlap    to_device over batches already in pinned memory, with a GPU step (bf16 matmuls) sized
             to take as long as one batch's copy: ms per step with copy_ahead=0 (copy, then step)
             and copy_ahead=1 (the next batch's copy under this step). Ideal: ahead ~ max(copy,
             step), serial ~ copy + step.
  loader     make_loader(num_workers=W) -> to_device(loader, "cuda") over uint8 3x224x224 images
             (``.npy``) in /dev/shm: GB/s of image bytes arriving on the GPU, the share of batches
             that arrived pinned, and the CPU-only rate of the same loader (pin_memory=False)
  check      on the to_device runs, every sample's sum and label compared on the GPU with what was
             written: mismatches must be 0 (a copy-ahead buffer reused too early would show here);
             on every run, each sample arrives once per epoch

Needs CUDA; with ``--device cpu`` it runs the same code paths without a GPU (a smoke test of the
script, no figures).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

SHAPE = (3, 224, 224)


def emit(out, **row) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def make_dataset(root: str, n: int) -> np.ndarray:
    """``n`` uint8 images, sample i = (base + i) mod 256; returns every sample's sum."""
    from shardstream import ShardWriter

    base = np.random.default_rng(0).integers(0, 256, SHAPE, dtype=np.uint8)
    sums = np.empty(n, np.int64)
    with ShardWriter(root, max_count=256, max_size=1 << 40, overwrite=True) as w:
        for i in range(n):
            img = base + np.uint8(i % 256)  # wraps
            sums[i] = int(img.sum(dtype=np.int64))
            buf = io.BytesIO()
            np.save(buf, img)
            w.write_encoded(f"{i:08d}", {"npy": buf.getvalue(), "cls": str(i).encode()})
    return sums


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d(device: torch.device, nbytes: int, repeats: int = 20) -> dict:
    rates = {}
    for pinned in (True, False):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and device.type == "cuda")
        src.fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        times = []
        for _ in range(repeats):
            sync(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            sync(device)
            times.append(time.perf_counter() - t)
        rates["pinned" if pinned else "pageable"] = round(nbytes / statistics.median(times) / 1e9, 2)
    return rates


def gpu_step(device: torch.device, iters: int, size: int = 2048):
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)

    def step():
        x = a
        for _ in range(iters):
            x = x @ a
            x = x * 1e-3
        return x

    return step


def step_ms(step, device: torch.device, repeats: int = 10) -> float:
    step()
    sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        step()
    sync(device)
    return (time.perf_counter() - t) / repeats * 1e3


def overlap(device: torch.device, out, batch_mib: int = 256, batches: int = 16) -> None:
    from shardstream import to_device

    pin = device.type == "cuda"
    host = [{"x": torch.full((batch_mib << 20,), i, dtype=torch.uint8, pin_memory=pin), "i": torch.tensor([i])} for i in range(batches)]
    copy_ms = (batch_mib << 20) / h2d(device, batch_mib << 20, repeats=5)["pinned"] / 1e6
    iters = 1
    while step_ms(gpu_step(device, iters), device) < copy_ms and iters < 4096:
        iters *= 2
    step = gpu_step(device, iters)
    train_ms = step_ms(step, device)
    result = {}
    for ahead in (0, 1, 0, 1):
        bad = torch.zeros((), dtype=torch.int64, device=device)
        sync(device)
        t = time.perf_counter()
        for b in to_device(host, device, copy_ahead=ahead):
            step()
            bad += (b["x"][:: 1 << 20] != b["i"][0].to(torch.uint8)).sum()
        sync(device)
        ms = (time.perf_counter() - t) / batches * 1e3
        result.setdefault(f"copy_ahead={ahead} ms/step", []).append(round(ms, 2))
        assert int(bad) == 0, f"copy_ahead={ahead}: {int(bad)} wrong bytes on the device"
    emit(out, what="overlap", batch_mib=batch_mib, copy_ms=round(copy_ms, 2), step_ms=round(train_ms, 2), **result)


def loader_run(root: str, sums: torch.Tensor, device: torch.device, workers: int, batch: int, pin: bool, to_gpu: bool, epochs: int) -> dict:
    from shardstream import ShardStream, Shuffle, World, make_loader, to_device

    ds = ShardStream(root, batch_size=batch, shuffle=Shuffle(256), world=World(0, 1))
    loader = make_loader(ds, num_workers=workers, pin_memory=pin, persistent_workers=workers > 0, log_interval=None)
    target = device if to_gpu else torch.device("cpu")
    batches = pinned = nbytes = 0
    bad = torch.zeros((), dtype=torch.int64, device=target)
    seen = torch.zeros(len(sums), dtype=torch.int64, device=target)
    expect = sums.to(target)
    first = time.perf_counter()
    t = 0.0
    for epoch in range(epochs + 1):  # epoch 0 warms up (workers start, pages touched)
        ds.set_epoch(epoch)
        if epoch == 1:
            sync(device)
            t = time.perf_counter()
        it = iter(loader)
        for b in to_device(it, target) if to_gpu else it:
            img, cls = b["npy"], b["cls"]
            if epoch:
                pinned += int(pin and not to_gpu and img.is_pinned())
                batches += 1
                nbytes += img.nelement()
            if to_gpu:  # the bytes checked where they arrived (on the CPU runs the sums would cost more than the reading)
                got = img.reshape(img.shape[0], -1).sum(1, dtype=torch.int64)
                bad += (got != expect[cls]).sum()
            seen.index_add_(0, cls, torch.ones_like(cls))
    sync(device)
    wall = time.perf_counter() - t
    return {
        "workers": workers,
        "pin_memory": pin,
        "to_gpu": to_gpu,
        "GB/s": round(nbytes / wall / 1e9, 3),
        "batches": batches,
        "pinned_share": round(pinned / batches, 3) if (pin and not to_gpu) else None,
        "mismatches": int(bad) if to_gpu else None,
        "every_sample_once_per_epoch": bool((seen == epochs + 1).all()),
        "seconds_total": round(time.perf_counter() - first, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--workers", default="0,4,8")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--overlap-mib", type=int, default=256)
    ap.add_argument("--out")
    args = ap.parse_args()
    out = open(args.out, "w") if args.out else None
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --device cpu for a smoke test of this script")
    emit(
        out,
        what="env",
        torch=torch.__version__,
        python=sys.version.split()[0],
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        cpus=os.cpu_count(),
    )
    batch_bytes = args.batch * int(np.prod(SHAPE))
    emit(out, what="h2d", batch_mib=round(batch_bytes / 2**20, 1), batch=h2d(device, batch_bytes), block_256mib=h2d(device, 256 << 20))
    overlap(device, out, batch_mib=args.overlap_mib)
    tmp = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="ss-device-", dir=tmp)
    try:
        t = time.perf_counter()
        sums = torch.from_numpy(make_dataset(root, args.samples))
        emit(out, what="dataset", samples=args.samples, seconds=round(time.perf_counter() - t, 1), root=root)
        for w in [int(x) for x in args.workers.split(",")]:
            cpu = loader_run(root, sums, device, w, args.batch, pin=False, to_gpu=False, epochs=args.epochs)
            pinned = loader_run(root, sums, device, w, args.batch, pin=True, to_gpu=False, epochs=args.epochs)
            gpu = loader_run(root, sums, device, w, args.batch, pin=True, to_gpu=True, epochs=args.epochs)
            for row in (cpu, pinned, gpu):
                emit(out, what="loader", **row)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
