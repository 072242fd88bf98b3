"""DDP training on streamed shards: ShardStream -> make_loader -> to_device -> a small CNN.

    torchrun --nproc-per-node 2 examples/train_ddp.py data/demo/shards --epochs 2
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST --master-port 29500 \
        examples/train_ddp.py s3://bucket/train --endpoint-url https://s3.example.com
    torchrun --nproc-per-node 2 examples/train_ddp.py --mix mix.yaml --steps 1000 --epochs 50 --checkpoint ckpt

gloo on CPU, nccl on GPU. Prints per-rank batch counts (equal on every rank), samples/s and the
time spent waiting for data.

Preemption: with ``--checkpoint DIR`` rank 0 writes model, optimizer and loader state to
DIR/checkpoint.pt every ``--checkpoint-every`` steps (temp file, then rename: a kill mid-write
leaves the previous checkpoint), and a restart resumes from it mid-epoch: exactly where it
stopped with the same world, or with every unseen sample once after an elastic restart
(``torchrun`` with another ``--nproc-per-node``/``--nnodes``).

A run by steps: ``--mix FILE`` reads a weighted mix (a JSON or YAML mix file, docs/mixing.md)
instead of one dataset, and ``--steps N`` makes every loader epoch N steps on every rank, drawn
from data epochs back to back; ``--epochs`` then counts those. A restart on another world size
yields the rest of the interrupted epoch's N steps on every rank, finishing the interrupted data
epoch first.

Unlike datasets: images may be .jpg, .png or .webp, read as one field (``Decode(alias={"image":
"jpg;png;webp"})``), each resized (aspect kept) and centre-cropped to ``--image-size`` (64 by
default: ``Decode(size=64)``), so an ImageFolder of mixed files and sizes and a mix of a .jpg set
and a .png set both train. The sources of a mix may have other fields besides (a caption set's json and txt): their
batches hold the union of the fields, which this loop ignores. A mix file may map a source's
samples with ``transform: module:function`` (importable on every rank: PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardstream


class SmallNet(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, loader_state: dict, rank: int) -> None:
    """Rank 0 writes; every rank received the same number of batches, so its loader state is
    everyone's. Atomic: a temp file renamed over the old checkpoint."""
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp"
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "loader": json.dumps(loader_state)}, tmp)
        os.replace(tmp, path)
    # nobody runs ahead of a checkpoint that is not yet written (nccl: on this rank's GPU)
    if torch.cuda.is_available():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="?", help="dataset root or index.json URL (local or s3://)")
    parser.add_argument("--mix", metavar="FILE", help="a mix file (JSON or YAML) to read instead of one dataset")
    parser.add_argument("--steps", type=int, default=None, metavar="N", help="steps per epoch, from data epochs back to back")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--image-size", type=int, default=64, metavar="PX", help="images resized and centre-cropped to PX x PX (default 64)")
    parser.add_argument("--endpoint-url", default=None)
    parser.add_argument("--checkpoint", default=None, metavar="DIR", help="save here every N steps; resume when present")
    parser.add_argument("--checkpoint-every", type=int, default=100, metavar="N")
    args = parser.parse_args()
    if (args.data is None) == (args.mix is None):
        parser.error("give a dataset (DATA) or a mix file (--mix FILE), one of them")

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else None
    dataset = shardstream.ShardStream(
        args.mix or args.data,
        batch_size=args.batch_size,
        seed=0,
        shuffle=shardstream.Shuffle(500),
        # one field, whichever a sample has, every image resized and centre-cropped to one size
        decode=shardstream.Decode(alias={"image": "jpg;png;webp"}, size=args.image_size),
        store=shardstream.Store(options=options),
        schedule=shardstream.Schedule(steps=args.steps),
    )
    loader = shardstream.make_loader(dataset, num_workers=args.workers)
    classes = max(len(m.label_map or {}) for m in dataset.sources.manifests) or 10
    model = nn.parallel.DistributedDataParallel(SmallNet(classes).to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_epoch = 0
    path = os.path.join(args.checkpoint, "checkpoint.pt") if args.checkpoint else None
    if path and os.path.exists(path):
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(json.loads(saved["loader"]))  # one state for every rank, any world size
        start_epoch = loader.dataset.epoch
        if rank == 0:  # exactly or elastically, as the loader's workers will run it
            say(f"resumed from {path}: {dataset.resume_plan(loader.num_workers).summary()}")
    if rank == 0:
        # The plan for the loader's workers (plan() without num_workers assumes make_loader's too).
        say(dataset.plan(num_workers=loader.num_workers).summary())

    step = 0
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        batches = samples = correct = 0
        wait = 0.0
        loss_sum = torch.zeros((), device=device)
        started = tick = time.perf_counter()
        batches_in = shardstream.to_device(loader, device)
        for batch in batches_in:
            wait += time.perf_counter() - tick
            images = batch["image"].float().div_(255)
            labels = batch["cls"]
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            correct += int((logits.argmax(1) == labels).sum())
            batches += 1
            samples += labels.numel()
            step += 1
            if path and step % args.checkpoint_every == 0:
                save_checkpoint(path, model, optimizer, batches_in.state_dict(), rank)
            tick = time.perf_counter()
        elapsed = time.perf_counter() - started
        counts = torch.tensor([batches], dtype=torch.int64, device=device)  # nccl gathers device tensors only
        gathered = [torch.zeros_like(counts) for _ in range(world)]
        dist.all_gather(gathered, counts)
        say(
            f"[rank {rank}] epoch {epoch}: {batches} batches, {samples} samples, {samples / elapsed:.0f} samples/s, "
            f"waited {wait:.2f}s for data ({100 * wait / elapsed:.0f}%), loss {float(loss_sum) / max(batches, 1):.3f}, "
            f"acc {correct / max(samples, 1):.2f}"
        )
        if rank == 0:
            per_rank = [int(g) for g in gathered]
            say(f"epoch {epoch}: batches per rank {per_rank} ({'equal' if len(set(per_rank)) == 1 else 'UNEQUAL'})")
    dist.destroy_process_group()


def finish() -> None:
    """End the rank now, without the interpreter's finalization: output flushed, then ``os._exit(0)``.

    gloo's worker thread drops its references to a collective's tensors a moment after the call
    returns, and dropping one takes the GIL (torch keeps a tensor's Python object alive while C++
    holds it). If that moment falls after the interpreter began to exit, CPython 3.11 ends the
    thread with pthread_exit, and its unwinding through a C++ destructor aborts the rank: "terminate
    called without an active exception" (gdb: pt_gloo_runloop in ~AsyncAllgatherWork ->
    decref_pyobject -> take_gil -> PyThread_exit_thread). A rank that never finalizes cannot meet
    it. Call it last, after ``destroy_process_group`` and whatever must be saved; the loader's
    worker processes end with their rank (they watch its socket), and shardstream leaves nothing to
    clean up (no named shared memory, no lock files)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def say(line: str) -> None:
    """One line in one write: ranks share the terminal, and with unbuffered output (PYTHONUNBUFFERED)
    print writes the text and its newline apart, so two ranks' lines could run together."""
    print(line + "\n", end="", flush=True)


if __name__ == "__main__":
    main()
    finish()
