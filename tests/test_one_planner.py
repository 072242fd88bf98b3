"""One planner: a dataset given as a root and the same dataset as a mix of one source
(``ShardStream(root)``, ``ShardStream([Source(root)])``) read the same samples in the same order
and save interchangeable states, through real DataLoader workers: fresh, shuffled or not, drop and
pad, by epochs and by steps, 1 and 2 ranks, 0 and 2 workers, and a state saved by either resumed
by the other (on the topology it was saved on, and on another). Only ``__source__`` differs: the
mix of one tags its samples with the source's name, the root does not. A state saved for a mix of
one source by an earlier version (state version 2: another order) is refused in one line saying what to do."""

from __future__ import annotations

import json

import pytest
from conftest import write_dataset

from shardstream import EpochPlan, MixPlan, Schedule, ShardStream, Shuffle, Source, World, make_loader
from shardstream.errors import StateError

# (mode, steps, world size, workers, shuffled)
CASES = [
    ("drop", None, 1, 0, True),
    ("pad", None, 2, 2, True),
    ("drop", 11, 2, 0, True),
    ("pad", 11, 1, 2, True),
    ("drop", None, 2, 2, False),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("one") / "ds"), 121, max_count=13, size=20)


def stream(data, mode, steps, world, rank, shuffled):
    kw = dict(batch_size=4, seed=7, mode=mode, world=World(rank, world), shuffle=Shuffle(16) if shuffled else None)
    if steps is not None:
        kw["schedule"] = Schedule(steps=steps)
    return ShardStream(data, **kw)


def passes(loader, epochs=(0, 1)):
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out.append([list(b["__key__"]) for b in loader])
    return out


def interrupted(loader, epoch, n):
    """The state after ``n`` batches of loader epoch ``epoch``, and the keys of those batches."""
    loader.set_epoch(epoch)
    got = []
    for b in loader:
        got.append(list(b["__key__"]))
        if len(got) == n:
            break
    return json.loads(json.dumps(loader.state_dict())), got


def rest(loader, state, epoch):
    """The rest of the pass a state was saved in, then the next pass."""
    loader.load_state_dict(state)
    first = [list(b["__key__"]) for b in loader]
    loader.set_epoch(epoch + 1)
    return first, [list(b["__key__"]) for b in loader]


@pytest.mark.parametrize("mode,steps,world,workers,shuffled", CASES)
def test_a_root_and_a_mix_of_one_read_alike_and_resume_each_other(root, mode, steps, world, workers, shuffled):
    for rank in range(world):
        alone = stream(root, mode, steps, world, rank, shuffled)
        one = stream([Source(root, name="only")], mode, steps, world, rank, shuffled)
        a = make_loader(alone, num_workers=workers, log_interval=None, pin_memory=False)
        b = make_loader(one, num_workers=workers, log_interval=None, pin_memory=False)
        fresh = passes(a)
        assert passes(b) == fresh and all(fresh)
        loader_b = make_loader(stream([Source(root, name="only")], mode, steps, world, rank, shuffled), num_workers=workers, log_interval=None)
        for batch in loader_b:
            assert set(batch["__source__"]) == {"only"}  # a mix of one tags its samples
            break
        for batch in a:
            assert "__source__" not in batch  # a root does not
            break

        # A state saved by either, 5 batches into loader epoch 1, resumed by both: the same rest.
        state_a, head = interrupted(make_loader(stream(root, mode, steps, world, rank, shuffled), num_workers=workers, log_interval=None), 1, 5)
        state_b, head_b = interrupted(
            make_loader(stream([Source(root, name="other")], mode, steps, world, rank, shuffled), num_workers=workers, log_interval=None), 1, 5
        )
        assert state_a == state_b and head == head_b == fresh[1][:5]  # one state: the name is not part of it

        def resumed(data, state, k, rank=rank):
            return rest(make_loader(stream(data, mode, steps, world, rank, shuffled), num_workers=k, log_interval=None), state, 1)

        expected = resumed(root, state_a, workers)
        assert expected[0] == fresh[1][5:]  # the pass goes on exactly
        assert resumed([Source(root, name="only")], state_a, workers) == expected
        assert resumed(root, state_b, workers) == expected
        # On another topology (workers 2 <-> 0): an elastic resume, the same whichever way the data is given.
        other = 2 if workers == 0 else 0
        elastic = resumed(root, state_a, other)
        assert resumed([Source(root, name="only")], state_b, other) == elastic


def test_plans_of_a_root_and_a_mix_of_one_are_one_plan(root):
    """``plan()`` reports a root as one dataset (``EpochPlan``) and a list of sources as a mix
    (``MixPlan``): the same epoch, the same shard order and the same reads."""
    for mode in ("drop", "pad"):
        for epoch in (0, 3):
            single = ShardStream(root, batch_size=4, seed=7, mode=mode, world=World(1, 2)).plan(epoch=epoch, num_workers=2)
            mix = ShardStream([Source(root)], batch_size=4, seed=7, mode=mode, world=World(1, 2)).plan(epoch=epoch, num_workers=2)
            assert isinstance(single, EpochPlan) and isinstance(mix, MixPlan)
            assert single.shard_order == mix.passes[0][0].order and mix.passes[0][0].offset == 0
            assert (single.batches_per_rank, single.dropped, single.repeated) == (mix.batches_per_rank, mix.dropped, mix.repeated)
            for rank in range(2):
                for worker in range(2):
                    assert single.ranges(rank, worker) == mix.ranges(rank, worker)[0]


def test_a_version_2_state_of_a_mix_of_one_is_refused_in_one_line(root):
    """Before version 3 of the state a lone source of a mix was drawn as a mix's and named by its
    name and ask: such a state (as that code wrote it) is refused, naming the version and what to do;
    a version 2 state of a root (no name) resumes as ever (tests/test_resume_compat.py)."""
    ds = stream([Source(root, name="web")], "drop", None, 1, 0, True)
    state = ds.state_dict(batches=3)
    assert state["version"] == 3
    old = {**state, "version": 2, "sources": [{"name": "web", **state["sources"][0], "ask": "repeat 1"}]}
    for target in (ds, stream(root, "drop", None, 1, 0, True)):
        with pytest.raises(StateError) as err:
            target.load_state_dict(old)
        text = str(err.value)
        assert "\n" not in text and "version 2 of a mix of one source ('web')" in text and "set_epoch(1)" in text
        target.load_state_dict({**state, "version": 2})  # unnamed: a version 2 state of a single dataset
    two = stream([Source(root, name="a"), Source(root, name="b")], "drop", None, 1, 0, True)  # a mix of two: drawn as before
    two.load_state_dict({**two.state_dict(batches=3), "version": 2})


def test_a_lone_source_asking_more_than_one_pass_is_its_own_run(root):
    """A mix of one source asking two passes an epoch reads every sample twice an epoch; its
    states name that ask, so a stream over the root (one pass) refuses them, naming both asks."""
    twice = stream([Source(root, repeat=2)], "drop", None, 1, 0, True)
    keys = [k for b in twice for k in b["__key__"]]
    assert len(keys) == 240 and len(set(keys)) == 121  # 242 drawn, the 2 that fill no batch dropped
    state = twice.state_dict(batches=3)
    assert state["sources"][0]["ask"] == "repeat 2"
    with pytest.raises(StateError, match="repeat 2"):
        stream(root, "drop", None, 1, 0, True).load_state_dict(state)
