"""Exact resume of a mixed epoch: in one process over sample ids for many topologies and stop
points, then with real shards and real DataLoader workers through a JSON state."""

from __future__ import annotations

import json

import pytest
from conftest import make_samples

from shardstream import ShardStream, ShardWriter, Source, make_loader
from shardstream.errors import ConfigError, StateError
from shardstream.options import Shuffle
from shardstream.pipeline.shuffle import shuffle_samples
from shardstream.plan.mix import Ask, plan_mix
from shardstream.plan.mixresume import MixResumePlan, MixResumeState, source_rng
from shardstream.plan.resume import SampleIds, merge_round_robin
from shardstream.plan.topology import World


def ids_of(plan, source, ranges):
    base = SampleIds(plan.counts[source]).base
    return [[(source, int(base[r.shard]) + k) for k in range(r.start, r.stop)] for r in ranges]


def merged(streams, pattern):
    flat = [iter([x for chunk in s for x in chunk]) for s in streams]
    return [next(flat[i]) for i in pattern]


def batches(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


def reference(plan, rank, buffer, initial):
    """The uninterrupted rank: every worker's shuffled, merged batches in round-robin order."""
    per_worker = []
    for w in range(plan.num_workers):
        ranges, pattern = plan.reads(*plan.worker_slice(rank, w))
        streams = [shuffle_samples(ids_of(plan, i, rs), buffer_size=buffer, initial=initial,
                                   rng=source_rng(plan.seed, plan.epoch, rank, w, i)) for i, rs in enumerate(ranges)]
        per_worker.append(batches(merged(streams, pattern), plan.batch_size))
    return merge_round_robin(per_worker)


@pytest.mark.parametrize("world,workers,batch,buffer,per_batch",
                         [(1, 1, 4, 8, "spread"), (2, 3, 5, 16, "spread"), (2, 2, 6, 1, "exact"), (3, 2, 4, 30, "exact")])
def test_exact_resume_every_stop_point(world, workers, batch, buffer, per_batch):
    counts = [[13, 9, 17], [8, 8], [5, 6, 7]]
    asks = [Ask(weight=0.6), Ask(weight=0.4), Ask(repeat=1.7)]
    plan = plan_mix(counts, asks, world_size=world, num_workers=workers, batch_size=batch, seed=4, epoch=2,
                    per_batch=per_batch)
    initial = max(1, buffer // 4)
    for rank in range(world):
        ref = reference(plan, rank, buffer, initial)
        assert len(ref) == plan.batches_per_rank
        for stop in range(plan.batches_per_rank + 1):
            state = MixResumeState(({"name": "x"},), 4, True, per_batch, 2, (world, workers, batch, buffer, initial), stop)
            resume = MixResumePlan(plan, state)
            per_worker = []
            for d in range(workers):
                w = resume.worker(rank, d)
                streams = w.samples(lambda i, rs: ids_of(plan, i, rs))
                got = batches(merged(streams, w.pattern), batch)
                assert len(got) == w.num_batches
                per_worker.append(got)
            assert merge_round_robin(per_worker) == ref[stop:], f"rank {rank} stopped after {stop}"


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
        ds = ShardStream(sources, batch_size=4, seed=5, shuffle=Shuffle(16), world=World(0, 1), per_batch=per_batch)
        loader = make_loader(ds, num_workers=workers, log_interval=None, pin_memory=False)
        loader.set_epoch(1)
        return loader

    ref, _ = run(fresh())
    nxt_ref = None
    for stop in (1, 5, len(ref) - 1):
        _, state = run(fresh(), stop)
        assert state["format"] == "shardstream-mix-resume" and state["batches"] == stop and state["epoch"] == 1
        assert [s["name"] for s in state["sources"]] == ["a", "b"]  # the state names the sources
        resumed = fresh()
        resumed.load_state_dict(state)
        rest, after = run(resumed)
        assert rest == ref[stop:], f"stopped after {stop}"
        assert after["batches"] == len(ref)
        resumed.set_epoch(2)
        nxt, _ = run(resumed)
        if nxt_ref is None:
            other = fresh()
            other.set_epoch(2)
            nxt_ref, _ = run(other)
        assert nxt == nxt_ref


def test_mix_resume_refuses_other_mixes_and_topologies(sources):
    ds = ShardStream(sources, batch_size=4, seed=5, world=World(0, 1))
    state = ds.state_dict(batches=3)
    with pytest.raises(StateError, match="another mix"):
        ShardStream(sources[:1], batch_size=4, seed=5, world=World(0, 1)).load_state_dict(state)
    with pytest.raises(StateError, match="seed=5"):
        ShardStream(sources, batch_size=4, seed=6, world=World(0, 1)).load_state_dict(state)
    other = make_loader(ShardStream(sources, batch_size=4, seed=5, world=World(0, 1)), num_workers=2)
    with pytest.raises(StateError, match="only on the topology it was saved on"):
        other.load_state_dict(state)
    with pytest.raises(StateError, match="not a resume state of a mix"):
        ds.load_state_dict({"format": "shardstream-resume"})
    with pytest.raises(ConfigError, match="steps="):
        ShardStream(sources, batch_size=4, steps=5).load_state_dict(state)
