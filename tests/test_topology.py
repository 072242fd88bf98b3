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
