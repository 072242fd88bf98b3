"""Mix planning for every (rank, worker) in one process: quotas, per-batch proportions, no sample
twice unless asked, equal batches per rank, the same plan everywhere, exact integral repeats."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardstream.errors import ConfigError
from shardstream.plan.mix import Ask, apportion, plan_mix, quotas


def shard_counts(num_shards: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(1, 40, num_shards)]


def expand(plan, begin, end):
    """Positions [begin, end) of the mixed sequence as (source, shard, index) in order."""
    ranges, pattern = plan.reads(begin, end)
    streams = [iter([(i, r.shard, k) for r in rs for k in range(r.start, r.stop)]) for i, rs in enumerate(ranges)]
    out = [next(streams[i]) for i in pattern]
    assert all(next(s, None) is None for s in streams)  # the ranges hold exactly what the pattern takes
    return out


def assignments(plan):
    return {(r, w): expand(plan, *plan.worker_slice(r, w)) for r in range(plan.world_size) for w in range(plan.num_workers)}


def check_mix(counts, asks, world, workers, batch, per_batch="spread", seed=0, epoch=0):
    plan = plan_mix(counts, asks, world_size=world, num_workers=workers, batch_size=batch, seed=seed, epoch=epoch, per_batch=per_batch)
    got = assignments(plan)
    for rank in range(world):  # whole batches, the same number on every rank
        assert sum(len(got[rank, w]) for w in range(plan.num_workers)) == plan.batches_per_rank * batch
        for w in range(plan.num_workers):
            assert len(got[rank, w]) == plan.worker_batches(w) * batch
    flat = [x for ids in got.values() for x in ids]
    # The whole used sequence, in order, is what the workers read between them.
    assert sorted(flat) == sorted(expand(plan, 0, plan.used_samples))
    used = Counter(x[0] for x in flat)
    shares = plan.shares()
    for i, s in enumerate(shares):
        assert s.used == used.get(i, 0)
        assert s.used + s.dropped == s.quota == plan.quotas[i]
    assert sum(s.dropped for s in shares) == plan.dropped
    # Every batch carries every source in proportion: within the bound in plan/mix.py (spread), exactly (exact).
    for ids in got.values():
        for b in range(0, len(ids), batch):
            per_source = Counter(x[0] for x in ids[b : b + batch])
            for i, q in enumerate(plan.quotas):
                if per_batch == "exact":
                    assert per_source.get(i, 0) == plan.per_batch_counts[i]
                else:
                    # |count - L*q/T| < (1 - p) + p*(m - 1) for m sources with share p = q/T: each
                    # source's key interval count is off by < 1, and the others' errors shift the window.
                    p_i = q / plan.total_samples
                    m = sum(1 for x in plan.quotas if x)
                    assert abs(per_source.get(i, 0) - batch * p_i) < (1 - p_i) + p_i * max(1, m - 1) + 1e-9
    # Samples of a source repeat only when its quota exceeds its size, and then evenly.
    seen = Counter(flat)
    for i, n in enumerate(plan.sizes):
        times = Counter(seen[(i, s, k)] for s, c in enumerate(counts[i]) for k in range(c))
        most = -(-plan.quotas[i] // n)
        assert max(times) <= most
        if plan.quotas[i] <= n:
            assert max(times) <= 1
    again = plan_mix(counts, asks, world_size=world, num_workers=workers, batch_size=batch, seed=seed, epoch=epoch, per_batch=per_batch)
    assert again == plan and assignments(again) == got  # every rank computes the same plan
    return plan, got


def test_quotas_weights_repeat_samples():
    q, t = quotas([100, 50, 30], [Ask(weight=0.5), Ask(weight=0.5), Ask(repeat=2.5)])
    assert q == [50, 50, 75] and t == [50.0, 50.0, 75.0]  # the 50-sample source limits the weighted group
    q, _ = quotas([100, 1000], [Ask(weight=0.7), Ask(weight=0.3)])
    assert q == [100, 42]  # 100 / 0.7 = 142.857 samples in the group
    q, _ = quotas([10, 7], [Ask(samples=25), Ask(repeat=0.5)])
    assert q == [25, 4]  # round(3.5) = 4 (half up)
    assert apportion(10, [1, 1, 1]) == [4, 3, 3] and sum(apportion(64, [0.7, 0.2, 0.1])) == 64


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("batch", [1, 4, 10])
@pytest.mark.parametrize("per_batch", ["spread", "exact"])
def test_grid(world, workers, batch, per_batch):
    counts = [shard_counts(5, 1), shard_counts(3, 2), shard_counts(9, 3)]
    asks = [Ask(weight=0.6), Ask(weight=0.4), Ask(repeat=1.5)]
    try:
        plan, _ = check_mix(counts, asks, world, workers, batch, per_batch=per_batch)
    except ConfigError as exc:
        assert per_batch == "exact" and batch < 10 and "too small" in str(exc)
        return
    other = plan_mix(counts, asks, world_size=world, num_workers=workers, batch_size=batch, epoch=1, per_batch=per_batch)
    assert assignments(other) != assignments(plan)  # another epoch, another order


def test_integral_repeat_is_exact_and_fractional_in_expectation():
    counts = [[7, 5, 9], [4, 4]]
    plan = plan_mix(counts, [Ask(repeat=3), Ask(repeat=0.25)], world_size=1, num_workers=1, batch_size=1)
    seq = expand(plan, 0, plan.total_samples)
    seen = Counter(seq)
    assert all(seen[(0, s, k)] == 3 for s, c in enumerate(counts[0]) for k in range(c))  # each sample exactly 3 times
    assert sum(1 for x in seq if x[0] == 1) == 2  # 0.25 of 8
    # Over many epochs each sample of the fractional source is picked a quarter of the time.
    hits: Counter = Counter()
    epochs = 800
    for e in range(epochs):
        p = plan_mix(counts, [Ask(repeat=3), Ask(repeat=0.25)], world_size=1, num_workers=1, batch_size=1, epoch=e)
        hits.update(x for x in expand(p, 0, p.total_samples) if x[0] == 1)
    assert len(hits) == 8 and all(abs(h / epochs - 0.25) < 0.06 for h in hits.values())


def test_summary_reports_every_source():
    plan = plan_mix([[30, 30], [10]], [Ask(weight=3), Ask(weight=1)], world_size=2, num_workers=1, batch_size=4, names=["web", "curated"])
    text = plan.summary()
    assert "web: " in text and "curated: " in text and "asked 0.7500" in text and "asked 0.2500" in text
    web, cur = plan.shares()
    assert (web.quota, cur.quota) == (30, 10) and web.unseen == 30 + web.dropped and cur.repeated == 0


@pytest.mark.parametrize(
    "counts,asks,kwargs,message",
    [
        ([[5], [0]], [Ask(weight=1), Ask(weight=1)], {}, "source 'b' is empty"),
        ([[5], [5]], [Ask(weight=1), Ask(repeat=0.01)], {}, "source 'b' \\(repeat 0.01\\) gets 0 samples"),
        ([[50], [50]], [Ask(weight=0.95), Ask(weight=0.05)], dict(per_batch="exact"), "batch_size 8 is too small to carry source 'b'"),
        ([[5], [5]], [Ask(weight=1), Ask(weight=1)], {}, "8 x world_size 2 = 16 samples per step, but an epoch of this mix has only 10"),
        ([[50], [50]], [Ask(weight=1), Ask(weight=1)], dict(num_workers=9), "num_workers is 9"),
        ([[50]], [Ask(weight=1)], dict(per_batch="some"), "per_batch must be one of"),
    ],
)
def test_settings_that_cannot_work(counts, asks, kwargs, message):
    kw = dict(world_size=2, num_workers=1, batch_size=8, names=["a", "b"][: len(counts)]) | kwargs
    with pytest.raises(ConfigError, match=message):
        plan_mix(counts, asks, **kw)


@pytest.mark.parametrize("bad", [dict(), dict(weight=1, repeat=1), dict(weight=0), dict(repeat=-1), dict(samples=2.5), dict(weight=float("nan"))])
def test_bad_asks(bad):
    with pytest.raises(ConfigError):
        Ask(**bad)


ask_strategy = st.one_of(
    st.builds(lambda w: Ask(weight=w), st.floats(0.05, 5)),
    st.builds(lambda r: Ask(repeat=r), st.floats(0.2, 3)),
    st.builds(lambda n: Ask(samples=n), st.integers(5, 200)),
)


@settings(max_examples=150, deadline=None)
@given(
    counts=st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=6), min_size=1, max_size=4),
    data=st.data(),
    world=st.integers(1, 4),
    workers=st.integers(0, 3),
    batch=st.integers(1, 12),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 1000),
    per_batch=st.sampled_from(["spread", "exact"]),
)
def test_property_random_mixes(counts, data, world, workers, batch, seed, epoch, per_batch):
    assume(all(sum(c) > 0 for c in counts))
    asks = [data.draw(ask_strategy) for _ in counts]
    try:
        plan_mix(counts, asks, world_size=world, num_workers=workers, batch_size=batch, seed=seed, epoch=epoch, per_batch=per_batch)
    except ConfigError:
        return
    check_mix(counts, asks, world, workers, batch, per_batch=per_batch, seed=seed, epoch=epoch)


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.floats(0.05, 1), min_size=2, max_size=4),
    sizes=st.lists(st.integers(200, 600), min_size=4, max_size=4),
    batch=st.integers(8, 32),
)
def test_property_shares_hold_over_many_epochs(weights, sizes, batch):
    """Realised shares over 20 epochs stay within a few samples per epoch of the asked weights."""
    counts = [[n // 3, n // 3, n - 2 * (n // 3)] for n in sizes[: len(weights)]]
    asks = [Ask(weight=w) for w in weights]
    used = np.zeros(len(weights))
    epochs = 20
    for e in range(epochs):
        try:
            plan = plan_mix(counts, asks, world_size=2, num_workers=2, batch_size=batch, seed=3, epoch=e)
        except ConfigError:
            return
        used += [s.used for s in plan.shares()]
    asked = np.array(weights) / sum(weights)
    # Per epoch: quotas within 1 of the weights, the dropped tail within 2 per source.
    assert np.all(np.abs(used - asked * used.sum()) <= 3 * epochs + 1)


def test_no_sample_twice_when_every_repeat_at_most_one_across_epochs_of_ranks():
    counts = [shard_counts(6, 9), shard_counts(4, 10)]
    for e, per_batch in itertools.product(range(5), ["spread", "exact"]):
        plan, got = check_mix(counts, [Ask(repeat=1.0), Ask(weight=1.0)], 3, 2, 5, per_batch=per_batch, epoch=e)
        flat = [x for ids in got.values() for x in ids]
        assert len(flat) == len(set(flat))


def test_pad_mode_ranges_of_a_slice_that_wraps_past_the_end_of_the_mix():
    """In pad mode the last slices run past the mixed sequence, which starts again: ``ranges`` reads
    each lap as positions of the sequence (it raised ValueError there)."""
    plan = plan_mix([[7, 5, 3], [4, 4]], [Ask(weight=0.6), Ask(weight=0.4)], world_size=3, num_workers=3, batch_size=3, mode="pad")
    size = plan.total_samples
    assert plan.used_samples > size
    wrapped = 0
    for rank in range(3):
        for worker in range(3):
            begin, end = plan.worker_slice(rank, worker)
            wrapped += end > size
            expected: Counter = Counter()
            for p in range(begin, end):
                expected.update(expand(plan, p % size, p % size + 1))
            got = Counter((i, r.shard, k) for i, rs in enumerate(plan.ranges(rank, worker)) for r in rs for k in range(r.start, r.stop))
            assert got == expected
    assert wrapped
