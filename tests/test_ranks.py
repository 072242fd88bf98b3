"""The slowest rank, named (shardstream/ranks.py): the wait meter and its report in one process,
and real gloo ranks with one made slow (a sleep in its transform, or its S3 endpoint behind a
proxy that adds latency) named by every rank's report, with what it waited on."""

from __future__ import annotations

import datetime
import json
import os
import time

import pytest
from conftest import rank_results, run_ranks, scaled, write_dataset
from faultproxy import FaultProxy

import shardstream
from shardstream.ranks import BINS, ROW, WaitMeter, describe, gather, report


class Sleepy:
    """A transform that sleeps ``seconds`` per sample (0: none)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, sample: dict) -> dict:
        if self.seconds:
            time.sleep(self.seconds)
        return sample


def slow_collate(batch):
    time.sleep(0.05)  # in the worker, after batching: no stage the counters time
    return batch


def test_the_meter_reads_percentiles_from_a_bounded_histogram():
    meter = WaitMeter(every=100)
    for _ in range(98):
        meter.record(0.001, 0.1)
    meter.record(0.5, 0.6)
    meter.record(2.0, 2.1)
    row = meter.row({}, workers=2)
    assert len(row) == ROW  # the same size for 100 waits or a million
    out = report([row])
    entry = out["ranks"][0]
    assert entry["batches"] == 100
    assert 0.0008 < entry["wait_p50_s"] < 0.0013  # within a bin (26%) of 1 ms
    assert 0.4 < entry["wait_p99_s"] <= 0.5
    assert entry["wait_max_s"] == 2.0
    assert entry["wait_s"] == pytest.approx(98 * 0.001 + 2.5)
    assert entry["wait_share"] == pytest.approx(entry["wait_s"] / (98 * 0.1 + 2.7))
    assert entry["cause"] == "worker"  # no stage time counted at all


def test_the_cause_is_the_stage_the_workers_spent_most_in():
    meter = WaitMeter(every=10)
    meter.record(1.0, 1.0)
    stages = {"storage_wait_us": 300_000, "decode_us": 1_800_000, "transform_us": 100_000, "requests": 4}
    decoding = meter.row(stages, workers=2)
    storing = meter.row({**stages, "storage_wait_us": 5_000_000}, workers=2)
    little = meter.row({"storage_wait_us": 100_000, "decode_us": 100_000, "transform_us": 0}, workers=2)
    out = report([decoding, storing, little])
    assert [e["cause"] for e in out["ranks"]] == ["decode", "storage", "worker"]  # 0.1 s per worker explains no 1 s wait
    assert out["ranks"][1]["requests"] == 4 and out["ranks"][1]["storage_s"] == 5.0
    assert out["slowest_rank"] == 0  # equal waits: the lowest rank
    idle = WaitMeter(every=10)
    idle.record(0.0, 0.1)
    assert report([idle.row({}, 1)])["ranks"][0]["cause"] is None


def test_the_slowest_rank_is_the_one_that_waited_longest():
    rows = []
    for wait, host in ((0.01, "h0"), (0.4, "node-17.cluster.example.com"), (0.02, "h0")):
        meter = WaitMeter(every=5)
        meter.host = host
        for _ in range(5):
            meter.record(wait, 0.5)
        rows.append(meter.row({"transform_us": int(wait * 5e6)}, workers=1))
    out = report(rows, batches=5)
    assert [e["host"] for e in out["ranks"]] == ["h0", "node-17.cluster.example.com", "h0"]  # carried in the row
    assert out["slowest_rank"] == 1 and out["slowest_cause"] == "transform"
    assert out["slowest_wait_share"] == pytest.approx(0.8)
    assert out["wait_share_max"] == pytest.approx(0.8)
    line = describe(out)
    assert line.startswith("slowest rank 1 on node-17.cluster.example.com of 3 waited 80% of its step time") and "mostly on the transform" in line
    json.dumps(out)  # a plain dict, to log as it is


def test_reports_fall_due_at_batch_counts_every_rank_computes_alike():
    fixed = WaitMeter(every=3)
    seen = []
    for n in range(1, 10):
        fixed.record(0.0, 0.1)
        if fixed.due():
            seen.append(n)
            gather(fixed, {})
    assert seen == [3, 6, 9]
    assert not WaitMeter(every=0).due(10**6)  # 0: never
    timed = WaitMeter(interval_s=2.0)  # every 2 s of the slowest rank's steps
    for _ in range(20):
        timed.record(0.0, 0.05)
    assert timed.due()
    slow = WaitMeter(every=1)
    for _ in range(20):
        slow.record(0.2, 0.25)
    timed.reported([timed.row({}, 1), slow.row({}, 1)], {})
    assert timed.next_due == 20 + 8  # 2 s / 0.25 s, from the slowest rank's row: the same on every rank
    with pytest.raises(ValueError):
        WaitMeter(every=-1)


def test_a_loader_reports_its_own_rank_without_a_process_group(tmp_path):
    source = write_dataset(tmp_path / "ds", 64, max_count=16)
    dataset = shardstream.ShardStream(source, batch_size=4, shuffle=False, transform=Sleepy(0.01))
    loader = shardstream.make_loader(dataset, num_workers=2, log_interval=None)
    loader.rank_meter = WaitMeter(every=8)
    assert loader.rank_report() is None
    assert sum(1 for _ in loader) == 16
    out = loader.rank_report()
    assert out["world"] == 1 and out["batches"] == 16 and out["ranks"][0]["batches"] == 8  # the second report: batches 9-16
    assert out["slowest_rank"] == 0 and out["slowest_cause"] == "transform"
    assert out["ranks"][0]["transform_s"] >= 8 * 4 * 0.01 * 0.9
    assert loader.stats()["transform_us"] >= 64 * 0.01 * 1e6 * 0.9


def test_a_slow_collate_in_the_workers_is_named_a_worker_wait(tmp_path):
    source = write_dataset(tmp_path / "ds", 48, max_count=12)
    dataset = shardstream.ShardStream(source, batch_size=4, shuffle=False)
    loader = shardstream.make_loader(dataset, num_workers=2, log_interval=None, collate_fn=slow_collate)
    loader.rank_meter = WaitMeter(every=6)
    assert sum(1 for _ in loader) == 12
    assert loader.rank_report()["slowest_cause"] == "worker"


def test_the_periodic_log_names_the_slowest_rank(tmp_path, caplog):
    source = write_dataset(tmp_path / "ds", 32, max_count=16)
    dataset = shardstream.ShardStream(source, batch_size=4, shuffle=False, transform=Sleepy(0.01))
    loader = shardstream.make_loader(dataset, num_workers=0, log_interval=60.0)
    loader.rank_meter = WaitMeter(every=4)
    with caplog.at_level("INFO", logger="shardstream.ranks"):
        assert sum(1 for _ in loader) == 8
    lines = [r.getMessage() for r in caplog.records if r.name == "shardstream.ranks"]
    assert len(lines) == 2 and all("slowest rank 0" in line and "mostly on the transform" in line for line in lines)


# -- real ranks ----------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, store: str, source: str, options: dict, slow: dict, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=scaled(60)))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    transform = Sleepy(slow["transform"] if rank == slow["rank"] else 0.0)
    endpoint = slow["endpoint"] if rank == slow["rank"] and "endpoint" in slow else options.get("endpoint_url")
    store_options = {"endpoint_url": endpoint} if endpoint else {}
    # No read-ahead: in so small a dataset a worker's 64 MiB would fetch it all while the workers
    # start, before the middle of the pass; here each shard is read as its batch is made.
    store = shardstream.Store(options=store_options, read=shardstream.Read(readahead_bytes=0))
    dataset = shardstream.ShardStream(source, batch_size=4, seed=3, shuffle=False, transform=transform, store=store)
    loader = shardstream.make_loader(dataset, num_workers=2, log_interval=None)
    loader.rank_meter = WaitMeter(every=len(loader) // 3)
    reports = []
    for batch in loader:
        model(batch["cls"].float().unsqueeze(1)).sum().backward()  # all-reduce: the fast ranks wait here, not for data
        if loader.rank_report() is not (reports[-1] if reports else None):
            reports.append(loader.rank_report())
    with open(f"{out}.{rank}", "w") as f:
        json.dump(reports, f)
    dist.destroy_process_group()


def _run(tmp_path, world: int, source: str, options: dict, slow: dict) -> list:
    out = str(tmp_path / "report")
    run_ranks(_rank_main, world, (world, str(tmp_path / "store"), source, options, slow, out), timeout=90)
    return rank_results(out, world)


def middle(reports: list) -> dict:
    """Every rank's reports are the same; the second of three covers the pass's steady middle (the
    first has the workers' start, the last the pass's end, where workers have finished early)."""
    assert len(reports[0]) == 3 and all(r == reports[0] for r in reports)
    return reports[0][1]


def test_three_ranks_name_the_one_with_a_slow_transform(tmp_path):
    source = write_dataset(tmp_path / "ds", 288, max_count=16)  # 3 ranks x 24 batches of 4
    out = middle(_run(tmp_path, 3, source, {}, {"rank": 1, "transform": 0.01}))
    assert out["world"] == 3 and out["batches"] == 16 and all(e["batches"] == 8 for e in out["ranks"])
    assert out["slowest_rank"] == 1 and out["slowest_cause"] == "transform", out
    others = [e["wait_s"] for e in out["ranks"] if e["rank"] != 1]
    assert out["slowest"]["wait_s"] > 2 * max(others)


def test_two_ranks_name_the_one_behind_a_slow_s3_link(s3, tmp_path):
    bucket, options, _ = s3
    source = write_dataset(f"s3://{bucket}/slow", 192, max_count=4, size=20_000, storage_options=options)  # 2 MB, a shard a batch
    with FaultProxy(options["endpoint_url"], bandwidth=250_000) as proxy:  # 250 kB/s: 0.16 s a shard
        out = middle(_run(tmp_path, 2, source, options, {"rank": 0, "transform": 0.0, "endpoint": proxy.url}))
    assert out["slowest_rank"] == 0 and out["slowest_cause"] == "storage", out
    assert out["slowest"]["bytes_read"] > 0 and out["ranks"][1]["wait_s"] < out["slowest"]["wait_s"] / 2


def test_bins_cover_waits_from_microseconds_to_minutes():
    meter = WaitMeter(every=1)
    for wait in (0.0, 1e-6, 30.0, 5000.0):
        meter.record(wait, wait)
    assert sum(meter.hist) == 4 and meter.hist[0] == 2 and meter.hist[BINS - 1] == 1


def test_a_report_where_no_rank_waits_says_so():
    meter = WaitMeter(every=4)
    for _ in range(4):
        meter.record(0.001, 0.1)
    meter.host = "gpu-3"
    assert describe(report([meter.row({}, 2)])).startswith("no rank waits on data: the slowest, rank 0 on gpu-3 of 1, 1% of its step time")
