"""Resume of a mixed epoch: in one process over sample ids (tests/schedule_sim.py) for many
topologies and stop points, exactly and elastically; then with real shards and real DataLoader
workers through a JSON state."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from conftest import make_samples
from schedule_sim import deliver_all, flat, make_run, make_sources, through_json

from shardstream import Schedule, ShardStream, ShardWriter, Source, make_loader
from shardstream.errors import StateError
from shardstream.options import Shuffle
from shardstream.plan.mix import Ask
from shardstream.plan.topology import World

COUNTS = [[13, 9, 17], [8, 8], [5, 6, 7]]
ASKS = [Ask(weight=0.6), Ask(weight=0.4), Ask(repeat=1.7)]


def mix_run(world, batch, buffer, per_batch="spread", mode="drop"):
    return make_run(make_sources(COUNTS, ASKS), world=world, batch=batch, buffer=buffer, initial=max(1, buffer // 4), per_batch=per_batch, mode=mode)


@pytest.mark.parametrize(
    "world,workers,batch,buffer,per_batch", [(1, 1, 4, 8, "spread"), (2, 3, 5, 16, "spread"), (2, 2, 6, 1, "exact"), (3, 2, 4, 30, "exact")]
)
def test_exact_resume_every_stop_point(world, workers, batch, buffer, per_batch):
    run = mix_run(world, batch, buffer, per_batch)
    plan = run.pass_plan(2, workers)
    reference = deliver_all(plan)
    for stop in range(plan.batches_per_rank + 1):
        again = run.pass_plan(2, workers, run.load(through_json(plan.state_after(stop))), resumed=True)
        assert again.exact
        assert deliver_all(again, random.Random(stop)) == [r[stop:] for r in reference], f"stopped after {stop}"


@pytest.mark.parametrize("per_batch", ["spread", "exact"])
@pytest.mark.parametrize("old,new", [((2, 2, 5, 16), (3, 1, 4, 8)), ((3, 2, 4, 30), (1, 3, 6, 1)), ((1, 1, 4, 8), (2, 2, 4, 8))])
def test_elastic_resume_delivers_every_unseen_sample_of_every_source_once_in_proportion(old, new, per_batch):
    (w0, k0, b0, buf0), (w1, k1, b1, buf1) = old, new
    plan = mix_run(w0, b0, buf0, per_batch).pass_plan(2, k0)
    reference = deliver_all(plan)
    for stop in (1, plan.batches_per_rank // 2, plan.batches_per_rank - 1):
        run = mix_run(w1, b1, buf1, per_batch)
        again = run.pass_plan(2, k1, run.load(through_json(plan.state_after(stop))), resumed=True)
        assert not again.exact and again.summary().startswith("resuming epoch 2 elastically")
        after = deliver_all(again)
        rest = Counter(flat([r[stop:] for r in reference]))
        got = Counter(flat(after))
        assert not got - rest  # only what was not yet consumed (repeat 1.7 repeats samples: as a multiset)
        assert sum(got.values()) + again.dropped == sum(rest.values())  # all of it but the counted leftover
        if per_batch == "spread":
            assert again.dropped < w1 * b1
        quotas = [sum(1 for x in rest.elements() if x[1] == i) for i in range(3)]
        total = sum(quotas)
        exact_counts = plan.run.plan_epoch(2, 1, w1, b1).per_batch_counts
        for batches in after:  # every batch carries every source in proportion to what was left
            for batch in batches:
                per_source = Counter(x[1] for x in batch)
                for i, q in enumerate(quotas):
                    if per_batch == "spread":
                        p = q / total
                        assert abs(per_source.get(i, 0) - b1 * p) < (1 - p) + 2 * p + 1
                    else:
                        assert per_source.get(i, 0) == exact_counts[i]
        # What was left keeps the epoch's shares: each worker consumed a contiguous run of the sequence.
        for i, q in enumerate(quotas):
            planned = plan.run.plan_epoch(2).quotas[i] / sum(plan.run.plan_epoch(2).quotas)
            assert abs(q - total * planned) <= w0 * k0 * 3 + (w0 * b0 if per_batch == "exact" else 0)


def test_version_1_mix_states_keep_loading():
    run = mix_run(2, 5, 16)
    plan = run.pass_plan(2, 3)
    reference = deliver_all(plan)
    v1 = {
        "format": "shardstream-mix-resume",
        "version": 1,
        "sources": list(run.sources.identity),
        "seed": 11,
        "shuffle": True,
        "per_batch": "spread",
        "epoch": 2,
        "world_size": 2,
        "num_workers": 3,
        "batch_size": 5,
        "shuffle_buffer": 16,
        "shuffle_initial": 4,
        "batches": 3,
    }
    again = run.pass_plan(2, 3, run.load(v1), resumed=True)
    assert again.exact and deliver_all(again) == [r[3:] for r in reference]


def write(root, n, prefix):
    with ShardWriter(str(root), max_count=11) as w:
        for s in make_samples(n, size=20, seed=len(prefix)):
            s["__key__"] = prefix + s["__key__"]
            w.write(s)
    return str(root)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixresume")
    return [Source(write(root / "a", 70, "a"), weight=0.7, name="a"), Source(write(root / "b", 40, "b"), repeat=1.5, name="b")]


def run(loader, stop=None):
    got = []
    for batch in loader:
        got.append(list(batch["__key__"]))
        if stop is not None and len(got) == stop:
            break
    return got, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("workers,per_batch", [(0, "spread"), (2, "exact")])
def test_exact_resume_real_workers(sources, workers, per_batch):
    def fresh():
        ds = ShardStream(sources, batch_size=4, seed=5, shuffle=Shuffle(16), world=World(0, 1), schedule=Schedule(per_batch=per_batch))
        loader = make_loader(ds, num_workers=workers, log_interval=None, pin_memory=False)
        loader.set_epoch(1)
        return loader

    ref, _ = run(fresh())
    nxt_ref = None
    for stop in (1, 5, len(ref) - 1):
        _, state = run(fresh(), stop)
        assert state["format"] == "shardstream-resume" and state["segments"][-1]["batches"] == stop and state["epoch"] == 1
        assert [s["name"] for s in state["sources"]] == ["a", "b"]  # the state names the sources
        resumed = fresh()
        resumed.load_state_dict(state)
        rest, after = run(resumed)
        assert rest == ref[stop:], f"stopped after {stop}"
        assert after["segments"][-1]["batches"] == len(ref)
        resumed.set_epoch(2)
        nxt, _ = run(resumed)
        if nxt_ref is None:
            other = fresh()
            other.set_epoch(2)
            nxt_ref, _ = run(other)
        assert nxt == nxt_ref


def test_mix_resumes_elastically_and_refuses_other_mixes_seeds_and_schedules(sources):
    ds = ShardStream(sources, batch_size=4, seed=5, world=World(0, 1))
    state = ds.state_dict(batches=3)
    with pytest.raises(StateError, match="another mix"):
        ShardStream(sources[:1], batch_size=4, seed=5, world=World(0, 1)).load_state_dict(state)
    with pytest.raises(StateError, match="seed=5"):
        ShardStream(sources, batch_size=4, seed=6, world=World(0, 1)).load_state_dict(state)
    with pytest.raises(StateError, match=r"per_batch='spread'.*Schedule\(per_batch='spread'\)"):
        ShardStream(sources, batch_size=4, seed=5, world=World(0, 1), schedule=Schedule(per_batch="exact")).load_state_dict(state)
    with pytest.raises(StateError, match=r"runs by steps \(steps=5 per loader epoch\); construct it with schedule=Schedule\(\)"):
        ShardStream(sources, batch_size=4, seed=5, schedule=Schedule(steps=5)).load_state_dict(state)
    with pytest.raises(StateError, match="not a shardstream resume state"):
        ds.load_state_dict({"format": "shardstream-mix"})
    seen = [k for b in list(ShardStream(sources, batch_size=4, seed=5, world=World(0, 1)))[:3] for k in b["__key__"]]
    after = []
    for rank in range(2):  # 1 rank became 2, each with 2 workers
        other = ShardStream(sources, batch_size=4, seed=5, world=World(rank, 2))
        loader = make_loader(other, num_workers=2, log_interval=None, pin_memory=False)
        loader.load_state_dict(state)
        assert "elastically" in other.resume_plan(2).summary()
        after.append([k for b in loader for k in b["__key__"]])
    assert len(after[0]) == len(after[1])  # equal batches on every new rank
    whole = Counter(k for b in ShardStream(sources, batch_size=4, seed=5, world=World(0, 1)) for k in b["__key__"])
    got = Counter(after[0] + after[1]) + Counter(seen)
    assert not got - whole and sum((whole - got).values()) < 2 * 4  # the epoch, less fewer than world x batch
