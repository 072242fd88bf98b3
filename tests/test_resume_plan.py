"""Resume planning in one process, every (rank, worker) modelled over sample ids: an exact resume
yields the batches of the uninterrupted run, in order; an elastic resume delivers exactly the
samples not yet consumed, once (drop) or at least once (pad), in equal batches per rank."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardstream.errors import ConfigError, StateError
from shardstream.pipeline.shuffle import shuffle_samples, worker_rng
from shardstream.plan.epoch import plan_epoch
from shardstream.plan.resume import (
    ResumePlan,
    ResumeState,
    SampleIds,
    Segment,
    cut_stream,
    merge_round_robin,
)

SEED, EPOCH = 11, 3


def counts_for(num_shards: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed + 100 * num_shards)
    return [int(x) for x in rng.integers(1, 30, num_shards)]


def batches_of(chunks, batch: int, n: int) -> list[tuple[int, ...]]:
    flat = [int(x) for chunk in chunks for x in chunk]
    assert len(flat) >= n * batch
    return [tuple(flat[i * batch:(i + 1) * batch]) for i in range(n)]


def chunked(ids, rng: random.Random | None):
    """Ids as lists of random sizes (read blocks): the shuffle must not depend on the chunking."""
    ids = [int(x) for x in ids]
    if rng is None:
        return [ids]
    out, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 7)
        out.append(ids[i:i + step])
        i += step
    return out


def full_run(counts, seg: Segment, mode: str) -> list[list[tuple[int, ...]]]:
    """Per rank, the batches an uninterrupted epoch delivers, in DataLoader order."""
    plan = plan_epoch(counts, world_size=seg.world_size, num_workers=seg.num_workers, batch_size=seg.batch_size,
                      seed=SEED, epoch=EPOCH, mode=mode)
    ids = SampleIds(counts)
    ranks = []
    for rank in range(seg.world_size):
        per_worker = []
        for w in range(plan.num_workers):
            stream = ids.of_ranges(plan.ranges(rank, w, counts))
            out = shuffle_samples([list(stream)], buffer_size=seg.shuffle_buffer, initial=seg.shuffle_initial,
                                  rng=worker_rng(SEED, EPOCH, rank, w))
            per_worker.append(batches_of(out, seg.batch_size, plan.worker_batches(w)))
        ranks.append(merge_round_robin(per_worker))
    return ranks


def resumed_run(plan: ResumePlan, chunk_rng: random.Random | None = None) -> list[list[tuple[int, ...]]]:
    """Per rank, the batches the resumed pass delivers, in DataLoader order."""
    seg = plan.layout.segment
    ranks = []
    reads = []
    for rank in range(seg.world_size):
        per_worker = []
        for d in range(seg.num_workers):
            wr = plan.worker(rank, d)

            def read(ranges):
                reads.append(sum(len(r) for r in ranges))
                return chunked(plan.ids.of_ranges(ranges), chunk_rng)

            per_worker.append(batches_of(wr.samples(plan.ids, read), seg.batch_size, wr.num_batches)
                              if wr.num_batches else [])
        got = merge_round_robin(per_worker)
        assert len(got) == plan.batches_per_rank  # equal on every rank
        ranks.append(got)
    return ranks


def state_for(counts, seg: Segment, mode: str, received: int) -> ResumeState:
    return ResumeState(manifest="m", samples=sum(counts), seed=SEED, shuffle=True, mode=mode, epoch=EPOCH,
                       segments=(Segment(**{**seg.__dict__, "batches": received}),))


def seg_of(world, workers, batch, buffer=8, initial=3) -> Segment:
    return Segment(world, max(1, workers), batch, buffer, initial)


def positions(total: int) -> list[int]:
    return sorted({0, 1, total // 2, max(0, total - 1), total})


TOPOLOGIES = [seg_of(1, 1, 4), seg_of(2, 2, 3), seg_of(3, 2, 2, buffer=1), seg_of(2, 3, 5, buffer=20, initial=20),
              seg_of(4, 1, 1)]


@pytest.mark.parametrize("mode", ["drop", "pad"])
@pytest.mark.parametrize("counts", [[45], counts_for(7)], ids=["1shard", "7shards"])
@pytest.mark.parametrize("seg", TOPOLOGIES, ids=lambda s: f"{s.world_size}x{s.num_workers}x{s.batch_size}b{s.shuffle_buffer}")
def test_exact_resume_equals_the_uninterrupted_run(seg, counts, mode):
    reference = full_run(counts, seg, mode)
    total = len(reference[0])
    for n in positions(total):
        plan = ResumePlan(counts, state_for(counts, seg, mode, n), seg)
        assert plan.exact and plan.batches_per_rank == total - n
        got = resumed_run(plan, random.Random(n))
        assert got == [r[n:] for r in reference], f"received {n}"
        assert plan.state_after(len(got[0])).batches == total


def delivered(ranks) -> list[int]:
    return [x for r in ranks for b in r for x in b]


def check_elastic(after: list[int], unseen: list[int], plan: ResumePlan, mode: str) -> None:
    """``unseen``: the rest of the uninterrupted run (a multiset in pad mode)."""
    if mode == "drop":
        assert len(after) == len(set(after))  # once
        assert set(after) <= set(unseen)  # only what was not yet consumed
        assert len(after) + plan.dropped == len(unseen)  # all of it but the counted leftover
        assert plan.dropped < plan.layout.segment.world_size * plan.layout.segment.batch_size
    else:
        assert set(after) == set(unseen)  # at least once
        assert len(after) == len(unseen) + plan.repeated


@pytest.mark.parametrize("mode", ["drop", "pad"])
@pytest.mark.parametrize("old,new", [(a, b) for a, b in itertools.permutations(TOPOLOGIES, 2)],
                         ids=lambda s: f"{s.world_size}x{s.num_workers}x{s.batch_size}")
def test_elastic_resume_delivers_the_unseen_samples_once(old, new, mode):
    counts = counts_for(7)
    reference = full_run(counts, old, mode)
    total = len(reference[0])
    for n in positions(total):
        plan = ResumePlan(counts, state_for(counts, old, mode, n), new)
        assert not plan.exact
        after = delivered(resumed_run(plan))
        check_elastic(after, delivered([r[n:] for r in reference]), plan, mode)
        assert plan.summary().startswith(f"resuming epoch {EPOCH} elastically")


def test_chained_resumes_exact_then_elastic_then_exact():
    counts = counts_for(7)
    a, b, c = seg_of(2, 2, 3), seg_of(3, 1, 2), seg_of(1, 2, 5)
    reference = full_run(counts, a, "drop")
    seen = delivered([r[:4] for r in reference])
    first = ResumePlan(counts, state_for(counts, a, "drop", 4), b)  # 2 ranks became 3
    pass1 = resumed_run(first)
    state = ResumeState.from_json(json.loads(json.dumps(first.state_after(3).to_json())))
    seen += delivered([r[:3] for r in pass1])
    same = ResumePlan(counts, state, b)  # preempted again, same topology: exact
    assert same.exact and resumed_run(same) == [r[3:] for r in pass1]
    second = ResumePlan(counts, state, c)  # and then elastic onto another topology
    after = delivered(resumed_run(second))
    everything = delivered(reference)
    assert len(seen) + len(after) + first.dropped + second.dropped == len(everything)
    assert sorted(seen + after) == sorted(set(seen + after))
    assert set(seen + after) <= set(everything)


def test_resume_reads_back_at_most_one_buffer_per_worker():
    counts = [500] * 8
    seg = seg_of(2, 2, 10, buffer=100, initial=10)
    total = full_run(counts, seg, "drop")[0]
    n = int(len(total) * 0.9)
    plan = ResumePlan(counts, state_for(counts, seg, "drop", n), seg)
    for rank in range(2):
        for d in range(2):
            wr = plan.worker(rank, d)
            back, suffix = wr.reads(plan.ids)
            assert sum(len(r) for r in back) <= seg.shuffle_buffer
            stream_left = len(wr.stream) - wr.cut.taken
            assert sum(len(r) for r in suffix) == stream_left  # nothing consumed is read again


def test_cut_is_linear_and_matches_the_shuffle():
    rng_a, rng_b = random.Random(5), random.Random(5)
    out = [x for chunk in shuffle_samples([list(range(1000))], buffer_size=64, initial=8, rng=rng_a) for x in chunk]
    cut = cut_stream(1000, 600, buffer_size=64, initial=8, rng=rng_b)
    seen = set(out[:600])
    assert set(cut.buffered) | seen | set(range(cut.taken, 1000)) == set(range(1000))
    assert not (set(cut.buffered) & seen) and cut.taken - len(cut.buffered) == 600
    assert rng_b.random() != random.Random(5).random()  # the RNG was advanced, not reseeded


def test_state_refused_for_another_dataset_seed_mode_or_version():
    state = state_for([10, 10], seg_of(1, 1, 2), "drop", 3)
    doc = state.to_json()
    assert len(json.dumps(doc)) < 400
    ok = dict(manifest="m", samples=20, seed=SEED, shuffle=True, mode="drop")
    ResumeState.from_json(doc).check(**ok)
    with pytest.raises(StateError, match="another dataset"):
        state.check(**{**ok, "manifest": "other"})
    with pytest.raises(StateError, match=f"seed={SEED}"):
        state.check(**{**ok, "seed": 1})
    with pytest.raises(StateError, match="mode='drop'"):
        state.check(**{**ok, "mode": "pad"})
    with pytest.raises(StateError, match="version 99 is unknown"):
        ResumeState.from_json({**doc, "version": 99})
    with pytest.raises(StateError, match="not a shardstream resume state"):
        ResumeState.from_json({"epoch": 1})
    with pytest.raises(StateError, match="missing or mistypes"):
        ResumeState.from_json({**doc, "seed": "7"})
    with pytest.raises(StateError, match="has only"):
        ResumePlan([10, 10], state.advanced(99), seg_of(1, 1, 2))


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=9),
    old=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.integers(0, 12), st.integers(1, 12)),
    new=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.integers(0, 12), st.integers(1, 12)),
    where=st.floats(0, 1),
    mode=st.sampled_from(["drop", "pad"]),
)
def test_property_exact_and_elastic(counts, old, new, where, mode):
    assume(sum(counts) > 0)
    a, b = Segment(*old), Segment(*new)
    try:
        reference = full_run(counts, a, mode)
    except ConfigError:
        assume(False)
    total = len(reference[0])
    n = int(round(where * total))
    state = state_for(counts, a, mode, n)
    exact = ResumePlan(counts, state, a)
    assert resumed_run(exact, random.Random(n)) == [r[n:] for r in reference]
    plan = ResumePlan(counts, state, b)
    after = resumed_run(plan, random.Random(n))
    if plan.exact:
        assert after == [r[n:] for r in reference]
    else:
        check_elastic(delivered(after), delivered([r[n:] for r in reference]), plan, mode)
