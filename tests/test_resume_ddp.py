"""Preemption in real processes: gloo DDP, 2 ranks x 2 DataLoader workers, from local disk and from
the moto S3 server. Train k steps, checkpoint (model, optimizer, loader state; written atomically),
kill -9 every rank, restart: with the same world the batches after the checkpoint are the
uninterrupted run's; with 3 ranks the samples before and after are the epoch, none twice."""

from __future__ import annotations

import datetime
import json
import os

import pytest
from conftest import launch_phase, make_samples, scaled

from shardstream import ShardStream, ShardWriter, Store, make_loader
from shardstream.options import Shuffle
from shardstream.plan.topology import World

STOP = 5  # steps before the checkpoint
SETTINGS = dict(batch_size=4, seed=7, shuffle=Shuffle(20))


def _rank_main(rank: int, world: int, store: str, source: str, options: dict, work: str, phase: str, ready) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=scaled(60)))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = make_loader(ShardStream(source, **SETTINGS, store=Store(options=options)), num_workers=2, log_interval=None)
    checkpoint = os.path.join(work, "checkpoint.pt")
    start = 0
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = json.loads(saved["loader"])
        loader.load_state_dict(state)
        start = state["epoch"]
    with open(os.path.join(work, f"{phase}.keys.{rank}"), "w") as out:
        for epoch in range(start, 2):
            loader.set_epoch(epoch)
            for step, batch in enumerate(loader):
                loss = model(batch["cls"].float().unsqueeze(1)).sum()
                optimizer.zero_grad()
                loss.backward()  # all-reduce: unequal batch counts would hang here
                optimizer.step()
                out.write(json.dumps([epoch, batch["__key__"]]) + "\n")
                out.flush()
                if phase == "crash" and step + 1 == STOP:
                    if rank == 0:  # one rank's state is enough: every rank received the same count
                        tmp = checkpoint + ".tmp"
                        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": json.dumps(loader.state_dict())}, tmp)
                        os.replace(tmp, checkpoint)
                    dist.barrier()
                    ready.put(rank)
                    time.sleep(600)  # killed here, mid-epoch, workers and all
    with open(os.path.join(work, f"{phase}.done.{rank}"), "w"):
        pass
    dist.destroy_process_group()


def launch(world: int, source: str, options: dict, work: str, phase: str) -> dict[int, dict[int, list]]:
    """Run ``phase`` on ``world`` ranks; returns rank -> epoch -> keys per batch."""
    result: dict[int, dict[int, list]] = {}
    for r, lines in enumerate(launch_phase(_rank_main, world, work, phase, (source, options))):
        for epoch, keys in lines:
            result.setdefault(r, {}).setdefault(epoch, []).append(keys)
    return result


def reference(source: str, options: dict, world: int) -> dict[int, dict[int, list]]:
    """The uninterrupted run, rank by rank in this process (the order does not depend on DDP)."""
    out: dict[int, dict[int, list]] = {}
    for rank in range(world):
        loader = make_loader(
            ShardStream(source, world=World(rank, world), **SETTINGS, store=Store(options=options)), num_workers=2, log_interval=None
        )
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            out.setdefault(rank, {})[epoch] = [list(b["__key__"]) for b in loader]
    return out


def flat(batches) -> list[str]:
    return [k for b in batches for k in b]


def preempt_and_resume(source: str, options: dict, tmp_path) -> None:
    work = str(tmp_path)
    ref = reference(source, options, 2)
    crashed = launch(2, source, options, work, "crash")
    for r in (0, 1):
        assert crashed[r][0] == ref[r][0][:STOP]
    same = launch(2, source, options, work, "same")
    for r in (0, 1):
        assert same[r][0] == ref[r][0][STOP:]  # exact: the uninterrupted run's batches, in order
        assert same[r][1] == ref[r][1]  # and the next epoch as usual
    three = launch(3, source, options, work, "three")
    before = flat(crashed[0][0]) + flat(crashed[1][0])
    after = [k for r in range(3) for k in flat(three[r][0])]
    assert len({len(three[r][0]) for r in range(3)}) == 1  # equal batches per rank
    epoch = set(flat(ref[0][0]) + flat(ref[1][0]))
    assert len(before + after) == len(set(before + after))  # no sample twice
    probe = ShardStream(source, world=World(0, 3), **SETTINGS, store=Store(options=options))
    with open(os.path.join(work, "checkpoint.pt"), "rb") as f:
        import torch

        probe.load_state_dict(json.loads(torch.load(f, weights_only=True)["loader"]))
    dropped = probe.resume_plan(2).dropped
    assert set(before + after) <= epoch and len(before + after) + dropped == len(epoch)
    epoch1 = [k for r in range(3) for k in flat(three[r][1])]
    assert len(epoch1) == len(set(epoch1)) == 3 * len(probe) * 4  # the next epoch on 3 ranks, as planned


def write(url: str, n: int, options=None) -> None:
    with ShardWriter(url, max_count=17, storage_options=options) as w:
        for s in make_samples(n):
            w.write(s)


@pytest.mark.slow
def test_preempted_ddp_resumes_from_local_disk(tmp_path):
    write(str(tmp_path / "ds"), 150)
    preempt_and_resume(str(tmp_path / "ds"), {}, tmp_path)


@pytest.mark.slow
def test_preempted_ddp_resumes_from_s3(s3, tmp_path):
    bucket, options, _ = s3
    write(f"s3://{bucket}/resume", 130, options)
    preempt_and_resume(f"s3://{bucket}/resume", options, tmp_path)
