"""The planning math, for every (rank, worker), in one process: exact, disjoint, equal, seeded."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardstream.errors import ConfigError
from shardstream.plan.epoch import plan_epoch


def uneven_counts(num_shards: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed + num_shards)
    return [int(x) for x in rng.integers(1, 60, num_shards)]


def assignments(counts, plan):
    """(rank, worker) -> list of global sample ids (shard, index) in read order."""
    out = {}
    for rank in range(plan.world_size):
        for worker in range(plan.num_workers):
            ids = []
            for r in plan.ranges(rank, worker, counts):
                assert 0 <= r.start < r.stop <= counts[r.shard]
                ids += [(r.shard, i) for i in range(r.start, r.stop)]
            out[rank, worker] = ids
    return out


def check_plan(counts, world, workers, batch, mode="drop", seed=0, epoch=0):
    try:
        plan = plan_epoch(counts, world_size=world, num_workers=workers, batch_size=batch, seed=seed, epoch=epoch, mode=mode)
    except ConfigError as exc:
        total = sum(counts)
        per_rank = total // (world * batch) if mode == "drop" else -(-total // (world * batch))
        assert per_rank == 0 or per_rank < max(workers, 1), f"unexpected ConfigError: {exc}"
        return None
    got = assignments(counts, plan)
    total = sum(counts)
    everything = [(s, i) for s, c in enumerate(counts) for i in range(c)]
    per_rank_batches = set()
    for rank in range(world):
        batches = 0
        for worker in range(plan.num_workers):
            n = len(got[rank, worker])
            assert n == plan.worker_batches(worker) * batch  # whole batches only
            batches += n // batch
        per_rank_batches.add(batches)
    assert per_rank_batches == {plan.batches_per_rank}  # equal on every rank
    flat = [x for ids in got.values() for x in ids]
    if mode == "drop":
        assert len(flat) == len(set(flat))  # no overlap anywhere
        assert set(flat) <= set(everything)
        assert len(flat) + plan.dropped == total  # the union is the dataset minus the counted drop
        assert plan.dropped < world * batch
    else:
        assert set(flat) == set(everything)  # nothing missing
        assert len(flat) - total == plan.repeated
    return plan, got


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("workers", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("num_shards", [1, 2, 7, 13, 64])
@pytest.mark.parametrize("batch", [1, 3, 32])
def test_grid_exact_disjoint_equal(world, workers, num_shards, batch):
    counts = uneven_counts(num_shards)
    result = check_plan(counts, world, workers, batch)
    if result is None:
        return
    plan, got = result
    again = plan_epoch(counts, world_size=world, num_workers=workers, batch_size=batch, seed=0, epoch=0)
    assert assignments(counts, again) == got  # every rank computes the same plan
    if num_shards > 2:
        other = plan_epoch(counts, world_size=world, num_workers=workers, batch_size=batch, seed=0, epoch=1)
        assert other.shard_order != plan.shard_order  # another epoch, another order
        assert assignments(counts, other) != got


@pytest.mark.parametrize("world,workers,num_shards,batch", [(2, 2, 7, 3), (3, 1, 2, 1), (8, 3, 64, 2)])
def test_pad_mode_repeats_and_counts(world, workers, num_shards, batch):
    counts = uneven_counts(num_shards)
    plan, _ = check_plan(counts, world, workers, batch, mode="pad")
    assert plan.dropped == 0 and plan.repeated == plan.world_size * plan.samples_per_rank - sum(counts)


def test_pad_mode_small_eval_set_wraps_many_times():
    plan, got = check_plan([2, 1], world=4, workers=1, batch=3, mode="pad")
    assert plan.batches_per_rank == 1 and plan.repeated == 9


def test_seed_and_epoch_determine_order():
    counts = uneven_counts(13)
    a = plan_epoch(counts, world_size=2, num_workers=2, batch_size=4, seed=5, epoch=3)
    b = plan_epoch(counts, world_size=2, num_workers=2, batch_size=4, seed=5, epoch=3)
    c = plan_epoch(counts, world_size=2, num_workers=2, batch_size=4, seed=6, epoch=3)
    assert a == b and a.shard_order != c.shard_order
    unshuffled = plan_epoch(counts, world_size=2, num_workers=2, batch_size=4, shuffle=False, epoch=9)
    assert unshuffled.shard_order == tuple(range(13))


def test_more_workers_than_shards_still_all_busy():
    counts = [100, 3]
    plan, got = check_plan(counts, world=2, workers=5, batch=4)
    assert all(len(ids) > 0 for ids in got.values())


@pytest.mark.parametrize(
    "counts,kwargs,message",
    [
        ([], dict(world_size=1, num_workers=0, batch_size=1), "empty"),
        ([0, 0], dict(world_size=1, num_workers=0, batch_size=1), "empty"),
        ([10], dict(world_size=2, num_workers=0, batch_size=8), "batch_size 8 x world_size 2 = 16 samples per step, but the dataset has only 10"),
        ([40], dict(world_size=2, num_workers=4, batch_size=8), "each rank gets 2 batches of 8 but num_workers is 4"),
        ([40], dict(world_size=2, num_workers=1, batch_size=0), "batch_size must be >= 1"),
    ],
)
def test_settings_that_cannot_work_fail_with_numbers(counts, kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        plan_epoch(counts, **kwargs)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 50), min_size=1, max_size=30),
    world=st.integers(1, 9),
    workers=st.integers(0, 6),
    batch=st.integers(1, 17),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 1000),
    mode=st.sampled_from(["drop", "pad"]),
)
def test_property_random_shapes(counts, world, workers, batch, seed, epoch, mode):
    assume(sum(counts) > 0)
    check_plan(counts, world, workers, batch, mode=mode, seed=seed, epoch=epoch)
