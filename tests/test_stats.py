"""stats.py: per-worker counters in shared memory, summed on the rank, visible across processes."""

from __future__ import annotations

import pickle

import torch

from shardstream.stats import COUNTERS, MAX_SLOTS, StreamStats


def test_totals_sum_every_worker_row():
    stats = StreamStats()
    stats.counters(0).add("bytes_read", 10)
    stats.counters(1).add("bytes_read", 5)
    stats.counters(1).add("retries")
    totals = stats.totals()
    assert set(totals) == set(COUNTERS)
    assert totals["bytes_read"] == 15 and totals["retries"] == 1 and totals["resumes"] == 0


def test_worker_ids_beyond_the_slots_share_rows_without_losing_counts():
    stats = StreamStats()
    stats.counters(3).add("ranges_opened")
    stats.counters(3 + MAX_SLOTS).add("ranges_opened")
    assert stats.totals()["ranges_opened"] == 2


class _Counting(torch.utils.data.IterableDataset):
    def __init__(self) -> None:
        self.stats = StreamStats()

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        self.stats.counters(info.id).add("bytes_read", 100 + info.id)
        yield info.id


def test_counts_from_real_workers_reach_the_main_process():
    ds = _Counting()
    assert sorted(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)) == [0, 1]
    assert ds.stats.totals()["bytes_read"] == 201


def test_a_plain_copy_is_a_snapshot():
    stats = StreamStats()
    stats.counters(0).add("retries", 2)
    copy = pickle.loads(pickle.dumps(stats))
    stats.counters(0).add("retries", 1)
    assert copy.totals()["retries"] == 2 and stats.totals()["retries"] == 3
