"""Resume with real shards and real DataLoader workers: stop mid-epoch, save the state through
JSON, start a new loader from it; exact resume gives the uninterrupted run's batches (keys and
augmented pixels), elastic resume gives every unseen sample once; the next epoch runs normally."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from conftest import make_samples
from PIL import Image

from shardstream import RandomResizedCrop, ShardStream, ShardWriter, Shuffle, World, make_loader
from shardstream.errors import ConfigError, StateError


def write_dataset(root, n=120, max_count=13, jpeg=False):
    rng = np.random.default_rng(0)
    with ShardWriter(str(root), max_count=max_count) as w:
        for s in make_samples(n, size=20):
            if jpeg:
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(buf, format="JPEG")
                s = {**s, "jpg": buf.getvalue()}
            w.write(s)
    return str(root)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("resume") / "ds")


def stream(root, rank=0, world_size=1, shuffle_buffer=16, **kw):
    opts = dict(batch_size=4, seed=5, shuffle=Shuffle(shuffle_buffer), world=World(rank, world_size))
    opts.update(kw)
    return ShardStream(root, **opts)


def run(loader, stop=None):
    """Keys per batch; with ``stop``, leave after that many batches and return the state too."""
    got = []
    for batch in loader:
        got.append(list(batch["__key__"]))
        if stop is not None and len(got) == stop:
            return got, json.loads(json.dumps(loader.state_dict()))
    return got, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("workers,persistent,mode", [(0, False, "drop"), (2, False, "pad"), (2, True, "drop")])
def test_exact_resume_real_workers(root, workers, persistent, mode):
    def fresh():
        loader = make_loader(stream(root, mode=mode), num_workers=workers, persistent_workers=persistent, log_interval=None)
        loader.set_epoch(1)
        return loader

    reference, _ = run(fresh())
    loader = fresh()
    next_epoch_ref = None
    for stop in (1, 7, len(reference) - 1, len(reference)) if workers == 0 else (3, len(reference)):
        _, state = run(fresh(), stop)
        assert state["epoch"] == 1 and state["segments"][-1]["batches"] == stop
        resumed = make_loader(stream(root, mode=mode), num_workers=workers, persistent_workers=persistent, log_interval=None)
        resumed.load_state_dict(state)
        if stop < len(reference):
            rest, after = run(resumed)
            assert rest == reference[stop:], f"stopped after {stop}"
            assert after["segments"][-1]["batches"] == len(reference)  # the epoch is complete
            resumed.set_epoch(2)  # the next epoch runs normally
        else:  # saved once the epoch was over: the next pass is the next epoch
            assert resumed.dataset.epoch == 2 and len(resumed) == len(reference)
        nxt, _ = run(resumed)
        if next_epoch_ref is None:
            loader.set_epoch(2)
            next_epoch_ref, _ = run(loader)
        assert nxt == next_epoch_ref


def test_resume_mid_resumed_pass_and_dataset_state_in_main_process(root):
    reference = [list(b["__key__"]) for b in _epoch(stream(root), 3)]
    ds = stream(root)
    ds.set_epoch(3)
    it = iter(ds)
    first = [list(next(it)["__key__"]) for _ in range(5)]
    state = ds.state_dict(batches=5)
    assert ds.state_dict() == state  # iterated in this process: the dataset counts what it handed over
    assert first == reference[:5] and state["segments"][0]["batches"] == 5
    again = stream(root)
    again.load_state_dict(state)
    assert again.state_dict() == state  # before the resumed pass starts: the state as loaded
    it = iter(again)
    more = [list(next(it)["__key__"]) for _ in range(4)]
    assert more == reference[5:9]
    third = stream(root)
    assert again.state_dict() == again.state_dict(batches=4)
    third.load_state_dict(again.state_dict(batches=4))  # preempted again during the resumed pass
    assert [list(b["__key__"]) for b in third] == reference[9:]


def _epoch(ds, epoch):
    ds.set_epoch(epoch)
    return list(ds)


def test_own_dataloader_with_workers_needs_the_step_count(root):
    ds = stream(root)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    reference = [list(b["__key__"]) for b in loader]
    with pytest.raises(ConfigError, match="state_dict\\(batches=STEPS_THIS_EPOCH\\)"):
        ds.state_dict()
    state = ds.state_dict(batches=6)
    assert state["segments"][0]["num_workers"] == 2
    resumed = stream(root)
    resumed.load_state_dict(state)
    rest = [list(b["__key__"]) for b in torch.utils.data.DataLoader(resumed, batch_size=None, num_workers=2)]
    assert rest == reference[6:]


@pytest.mark.parametrize("old,new", [((2, 2, 4), (3, 1, 4)), ((1, 0, 4), (2, 2, 3))])
def test_elastic_resume_real_workers(root, old, new):
    (w0, k0, b0), (w1, k1, b1) = old, new
    consumed, reference = [], []
    state = None
    for rank in range(w0):
        loader = make_loader(stream(root, batch_size=b0, rank=rank, world_size=w0), num_workers=k0, log_interval=None)
        full, _ = run(loader)
        reference += [k for b in full for k in b]
        got, rank_state = run(make_loader(stream(root, batch_size=b0, rank=rank, world_size=w0), num_workers=k0, log_interval=None), 5)
        consumed += [k for b in got for k in b]
        assert state is None or rank_state == state  # every rank saves the same state
        state = rank_state
    after, lengths = [], set()
    for rank in range(w1):
        ds = stream(root, batch_size=b1, rank=rank, world_size=w1)
        loader = make_loader(ds, num_workers=k1, log_interval=None)
        loader.load_state_dict(state)
        plan = ds.resume_plan(k1)
        assert "elastically" in plan.summary() and f"({plan.dropped} dropped)" in ds.plan().summary()
        rest, _ = run(loader)
        lengths.add(len(rest))
        assert all(len(b) == b1 for b in rest)
        after += [k for b in rest for k in b]
    assert len(lengths) == 1  # equal batches on every new rank
    unseen = set(reference) - set(consumed)
    assert len(after) == len(set(after)) and set(after) <= unseen  # once, and only the unseen
    assert len(after) + plan.dropped == len(unseen)
    assert set(consumed) | set(after) <= set(reference)


def test_seeded_crop_is_the_same_after_resume_and_across_topologies(tmp_path):
    root = write_dataset(tmp_path / "img", n=48, max_count=7, jpeg=True)

    def crops(rank, world, workers, state=None, stop=None):
        ds = stream(root, batch_size=4, rank=rank, world_size=world, decode={"jpg": RandomResizedCrop(16, seed=2)})
        loader = make_loader(ds, num_workers=workers, log_interval=None)
        if state is not None:
            loader.load_state_dict(state)
        out = {}
        for i, batch in enumerate(loader):
            for key, img in zip(batch["__key__"], batch["jpg"]):
                out[key] = img
            if stop is not None and i + 1 == stop:
                return out, loader.state_dict()
        return out, loader.state_dict()

    reference, _ = crops(0, 1, 2)
    first, state = crops(0, 1, 2, stop=3)
    rest, _ = crops(0, 1, 2, state=state)
    elastic = {}
    for rank in range(2):
        part, _ = crops(rank, 2, 1, state=state)
        elastic.update(part)
    for key, img in {**first, **rest, **elastic}.items():
        assert torch.equal(img, reference[key]), key
    assert len(first) + len(rest) == len(reference)


def test_state_of_another_dataset_seed_or_version_is_refused(root, tmp_path):
    _, state = run(make_loader(stream(root), num_workers=0, log_interval=None), 2)
    other = write_dataset(tmp_path / "other", n=60)
    with pytest.raises(StateError, match="another dataset"):
        stream(other).load_state_dict(state)
    with pytest.raises(StateError, match="seed=5"):
        stream(root, seed=6).load_state_dict(state)
    with pytest.raises(StateError, match="mode='drop'"):
        stream(root, mode="pad").load_state_dict(state)
    with pytest.raises(StateError, match="version 99 is unknown"):
        stream(root).load_state_dict({**state, "version": 99})
