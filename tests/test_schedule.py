"""The combination table, in one process for every (rank, worker) (tests/schedule_sim.py):

    {one dataset, a mix} x {epochs, steps=, samples_per_epoch=} x {drop, pad} x {1 worker, 3 workers}
        x {fresh, exact resume, elastic resume, a second preemption during a resumed pass}

Every pass gives every rank the same number of batches; within a data epoch no sample is
delivered twice (drop) and every sample at least once (pad); an exact resume delivers what the
uninterrupted run would have, in order, this pass and the next; an elastic resume finishes the
interrupted data epoch first (its unseen samples once each, fewer than world x batch left out and
counted; pad: padded to a multiple of world x batch), yields the rest of the pass (steps - k), then
fresh data epochs on the new topology. Real workers, loaders and to_device: test_resume.py,
test_mix_resume.py, test_resume_ddp.py."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from schedule_sim import deliver_all, make_run, make_sources, through_json

from shardstream.plan.mix import Ask

ONE = ([[14, 9, 21, 5, 26]], None)
MIX = ([[13, 9, 17], [8, 8, 11]], [Ask(weight=0.6), Ask(weight=0.4)])
RUNS = {"epochs": {}, "steps": {"steps": 7}, "samples": {"samples_per_epoch": 45}}
OLD = (2, 3)  # world, batch
NEW = (3, 2)  # another world size and batch size
PASSES = 4


def run_for(data, run, mode, topology, buffer=8):
    counts, asks = data
    world, batch = topology
    return make_run(make_sources(counts, asks), world=world, batch=batch, buffer=buffer, initial=3, mode=mode, **RUNS[run])


def sequence(run, epoch) -> Counter:
    """Every sample of data epoch ``epoch``'s sequence (positions [0, T)), with its multiplicity."""
    layout = run.layout(epoch)
    out: Counter = Counter()
    for i, runs in enumerate(layout.runs(0, layout.total)):
        out.update((epoch, i, int(x)) for x in layout.ids_of(i, runs))
    return out


def by_epoch(ranks_per_pass) -> dict[int, list]:
    out: dict[int, list] = {}
    for ranks in ranks_per_pass:
        for rank in ranks:
            for batch in rank:
                for item in batch:
                    out.setdefault(item[0], []).append(item)
    return out


def check_passes(ranks_per_pass, length) -> None:
    for ranks in ranks_per_pass:
        assert {len(r) for r in ranks} == {length}  # every rank, the same count: len(loader)


def check_whole_epoch(run, epoch, items, mode) -> None:
    """A data epoch delivered whole on one topology."""
    layout = run.layout(epoch)
    expected = sequence(run, epoch)
    assert len(items) == layout.laid_out
    if mode == "drop":
        assert len(set(items)) == len(items) and not Counter(items) - expected  # no sample twice in its data epoch
        assert layout.total - layout.laid_out < layout.world_size * layout.batch_size
    else:
        assert set(items) == set(expected)  # every sample at least once
        assert len(items) - layout.total < layout.world_size * layout.batch_size


@pytest.fixture(params=["drop", "pad"])
def mode(request):
    return request.param


@pytest.fixture(params=[1, 3], ids=["1worker", "3workers"])
def workers(request):
    return request.param


@pytest.fixture(params=["one", "mix"])
def data(request):
    return ONE if request.param == "one" else MIX


@pytest.fixture(params=list(RUNS))
def kind(request):
    return request.param


def reference(data, kind, mode, workers):
    run = run_for(data, kind, mode, OLD)
    passes = [run.pass_plan(k, workers) for k in range(PASSES)]
    return run, passes, [deliver_all(p) for p in passes]


def test_fresh(data, kind, mode, workers):
    run, passes, ref = reference(data, kind, mode, workers)
    check_passes(ref, run.batches_per_pass)
    if kind == "epochs":
        assert [p.windows[0].layout.epoch for p in passes] == list(range(PASSES))
    else:  # steps run through data epochs back to back: the stream goes on from pass to pass
        assert run.batches_per_pass == 7 and passes[1].windows[0].at == 7
    delivered = by_epoch(ref)
    complete = [e for e in delivered if len(delivered[e]) == run.layout(e).laid_out]
    assert len(complete) >= 2
    for e in complete:
        check_whole_epoch(run, e, delivered[e], mode)


@pytest.mark.parametrize("stop", [3, 6])
def test_exact_resume(data, kind, mode, workers, stop):
    run, passes, ref = reference(data, kind, mode, workers)
    state = through_json(passes[1].state_after(stop))
    again = run_for(data, kind, mode, OLD)
    loaded = again.load(state)
    resumed = again.pass_plan(1, workers, loaded, resumed=True)
    assert resumed.exact and resumed.batches_per_rank == run.batches_per_pass - stop
    assert deliver_all(resumed) == [r[stop:] for r in ref[1]]
    assert deliver_all(again.pass_plan(2, workers, loaded)) == ref[2]  # and the next pass as if never interrupted


def elastic(data, kind, mode, workers, stop, new=NEW):
    """Stop after ``stop`` batches of pass 1, resume on ``new``; returns what it takes to check."""
    run, passes, ref = reference(data, kind, mode, workers)
    state = through_json(passes[1].state_after(stop))
    after_run = run_for(data, kind, mode, new)
    loaded = after_run.load(state)
    resumed = after_run.pass_plan(1, workers, loaded, resumed=True)
    later = [after_run.pass_plan(k, workers, loaded) for k in range(2, PASSES + 3)]
    return run, ref, state, after_run, loaded, resumed, later


def consumed_before(ref, stop):
    return [ref[0], [r[:stop] for r in ref[1]]]


@pytest.mark.parametrize("stop", [3, 6])
def test_elastic_resume(data, kind, mode, workers, stop):
    run, ref, state, after_run, loaded, resumed, later = elastic(data, kind, mode, workers, stop)
    assert not resumed.exact
    interrupted = state["epoch"]
    world, batch = NEW
    got = [deliver_all(resumed)] + [deliver_all(p) for p in later]
    if kind == "steps":
        assert {len(r) for r in got[0]} == {7 - stop}  # every new rank yields the rest of the pass: steps - k
    elif kind == "samples":
        assert {len(r) for r in got[0]} == {(7 - stop) * 2 * 3 // (world * batch)}  # the rest of the pass's samples
    else:
        assert {len(r) for r in got[0]} == {resumed.batches_per_rank}  # the rest of the interrupted epoch
    check_passes(got[1:], after_run.batches_per_pass)
    before = by_epoch(consumed_before(ref, stop)).get(interrupted, [])
    whole = by_epoch(ref)[interrupted]
    assert len(whole) == run.layout(interrupted).laid_out  # the uninterrupted run's whole epoch
    if not before:  # nothing of it consumed: the epoch starts afresh on the new topology (its whole sequence)
        whole = list(sequence(run, interrupted).elements())
    delivered = by_epoch(got)
    after = delivered[interrupted]
    if mode == "drop":  # the interrupted data epoch finished first: its unseen samples once each
        assert len(set(before + after)) == len(before + after)
        assert set(after) <= set(whole) and len(after) + resumed.dropped == len(whole) - len(before)
        assert resumed.dropped < world * batch
    else:  # pad: every unseen sample, padded to a multiple of world x batch
        unseen = set(whole) - set(before)
        assert set(after) == unseen and len(after) == len(unseen) + resumed.repeated and len(after) % (world * batch) == 0
    assert f"({resumed.dropped} dropped)" in resumed.summary() or f"({resumed.repeated} repeated)" in resumed.summary()
    for e in delivered:  # then fresh data epochs on the new topology
        if e > interrupted and len(delivered[e]) == after_run.layout(e).laid_out:
            check_whole_epoch(after_run, e, delivered[e], mode)
    assert interrupted + 1 in delivered


@pytest.mark.parametrize("again", ["exact", "elastic"])
def test_second_preemption_during_the_resumed_pass(data, kind, mode, workers, again):
    for stop in range(1, 7):  # a stop inside a data epoch, whose rest takes 2 batches or more on the new topology
        run, ref, state, after_run, loaded, resumed, later = elastic(data, kind, mode, workers, stop)
        if resumed.windows and resumed.windows[0].layout.segment == 1 and resumed.windows[0].hi >= 2:
            break
    first = deliver_all(resumed)
    m = 1
    second_state = through_json(resumed.state_after(m))
    interrupted = state["epoch"]
    assert second_state["epoch"] == interrupted and len(second_state["segments"]) == 2  # still finishing the interrupted epoch
    topology = NEW if again == "exact" else (1, 4)
    third = run_for(data, kind, mode, topology)
    loaded2 = third.load(second_state)
    resumed2 = third.pass_plan(1, workers, loaded2, resumed=True)
    got = [deliver_all(resumed2)] + [deliver_all(third.pass_plan(k, workers, loaded2)) for k in range(2, PASSES + 3)]
    if again == "exact":
        assert resumed2.exact and got[0] == [r[m:] for r in first]
        assert got[1:] == [deliver_all(p) for p in later]
        return
    assert not resumed2.exact
    if kind == "steps":
        assert {len(r) for r in got[0]} == {7 - stop - m}
    before = by_epoch(consumed_before(ref, stop) + [[r[:m] for r in first]]).get(interrupted, [])
    whole = by_epoch(ref)[interrupted]
    after = by_epoch(got)[interrupted]
    world, batch = topology
    if mode == "drop":
        assert len(set(before + after)) == len(before + after) and set(after) <= set(whole)
        assert len(before) + len(after) + resumed.dropped + resumed2.dropped == len(whole)
        assert resumed2.dropped < world * batch
    else:
        assert set(after) == set(whole) - set(before) and len(after) % (world * batch) == 0


def test_a_resumed_run_by_steps_keeps_its_timeline_across_later_passes():
    """After an elastic resume, the pass after the resumed one starts where that one ended: the
    timeline is one sequence of data epochs, never a step counted twice or skipped."""
    run, ref, state, after_run, loaded, resumed, later = elastic(ONE, "steps", "drop", 3, 6)
    assert resumed.pass_end == later[0].pass_start and all(a.pass_end == b.pass_start for a, b in zip(later, later[1:]))
    assert later[0].windows[0].layout is resumed.windows[0].layout  # the interrupted epoch's rest goes on in the next pass
    epochs = [w.layout.epoch for p in [resumed, *later] for w in p.windows]
    assert epochs == sorted(epochs) and len(set(np.diff(sorted(set(epochs))))) == 1
