"""Resume planning for one dataset, in one process, every (rank, worker) modelled over sample ids
(tests/schedule_sim.py): an exact resume yields the batches of the uninterrupted run, in order;
an elastic resume delivers exactly the samples not yet consumed, once (drop) or at least once
(pad), in equal batches per rank; states of version 1 keep loading."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from schedule_sim import SEED, counts_for, deliver_all, flat, make_run, make_sources, through_json

from shardstream.errors import ConfigError, StateError
from shardstream.plan.shuffle import cut_stream
from shardstream.plan.state import State

EPOCH = 3
# (world, workers, batch, buffer, initial)
TOPOLOGIES = [(1, 1, 4, 8, 3), (2, 2, 3, 8, 3), (3, 2, 2, 1, 1), (2, 3, 5, 20, 20), (4, 1, 1, 8, 3)]


def run_for(counts, topo, mode="drop"):
    world, _, batch, buffer, initial = topo
    return make_run(make_sources([counts]), world=world, batch=batch, buffer=buffer, initial=initial, mode=mode)


def pass_for(counts, topo, mode="drop"):
    return run_for(counts, topo, mode).pass_plan(EPOCH, topo[1])


def resumed(counts, topo, state, mode="drop"):
    run = run_for(counts, topo, mode)
    return run.pass_plan(EPOCH, topo[1], run.load(through_json(state)), resumed=True)


def positions(total: int) -> list[int]:
    return sorted({0, 1, total // 2, max(0, total - 1), total})


def topology_id(t):
    return "{}x{}x{}b{}".format(*t)


@pytest.mark.parametrize("mode", ["drop", "pad"])
@pytest.mark.parametrize("counts", [[45], counts_for(7)], ids=["1shard", "7shards"])
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=topology_id)
def test_exact_resume_equals_the_uninterrupted_run(topo, counts, mode):
    plan = pass_for(counts, topo, mode)
    reference = deliver_all(plan)
    total = len(reference[0])
    for n in positions(total):
        again = resumed(counts, topo, plan.state_after(n), mode)
        assert again.exact and again.batches_per_rank == total - n
        assert deliver_all(again, random.Random(n)) == [r[n:] for r in reference], f"received {n}"
        assert again.state_after(total - n)["segments"][-1]["batches"] == total


def check_elastic(after, rest, consumed, plan, mode, world, batch) -> None:
    """``rest``: what the uninterrupted run would still have delivered; ``consumed``: what it did."""
    if mode == "drop":
        assert len(after) == len(set(after))  # once
        assert set(after) <= set(rest)  # only what was not yet consumed
        assert len(after) + plan.dropped == len(rest)  # all of it but the counted leftover
        assert plan.dropped < world * batch
    else:
        unseen = set(rest) - set(consumed)
        assert set(after) == unseen  # every unseen sample, at least once
        assert len(after) == len(unseen) + plan.repeated  # padded to a multiple of world x batch, no more
        assert len(after) % (world * batch) == 0 and plan.repeated < world * batch


@pytest.mark.parametrize("mode", ["drop", "pad"])
@pytest.mark.parametrize("old,new", list(itertools.permutations(TOPOLOGIES, 2)), ids=topology_id)
def test_elastic_resume_delivers_the_unseen_samples_once(old, new, mode):
    counts = counts_for(7)
    plan = pass_for(counts, old, mode)
    reference = deliver_all(plan)
    total = len(reference[0])
    for n in positions(total)[1:]:
        again = resumed(counts, new, plan.state_after(n), mode)
        assert not again.exact
        check_elastic(flat(deliver_all(again)), flat([r[n:] for r in reference]), flat([r[:n] for r in reference]), again, mode, new[0], new[2])
        assert again.summary().startswith(f"resuming epoch {EPOCH} elastically")


def test_elastic_pad_resume_pads_to_world_times_batch_not_times_workers():
    """The issue's numbers: 2 ranks x 2 workers -> 3 ranks x 2 workers, batch 20, 1,019 unseen samples
    are delivered as 1,020 (3 x 17 x 20), not 1,080 (a multiple of 3 x 2 x 20)."""
    counts = [100] * 30 + [19]
    old, new = (2, 2, 20, 50, 5), (3, 2, 20, 50, 5)
    plan = pass_for(counts, old, "pad")
    reference = deliver_all(plan)
    n = 50
    unseen = set(flat([r[n:] for r in reference])) - set(flat([r[:n] for r in reference]))
    assert len(unseen) == 1019
    again = resumed(counts, new, plan.state_after(n), "pad")
    after = flat(deliver_all(again))
    assert set(after) == unseen and len(after) == 1020 and again.repeated == 1


def test_a_state_at_the_start_of_an_epoch_starts_it_afresh_on_any_topology():
    counts = counts_for(7)
    state = pass_for(counts, TOPOLOGIES[1]).state_after(0)
    again = resumed(counts, TOPOLOGIES[2], state)
    assert deliver_all(again) == deliver_all(pass_for(counts, TOPOLOGIES[2]))  # nothing consumed: nothing to lay out again


def test_chained_resumes_exact_then_elastic_then_exact():
    counts = counts_for(7)
    a, b, c = (2, 2, 3, 8, 3), (3, 1, 2, 8, 3), (1, 2, 5, 8, 3)
    first = pass_for(counts, a)
    reference = deliver_all(first)
    seen = flat([r[:4] for r in reference])
    second = resumed(counts, b, first.state_after(4))  # 2 ranks became 3
    pass1 = deliver_all(second)
    state = second.state_after(3)
    assert len(State.from_json(state).segments) == 2
    seen += flat([r[:3] for r in pass1])
    same = resumed(counts, b, state)  # preempted again, same topology: exact
    assert same.exact and deliver_all(same) == [r[3:] for r in pass1]
    third = resumed(counts, c, state)  # and then elastic onto another topology
    after = flat(deliver_all(third))
    everything = flat(reference)
    assert len(seen) + len(after) + second.dropped + third.dropped == len(everything)
    assert sorted(seen + after) == sorted(set(seen + after))
    assert set(seen + after) <= set(everything)


def test_resume_reads_back_at_most_one_buffer_per_worker():
    counts = [500] * 8
    topo = (2, 2, 10, 100, 10)
    plan = pass_for(counts, topo)
    n = int(plan.batches_per_rank * 0.9)
    again = resumed(counts, topo, plan.state_after(n))
    for rank in range(2):
        for d in range(2):
            (window,) = again.worker(rank, d).windows
            (source,) = window.sources
            back, rest = sum(len(r) for r in source.back), sum(len(r) for r in source.ranges)
            assert 0 < back <= 100  # at most one buffer read back
            assert back + rest == window.samples  # every unconsumed sample read once, nothing consumed read again


def test_cut_is_linear_and_matches_the_shuffle():
    from shardstream.pipeline.shuffle import shuffle_samples

    rng_a, rng_b = random.Random(5), random.Random(5)
    out = [x for chunk in shuffle_samples([list(range(1000))], buffer_size=64, initial=8, rng=rng_a) for x in chunk]
    cut = cut_stream(1000, 600, buffer_size=64, initial=8, rng=rng_b)
    seen = set(out[:600])
    assert set(cut.buffered) | seen | set(range(cut.taken, 1000)) == set(range(1000))
    assert not (set(cut.buffered) & seen) and cut.taken - len(cut.buffered) == 600
    assert rng_b.random() != random.Random(5).random()  # the RNG was advanced, not reseeded


def test_state_refused_for_another_dataset_seed_mode_run_or_version():
    counts = [10, 10]
    topo = (1, 1, 2, 8, 3)
    doc = pass_for(counts, topo).state_after(3)
    assert len(json.dumps(doc)) < 600 and doc["format"] == "shardstream-resume" and doc["version"] == 3
    run = run_for(counts, topo)
    run.load(doc)
    with pytest.raises(StateError, match="another dataset"):
        run_for([10, 11], topo).load(doc)
    with pytest.raises(StateError, match="mode='drop'"):
        run_for(counts, topo, "pad").load(doc)
    with pytest.raises(StateError, match="seed=11"):
        run.load({**doc, "seed": 1})
    with pytest.raises(StateError, match=r"a run by whole epochs but this ShardStream runs by steps \(steps=4 .*Schedule\(\)"):
        make_run(make_sources([counts]), world=1, batch=2, steps=4).load(doc)
    with pytest.raises(StateError, match="version 99 is unknown"):
        run.load({**doc, "version": 99})
    with pytest.raises(StateError, match="not a shardstream resume state"):
        run.load({"epoch": 1})
    with pytest.raises(StateError, match="missing or mistypes"):
        run.load({**doc, "seed": "7"})
    with pytest.raises(StateError, match="has only"):
        run.load({**doc, "segments": [{**doc["segments"][0], "batches": 99}]})
    with pytest.raises(StateError, match="not where segment 0 stopped"):
        run.load({**doc, "segments": [doc["segments"][0], {**doc["segments"][0], "start": 7}]})


def test_version_1_states_keep_loading():
    """A state as shardstream wrote it before version 2 (one dataset, two segments) resumes the same way."""
    counts = counts_for(7)
    a, b = TOPOLOGIES[1], TOPOLOGIES[2]
    first = pass_for(counts, a)
    second = resumed(counts, b, first.state_after(4))
    v2 = second.state_after(3)
    v1 = {
        "format": "shardstream-resume",
        "version": 1,
        "manifest": "m",
        "samples": sum(counts),
        "seed": SEED,
        "shuffle": True,
        "mode": "drop",
        "epoch": EPOCH,
        "segments": [
            {**{k: s[k] for k in ("world_size", "num_workers", "batch_size", "shuffle_buffer", "shuffle_initial")}, "batches": s["batches"]}
            for s in v2["segments"]
        ],
    }
    for topo in (b, TOPOLOGIES[3]):
        assert deliver_all(resumed(counts, topo, v1)) == deliver_all(resumed(counts, topo, v2))


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=9),
    old=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.integers(0, 12), st.integers(1, 12)),
    new=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.integers(0, 12), st.integers(1, 12)),
    where=st.floats(0, 1),
    mode=st.sampled_from(["drop", "pad"]),
)
def test_property_exact_and_elastic(counts, old, new, where, mode):
    assume(sum(counts) > 0)
    try:
        plan = pass_for(counts, old, mode)
        run_for(counts, new, mode).check_workers(new[1])
    except ConfigError:
        assume(False)
    reference = deliver_all(plan)
    total = len(reference[0])
    n = int(round(where * total))
    state = plan.state_after(n)
    assert deliver_all(resumed(counts, old, state, mode), random.Random(n)) == [r[n:] for r in reference]
    again = resumed(counts, new, state, mode)
    after = deliver_all(again, random.Random(n))
    if again.exact:
        assert after == [r[n:] for r in reference]
    elif n:
        check_elastic(flat(after), flat([r[n:] for r in reference]), flat([r[:n] for r in reference]), again, mode, new[0], new[2])
