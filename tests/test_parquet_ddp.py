"""A Parquet table under real DDP: 2 spawned ranks (gloo), 2 DataLoader workers each, columnar
batches through a DistributedDataParallel model: equal batches on every rank (a rank with fewer
would hang the all-reduce), every row once per epoch, a fresh order the next epoch."""

from __future__ import annotations

import datetime
import json
import os

import pytest
from conftest import rank_results, run_ranks
from test_parquet import ROWS, write_table


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
