"""Resume through every kind of loop, with real shards and real DataLoader workers: make_loader, your
own DataLoader (``dataset.state_dict(batches=n)``) and ``to_device`` holding a batch copied ahead
(``copy_ahead=1`` on CPU: the state leaves the held batch out), with 0 workers, 2 workers and
persistent workers, for one dataset and a mix, by epochs and by steps. The plan itself is proven
for every (rank, worker) in test_schedule.py; these runs prove the wiring."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import make_samples

from shardstream import Schedule, ShardStream, ShardWriter, Shuffle, Source, World, make_loader, to_device


def write(root, n, prefix):
    with ShardWriter(str(root), max_count=11) as w:
        for s in make_samples(n, size=20, seed=len(prefix)):
            s["__key__"] = prefix + s["__key__"]
            w.write(s)
    return str(root)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("loops")
    return write(root / "a", 70, "a"), write(root / "b", 40, "b")


def dataset(roots, data, steps, rank=0, world=1, batch=4, mode="drop"):
    source = roots[0] if data == "one" else [Source(roots[0], weight=0.6, name="a"), Source(roots[1], weight=0.4, name="b")]
    return ShardStream(source, batch_size=batch, seed=3, shuffle=Shuffle(12), world=World(rank, world), mode=mode, schedule=Schedule(steps=steps))


class Loop:
    """One kind of training loop over a dataset: iterate a pass, stop after n batches, save a state."""

    def __init__(self, kind, ds, workers, persistent):
        self.kind, self.ds = kind, ds
        if kind == "own":
            self.loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=persistent)
        else:
            self.loader = make_loader(ds, num_workers=workers, persistent_workers=persistent, log_interval=None, pin_memory=False)
        self.batches = to_device(self.loader, "cpu", copy_ahead=1) if kind == "to_device" else self.loader

    def load(self, state):
        (self.ds if self.kind == "own" else self.batches).load_state_dict(state)

    def run(self, epoch, stop=None):
        if self.kind == "own":
            self.ds.set_epoch(epoch)
        else:
            self.loader.set_epoch(epoch)
        got, state = [], None
        for batch in self.batches:
            got.append(list(batch["__key__"]))
            if len(got) == stop:
                state = self.ds.state_dict(batches=stop) if self.kind == "own" else self.batches.state_dict()
                break
        return got, json.loads(json.dumps(state)) if state is not None else None


CASES = [  # (loop, workers, persistent, data, steps)
    ("make_loader", 0, False, "mix", 9),
    ("make_loader", 2, True, "one", 9),
    ("make_loader", 2, False, "mix", None),
    ("own", 2, False, "mix", 9),
    ("own", 0, False, "one", None),
    ("own", 2, True, "one", 9),
    ("to_device", 2, False, "mix", 9),
    ("to_device", 0, False, "one", 9),
    ("to_device", 2, True, "mix", None),
]


@pytest.mark.parametrize("kind,workers,persistent,data,steps", CASES)
def test_exact_resume_through_every_loop(roots, kind, workers, persistent, data, steps):
    reference = Loop(kind, dataset(roots, data, steps), workers, persistent)
    ref1, _ = reference.run(1)
    ref2, _ = reference.run(2)
    stop = 4
    first, state = Loop(kind, dataset(roots, data, steps), workers, persistent).run(1, stop)
    assert first == ref1[:stop] and state["loader_epoch"] == 1 and state["segments"][-1]["batches"] >= stop
    again = Loop(kind, dataset(roots, data, steps), workers, persistent)
    again.load(state)
    rest, _ = again.run(1)
    assert rest == ref1[stop:]  # the batch to_device held copied ahead is delivered again, none skipped
    nxt, _ = again.run(2)
    assert nxt == ref2  # the next pass as if never interrupted (persistent workers too)


@pytest.mark.parametrize(
    "kind,workers,data,steps,mode",
    [
        ("make_loader", 2, "mix", 9, "drop"),
        ("own", 2, "one", None, "pad"),
        ("to_device", 0, "mix", None, "drop"),
    ],
)
def test_elastic_resume_through_every_loop(roots, kind, workers, data, steps, mode):
    """1 rank becomes 2: every new rank yields the same count (the rest of the pass: steps - k by
    steps), the interrupted data epoch's unseen samples come once each (pad: at least once)."""
    stop = 3
    seen, state = Loop(kind, dataset(roots, data, steps, mode=mode), workers, False).run(0, stop)
    whole = Counter(k for b in Loop(kind, dataset(roots, data, None, mode=mode), workers, False).run(0)[0] for k in b)
    after = []
    for rank in range(2):
        ds = dataset(roots, data, steps, rank=rank, world=2, batch=3, mode=mode)
        loop = Loop(kind, ds, workers, False)
        loop.load(state)
        plan = ds.resume_plan(workers)
        assert plan is not None and "elastically" in plan.summary()
        got, _ = loop.run(0)
        after.append(got)
    assert len(after[0]) == len(after[1]) == (steps - stop if steps else plan.batches_per_rank)
    seen_keys = Counter(k for b in seen for k in b)
    if steps is None:  # the pass is the rest of the epoch: everything unseen, once (drop) or at least once (pad)
        got = Counter(k for r in after for b in r for k in b)
        if mode == "drop":
            assert max(got.values()) == 1 and not got & seen_keys
            assert sum(got.values()) + plan.dropped == sum(whole.values()) - sum(seen_keys.values())
        else:
            assert set(got) == set(whole) - set(seen_keys) and sum(got.values()) % (2 * 3) == 0
