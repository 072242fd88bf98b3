"""plan/topology.py: the one place that asks who we are."""

from __future__ import annotations

import pytest
import torch

from shardstream.plan.topology import World, current_worker


def test_explicit_values_win(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert World.detect(1, 2) == World(1, 2)


def test_torchrun_environment_then_default(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert World.detect() == World(3, 8)
    monkeypatch.delenv("RANK")
    assert World.detect() == World(0, 1)


@pytest.mark.parametrize("rank,size", [(-1, 2), (2, 2), (0, 0)])
def test_impossible_worlds_are_refused(rank, size):
    with pytest.raises(ValueError, match="not in a world"):
        World(rank, size)


def test_half_given_is_refused():
    with pytest.raises(ValueError, match="both rank and world_size"):
        World.detect(rank=1)


class _WhoAmI(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield current_worker()


def test_current_worker_in_the_main_process_and_in_real_workers():
    assert current_worker() == (0, 1)
    seen = list(torch.utils.data.DataLoader(_WhoAmI(), batch_size=None, num_workers=2))
    assert sorted(tuple(x) for x in seen) == [(0, 2), (1, 2)]


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
def test_the_worker_split_follows_dataloaders_round_robin_in_contiguous_slices(workers):
    from shardstream.plan.topology import consumed_in, worker_share

    for t0, t1 in [(0, 0), (0, 7), (0, 10), (3, 4), (5, 17), (11, 30)]:
        start = 0
        for w in range(workers):
            before, count = worker_share(t0, t1, workers, w)
            assert before == start and count == sum(1 for t in range(t0, t1) if t % workers == w)
            start += count
            for received in range(t1 + 2):  # the loop received batches [0, received) of the pass, in order
                assert consumed_in(t0, t1, received, workers, w) == sum(1 for t in range(t0, min(t1, received)) if t % workers == w)
        assert start == t1 - t0  # the slices cover the window, in worker order
    base, extra = divmod(10, workers)  # a whole epoch: the first R % K workers get one batch more
    assert [worker_share(0, 10, workers, w)[1] for w in range(workers)] == [base + (w < extra) for w in range(workers)]


def test_one_batch_count_and_one_worker_split_for_every_plan():
    """The batch count per rank and the worker split are written once (topology.py): a dataset's
    plan, a mix's and the request count's all-slices-at-once view agree with them."""
    from shardstream.plan.epoch import plan_epoch
    from shardstream.plan.mix import Ask, plan_mix
    from shardstream.plan.topology import batches_per_rank, worker_share, worker_starts

    for batches in range(1, 30):
        for k in range(1, 9):
            assert worker_starts(batches, k) == [worker_share(0, batches, k, w)[0] for w in range(k)]
    counts = [7, 0, 13, 5, 11, 9, 3]
    for mode in ("drop", "pad"):
        assert batches_per_rank(48, 2, 5, mode) == (4 if mode == "drop" else 5)
        one = plan_epoch(counts, world_size=2, num_workers=3, batch_size=2, mode=mode, seed=1)
        mix = plan_mix([counts, [4, 6]], [Ask(weight=2), Ask(weight=1)], world_size=2, num_workers=3, batch_size=2, mode=mode, seed=1)
        for plan in (one, mix):
            assert plan.batches_per_rank == batches_per_rank(plan.total_samples, 2, 2, mode)
            begins = [plan.worker_slice(r, w)[0] for r in range(2) for w in range(3)]
            assert plan.slice_begins().tolist() == begins


def test_a_pass_plan_is_built_whole():
    """A PassPlan is not changed once built: its summary is rendered from what it holds."""
    import dataclasses

    import numpy as np

    from shardstream.plan.run import RunPlan, RunSettings, Sources

    run = RunPlan(Sources.of([np.array([10, 10, 10])], ["m"]), RunSettings(0, True, "drop", "spread", 1, 2, 0, 0))
    plan = run.pass_plan(0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.received = 3  # type: ignore[misc]
    assert plan.summary().startswith("epoch 0: 30 samples over 3 shards")
