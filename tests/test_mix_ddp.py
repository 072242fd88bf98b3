"""A mix in real processes: gloo DDP with 2 ranks x 2 DataLoader workers, mixing a dataset on local
disk with one on the moto S3 server (its own storage_options), a DDP step per batch (unequal batch
counts would hang the all-reduce), then a run by steps that crosses data epochs. And a preempted
run by steps on a weighted mix: kill -9 of every rank mid-pass, a restart on 3 ranks."""

from __future__ import annotations

import datetime
import json
import os

import pytest
from conftest import launch_phase, make_samples, rank_results, run_ranks, scaled

from shardstream import Schedule, ShardStream, ShardWriter, Source, World
from shardstream.options import Shuffle


def _rank_main(rank: int, world: int, store: str, local: str, remote: str, options: dict, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import shardstream
    from shardstream import Source

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=scaled(60)))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    sources = [Source(local, weight=0.6, name="disk"), Source(remote, weight=0.4, name="s3", storage_options=options)]
    result: dict = {}
    for label in ("epochs", "steps"):
        # The run by steps crosses into a second data epoch.
        steps = None if label == "epochs" else result["epochs"]["0"]["len"] + 3
        dataset = shardstream.ShardStream(sources, batch_size=4, seed=7, shuffle=Shuffle(20), schedule=Schedule(steps=steps))
        loader = shardstream.make_loader(dataset, num_workers=2, pin_memory=False)
        runs = {}
        for epoch in (0, 1) if steps is None else (0,):
            loader.set_epoch(epoch)
            keys, tags, batches = [], [], 0
            for batch in loader:
                loss = model(batch["cls"].float().unsqueeze(1)).sum()
                loss.backward()  # all-reduce: a rank with fewer batches would hang here
                keys += batch["__key__"]
                tags += batch["__source__"]
                batches += 1
            plan = dataset.plan(epoch=epoch)
            runs[str(epoch)] = {
                "keys": keys,
                "tags": tags,
                "batches": batches,
                "len": len(loader),
                "planned": {s.name: s.used for s in plan.shares()},
            }
        result[label] = runs
    with open(f"{out}.{rank}", "w") as f:  # per-rank files: see test_ddp.py for why not all_gather_object
        json.dump(result, f)
    dist.destroy_process_group()


def write(url: str, n: int, prefix: str, options=None) -> None:
    with ShardWriter(url, max_count=17, storage_options=options) as w:
        for s in make_samples(n, seed=len(prefix)):
            s["__key__"] = prefix + s["__key__"]
            w.write(s)


@pytest.mark.slow
def test_ddp_mix_local_and_s3(s3, tmp_path):
    bucket, options, _ = s3
    local, remote = str(tmp_path / "local"), f"s3://{bucket}/mix"
    write(local, 150, "disk-")
    write(remote, 90, "s3-", options)
    world = 2
    out = str(tmp_path / "result")
    run_ranks(_rank_main, world, (world, str(tmp_path / "store"), local, remote, options, out), timeout=240)
    ranks = rank_results(out, world)
    for epoch in ("0", "1"):
        per_rank = [r["epochs"][epoch] for r in ranks]
        assert len({r["batches"] for r in per_rank}) == 1 and all(r["batches"] == r["len"] for r in per_rank)
        flat = [k for r in per_rank for k in r["keys"]]
        assert len(flat) == len(set(flat))  # disjoint across ranks and workers; no sample twice (weights)
        tags = [t for r in per_rank for t in r["tags"]]
        assert {"disk": tags.count("disk"), "s3": tags.count("s3")} == per_rank[0]["planned"]  # as planned
        assert all(k.startswith(t + "-") for r in per_rank for k, t in zip(r["keys"], r["tags"]))
    assert ranks[0]["epochs"]["0"]["keys"] != ranks[0]["epochs"]["1"]["keys"]
    steps = [r["steps"]["0"] for r in ranks]
    assert steps[0]["batches"] == steps[1]["batches"] == steps[0]["len"] == ranks[0]["epochs"]["0"]["len"] + 3


STEPS, PASS, STOP = 9, 3, 5  # 9 steps per loader epoch; killed after 5 steps of loader epoch 3 (steps 27-31)
SETTINGS = dict(batch_size=4, seed=7, shuffle=Shuffle(20))


def mix(local: str) -> list[Source]:
    return [Source(os.path.join(local, "a"), weight=0.6, name="a"), Source(os.path.join(local, "b"), weight=0.4, name="b")]


def _preempted_rank(rank: int, world: int, store: str, local: str, work: str, phase: str, ready) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import time

    import torch
    import torch.distributed as dist

    import shardstream

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=scaled(60)))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    dataset = shardstream.ShardStream(mix(local), schedule=Schedule(steps=STEPS), **SETTINGS)
    loader = shardstream.make_loader(dataset, num_workers=2, persistent_workers=True, log_interval=None, pin_memory=False)
    checkpoint = os.path.join(work, "checkpoint.json")
    start = PASS
    if os.path.exists(checkpoint):
        with open(checkpoint) as f:
            state = json.load(f)
        loader.load_state_dict(state)
        start = state["loader_epoch"]
    with open(os.path.join(work, f"{phase}.keys.{rank}"), "w") as out:
        for epoch in range(start, PASS + 3):
            loader.set_epoch(epoch)
            for step, batch in enumerate(loader):
                model(batch["cls"].float().unsqueeze(1)).sum().backward()  # all-reduce: unequal counts would hang here
                out.write(json.dumps([epoch, batch["__key__"]]) + "\n")
                out.flush()
                if phase == "crash" and step + 1 == STOP:
                    if rank == 0:  # every rank received the same count: one state for all
                        with open(checkpoint + ".tmp", "w") as f:
                            json.dump(loader.state_dict(), f)
                        os.replace(checkpoint + ".tmp", checkpoint)
                    dist.barrier()
                    ready.put(rank)
                    time.sleep(600)  # killed here, mid-pass, workers and all
    dist.destroy_process_group()


def _launch(world: int, local: str, work: str, phase: str) -> list[list[tuple[int, list[str]]]]:
    """Run ``phase`` on ``world`` ranks; per rank, its batches as (loader epoch, keys)."""
    return [[tuple(line) for line in lines] for lines in launch_phase(_preempted_rank, world, work, phase, (local,))]


@pytest.mark.slow
def test_ddp_mix_by_steps_killed_mid_pass_resumes_on_another_world_size(tmp_path):
    local = str(tmp_path / "data")
    write(os.path.join(local, "a"), 150, "a-")
    write(os.path.join(local, "b"), 90, "b-")
    # Data epoch e is steps [28e, 28e + 28) on 2 ranks x batch 4 (225 samples of the mix per epoch).
    reference = ShardStream(mix(local), world=World(0, 2), **SETTINGS).plan(epoch=1)
    assert reference.batches_per_rank == 28
    epoch1 = set()
    for rank in range(2):  # the samples of data epoch 1 (a run by epochs lays out the same data epochs)
        ds = ShardStream(mix(local), world=World(rank, 2), **SETTINGS)
        ds.set_epoch(1)
        epoch1 |= {k for batch in ds for k in batch["__key__"]}
    assert len(epoch1) == 2 * 28 * 4

    crashed = _launch(2, local, str(tmp_path), "crash")
    assert [len(r) for r in crashed] == [STOP, STOP]  # steps 27-31: step 27 ends data epoch 0, 28-31 start epoch 1
    with open(tmp_path / "checkpoint.json") as f:
        state = json.load(f)
    assert state["run"] == {"steps": STEPS} and state["loader_epoch"] == PASS and state["epoch"] == 1
    probe = ShardStream(mix(local), world=World(0, 3), schedule=Schedule(steps=STEPS), **SETTINGS)
    probe.load_state_dict(state)
    plan = probe.resume_plan(2)
    assert plan is not None and not plan.exact and "elastically" in plan.summary()
    rest = plan.windows[0].layout.batches_per_rank  # steps the rest of data epoch 1 takes on 3 ranks

    after = _launch(3, local, str(tmp_path), "three")
    for epoch, steps in ((PASS, STEPS - STOP), (PASS + 1, STEPS), (PASS + 2, STEPS)):
        assert [sum(1 for e, _ in r if e == epoch) for r in after] == [steps] * 3  # every rank: the same count (9 - 5 first)
    before = [k for r in crashed for _, keys in r[1:] for k in keys]
    resumed = [k for r in after for _, keys in r[:rest] for k in keys]
    assert len(before + resumed) == len(set(before + resumed))  # nothing repeated within data epoch 1
    assert set(before + resumed) <= epoch1 and len(before + resumed) + plan.dropped == len(epoch1)  # nothing lost
    assert plan.dropped < 3 * 4
    fresh = [k for r in after for _, keys in r[rest:] for k in keys]
    # Then data epoch 2, fresh, on 3 ranks: the remaining steps, no sample twice.
    assert len(fresh) == len(set(fresh)) == 3 * ((STEPS - STOP) + 2 * STEPS - rest) * 4
