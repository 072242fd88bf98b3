"""Real processes: gloo DDP with 2 and 3 ranks, each with 2 DataLoader workers, streaming from local
disk and from the moto S3 server over HTTP, with a DDP training step per batch (unequal batch
counts would hang the collective; every process is bounded in time)."""

from __future__ import annotations

import datetime
import json
import os

import pytest
from conftest import rank_results, run_ranks, scaled, write_dataset


def _rank_main(rank: int, world: int, store: str, source: str, options: dict, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import shardstream

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=scaled(60)))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    dataset = shardstream.ShardStream(source, batch_size=4, seed=7, shuffle=shardstream.Shuffle(20), store=shardstream.Store(options=options))
    loader = shardstream.make_loader(dataset, num_workers=2)
    result = {}
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        keys, batches = [], 0
        for batch in loader:
            loss = model(batch["cls"].float().unsqueeze(1)).sum()
            loss.backward()  # all-reduce: a rank with fewer batches would hang here
            keys += batch["__key__"]
            batches += 1
        result[epoch] = {"keys": keys, "batches": batches, "len": len(loader)}
    result["plan"] = {e: {"dropped": dataset.plan(epoch=e).dropped} for e in (0, 1)}
    # Results go to a file per rank, not through dist.all_gather_object: with torch 2.13 a gloo
    # worker thread may drop the last reference to that call's Python-made tensors while the
    # interpreter shuts down, which aborts the process ("terminate called without an active
    # exception") after all the work is done. Tensors a collective used must outlive it.
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def run_ddp(world: int, source: str, options: dict, tmp_path) -> dict:
    out = str(tmp_path / "result.json")
    run_ranks(_rank_main, world, (world, str(tmp_path / "store"), source, options, out))
    ranks = rank_results(out, world)
    return {"ranks": ranks, "plan": ranks[0]["plan"]}


def check(result: dict, total: int) -> None:
    ranks = result["ranks"]
    for epoch in ("0", "1"):
        per_rank = [r[epoch] for r in ranks]
        assert len({r["batches"] for r in per_rank}) == 1  # equal on every rank
        assert all(r["batches"] == r["len"] for r in per_rank)
        keys = [set(r["keys"]) for r in per_rank]
        flat = [k for r in per_rank for k in r["keys"]]
        assert len(flat) == len(set(flat))  # disjoint across ranks and workers
        assert len(flat) == total - result["plan"][epoch]["dropped"]  # the union is what the plan says
        assert all(keys)
    assert ranks[0]["0"]["keys"] != ranks[0]["1"]["keys"]


@pytest.mark.slow
def test_ddp_two_ranks_local_disk(tmp_path):
    write_dataset(str(tmp_path / "ds"), 150, max_count=17)
    check(run_ddp(2, str(tmp_path / "ds"), {}, tmp_path), 150)


@pytest.mark.slow
def test_ddp_three_ranks_from_s3(s3, tmp_path):
    bucket, options, _ = s3
    write_dataset(f"s3://{bucket}/ddp", 130, max_count=17, storage_options=options)
    check(run_ddp(3, f"s3://{bucket}/ddp", options, tmp_path), 130)
