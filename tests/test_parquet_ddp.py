"""A Parquet table under real DDP: 2 ranks (gloo), 2 DataLoader workers each, columnar
batches through a DistributedDataParallel model: equal batches on every rank (a rank with fewer
would hang the all-reduce), every row once per epoch, a fresh order the next epoch. And the same
from a table on the moto S3 server: a SIGKILL mid-epoch and a resume from the saved loader state
exactly on 2 ranks (together the uninterrupted epoch, as each rank's loader gives it in the test's
process) and elastically on 1 (every row of the epoch once)."""

from __future__ import annotations

import datetime
import json
import os

import pytest
from conftest import launch_phase, rank_results, run_ranks, scaled
from test_parquet import ROWS, write_table

import shardstream


def _rank_main(rank: int, world: int, store: str, source: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import shardstream

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    dataset = shardstream.ShardStream(shardstream.Table(source, columns=["id", "x"]), batch_size=16, seed=7, shuffle=shardstream.Shuffle(100))
    loader = shardstream.make_loader(dataset, num_workers=2)
    result = {}
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        ids, batches = [], 0
        for batch in loader:
            loss = model(batch["x"].unsqueeze(1)).sum()
            loss.backward()  # all-reduce: a rank with fewer batches would hang here
            ids += batch["id"].tolist()
            batches += 1
        result[epoch] = {"ids": ids, "batches": batches, "len": len(loader), "dropped": dataset.plan(epoch=epoch).dropped}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_table_under_real_ddp(tmp_path):
    source = write_table(tmp_path / "table")
    out = str(tmp_path / "result.json")
    run_ranks(_rank_main, 2, (2, str(tmp_path / "store"), source, out))
    ranks = rank_results(out, 2)
    orders = []
    for epoch in ("0", "1"):
        per_rank = [r[epoch] for r in ranks]
        assert len({r["batches"] for r in per_rank}) == 1 and all(r["batches"] == r["len"] for r in per_rank)
        ids = [i for r in per_rank for i in r["ids"]]
        assert len(ids) == len(set(ids)) == sum(ROWS) - per_rank[0]["dropped"]
        orders.append(ids)
    assert orders[0] != orders[1]


S3_ROWS = (96, 80, 80)  # 256 rows in 8 row groups of 32: 2 ranks x 8 per batch x 16 batches
S3_GROUP = 32
STOP = 5  # batches per rank before the kill
S3_SETTINGS = dict(batch_size=8, seed=5, shuffle=shardstream.Shuffle(40))


def _s3_rank_main(rank: int, world: int, store: str, source: str, options: dict, work: str, phase: str, ready) -> None:
    """One rank over the S3 table: epoch 0 through DDP, the ids of every batch written as a JSON
    line; phase "crash" saves the loader state after STOP batches and waits to be killed; a phase
    that finds the saved state resumes from it."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=scaled(60)))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    dataset = shardstream.ShardStream(shardstream.Table(source, columns=["id", "x"]), **S3_SETTINGS, store=shardstream.Store(options=options))
    loader = shardstream.make_loader(dataset, num_workers=2, log_interval=None)
    saved = os.path.join(work, "loader.json")
    if phase != "crash":
        with open(saved) as f:
            loader.load_state_dict(json.load(f))
    else:
        loader.set_epoch(0)
    with open(os.path.join(work, f"{phase}.keys.{rank}"), "w") as out:
        for step, batch in enumerate(loader):
            model(batch["x"].unsqueeze(1)).sum().backward()  # all-reduce: unequal batch counts would hang here
            out.write(json.dumps(batch["id"].tolist()) + "\n")
            out.flush()
            if phase == "crash" and step + 1 == STOP:
                if rank == 0:  # one rank's state is enough: every rank received the same count
                    with open(saved + ".tmp", "w") as f:
                        json.dump(loader.state_dict(), f)
                    os.replace(saved + ".tmp", saved)
                dist.barrier()
                ready.put(rank)
                time.sleep(600)  # killed here, mid-epoch, workers and all
    dist.destroy_process_group()


def _s3_reference(source: str, options: dict, world: int) -> list[list[list[int]]]:
    """Epoch 0's batches of ids per rank, each rank's loader run in this process."""
    out = []
    for rank in range(world):
        table, store = shardstream.Table(source, columns=["id", "x"]), shardstream.Store(options=options)
        dataset = shardstream.ShardStream(table, **S3_SETTINGS, world=shardstream.World(rank, world), store=store)
        loader = shardstream.make_loader(dataset, num_workers=2, log_interval=None)
        loader.set_epoch(0)
        out.append([batch["id"].tolist() for batch in loader])
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_s3_table_under_real_ddp_exact_epoch_kill_and_resume(s3, tmp_path):
    bucket, options, client = s3
    root = write_table(tmp_path / "table", rows=S3_ROWS, group=S3_GROUP)
    for f in sorted(os.listdir(root)):
        client.upload_file(f"{root}/{f}", bucket, f"table/{f}")
    source, work, total = f"s3://{bucket}/table/", str(tmp_path), sum(S3_ROWS)
    # The uninterrupted epoch, rank by rank in this process (the order does not depend on DDP; the
    # DDP runs below must reproduce it): equal batches on both ranks, every row once across ranks.
    full = _s3_reference(source, options, 2)
    assert len(full[0]) == len(full[1]) == total // 16
    ids = [i for rank in full for batch in rank for i in batch]
    assert sorted(ids) == list(range(total))
    # Killed with SIGKILL after STOP batches, then resumed on the same topology: exactly the rest.
    crashed = launch_phase(_s3_rank_main, 2, work, "crash", (source, options))
    assert [rank[:STOP] for rank in crashed] == [rank[:STOP] for rank in full]
    same = launch_phase(_s3_rank_main, 2, work, "same", (source, options))
    assert same == [rank[STOP:] for rank in full]
    # Elastic: the same state onto one rank; every row of the epoch once over both runs.
    one = launch_phase(_s3_rank_main, 1, work, "one", (source, options))
    before = [i for rank in crashed for batch in rank[:STOP] for i in batch]
    after = [i for batch in one[0] for i in batch]
    table, store = shardstream.Table(source, columns=["id", "x"]), shardstream.Store(options=options)
    probe = shardstream.ShardStream(table, **S3_SETTINGS, world=shardstream.World(0, 1), store=store)
    with open(tmp_path / "loader.json") as f:
        probe.load_state_dict(json.load(f))
    dropped = probe.resume_plan(2).dropped
    assert len(before + after) == len(set(before + after))  # no row twice
    assert len(before + after) + dropped == total and dropped < 8  # drop mode: less than a batch left out
