"""A mix in real processes: gloo DDP with 2 ranks x 2 DataLoader workers, mixing a dataset on local
disk with one on the moto S3 server (its own storage_options), a DDP step per batch (unequal batch
counts would hang the all-reduce), then a run by steps that crosses data epochs."""

from __future__ import annotations

import datetime
import json
import os

import pytest
from conftest import make_samples, rank_results, run_ranks

from shardstream import ShardWriter
from shardstream.options import Shuffle


def _rank_main(rank: int, world: int, store: str, local: str, remote: str, options: dict, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import shardstream
    from shardstream import Source

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    sources = [Source(local, weight=0.6, name="disk"), Source(remote, weight=0.4, name="s3", storage_options=options)]
    result: dict = {}
    for label in ("epochs", "steps"):
        # The run by steps crosses into a second data epoch.
        steps = None if label == "epochs" else result["epochs"]["0"]["len"] + 3
        dataset = shardstream.ShardStream(sources, batch_size=4, seed=7, shuffle=Shuffle(20), steps=steps)
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
            runs[str(epoch)] = {"keys": keys, "tags": tags, "batches": batches, "len": len(loader),
                                "planned": {s.name: s.used for s in plan.shares()}}
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
