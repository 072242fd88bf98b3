"""Your own samples and pipeline: optional fields, transforms returning tuples, filtering with None,
epochs that advance by themselves, plain DataLoader use, and the JSONL captions example."""

from __future__ import annotations

import collections
import logging
import os

import pytest
import torch
from conftest import write_dataset

from shardstream import Decode, OnError, SampleError, ShardStream, TooManyErrors, World, make_loader
from shardstream.pipeline.batch import default_collate

Pair = collections.namedtuple("Pair", "image label")


def mixed(tmp_path):
    samples = [{"__key__": "a1", "cls": 1, "txt": "x"}, {"__key__": "a2", "cls": 2, "txt": "y", "json": {"i": 2}}, {"__key__": "a3", "txt": "z"}]
    return write_dataset(tmp_path / "m", samples=samples, max_count=3)


@pytest.mark.parametrize("seed", range(6))
def test_samples_with_different_fields_fail_the_same_way_whatever_the_order(tmp_path, seed):
    root = mixed(tmp_path)
    ds = ShardStream(root, batch_size=3, seed=seed, world=World(0, 1))
    with pytest.raises(
        SampleError,
        match=r"has no field '(cls|json)' while sample 'a\d' of the same batch has it.*"
        r"decode=Decode\(required=\['(cls|json)'\]\).*collate=",
    ):
        list(ds)


def test_required_drops_incomplete_samples_under_skip(tmp_path):
    root = mixed(tmp_path)
    ds = ShardStream(
        root,
        batch_size=1,
        shuffle=False,
        decode=Decode(required=["cls"]),
        on_error="skip",
        transform=lambda s: {"cls": s["cls"], "key": s["__key__"]},
        world=World(0, 1),
    )
    keys = [k for b in ds for k in b["key"]]
    assert len(keys) == 3 and set(keys) == {"a1", "a2"}  # a3 dropped, its slot refilled by a recent sample


def test_a_batch_key_error_lists_the_fields_it_has():
    batch = default_collate([{"__key__": "a", "cls": 1}])
    with pytest.raises(KeyError, match=r"'jpg': this batch has fields \['__key__', 'cls'\]"):
        batch["jpg"]


def test_collate_batches_nested_structures_like_torch():
    t = torch.arange(3)
    out = default_collate([(t, 1, {"m": t.float(), "s": "a"}), (t + 1, 2, {"m": t.float(), "s": "b"})])
    assert isinstance(out, tuple) and torch.equal(out[0], torch.stack([t, t + 1])) and out[1].tolist() == [1, 2]
    assert out[2]["m"].shape == (2, 3) and out[2]["s"] == ["a", "b"]
    assert isinstance(default_collate([Pair(t, 0), Pair(t, 1)]), Pair)
    assert default_collate([t, t]).shape == (2, 3) and default_collate([[1, 2], [3, 4]])[0].tolist() == [1, 3]
    json_field = default_collate([{"json": {"i": 1}}, {"json": {"i": 2}}])["json"]
    assert json_field == [{"i": 1}, {"i": 2}]  # decoded JSON objects stay per sample


def _x_y(sample):
    """(x, y) for a model (module level: workers started from forkserver or spawn import it)."""
    return torch.tensor([sample["cls"]] * 3), sample["cls"]


def test_tuples_for_model_x_y_through_real_workers(tmp_path):
    root = write_dataset(tmp_path / "d", 40, max_count=10)
    ds = ShardStream(root, batch_size=4, transform=_x_y, world=World(0, 1))
    batches = list(make_loader(ds, num_workers=2))
    assert len(batches) == 10
    for x, y in batches:
        assert x.shape == (4, 3) and y.shape == (4,) and torch.equal(x[:, 0], y)


def keep_even(sample):
    return sample if sample["cls"] % 2 == 0 else None


def test_returning_none_drops_the_sample_counted_and_batches_stay_equal(tmp_path):
    root = write_dataset(tmp_path / "d", 40, max_count=10)  # cls = i % 7
    ds = ShardStream(root, batch_size=4, transform=keep_even, world=World(0, 1))
    loader = make_loader(ds, num_workers=2)
    batches = list(loader)
    assert len(batches) == len(loader) == 10 and all(len(b["cls"]) == 4 for b in batches)
    assert all(c % 2 == 0 for b in batches for c in b["cls"].tolist())
    dropped = sum(1 for i in range(40) if (i % 7) % 2)
    assert loader.stats()["samples_filtered"] == dropped


def keys_of(batches):
    return [k for b in batches for k in b["__key__"]]


def test_each_pass_is_a_new_epoch_unless_set_epoch_says_otherwise(tmp_path):
    root = write_dataset(tmp_path / "d", 60, max_count=10)
    ds = ShardStream(root, batch_size=5, world=World(0, 1))
    assert ds.epoch == 0
    first, second = keys_of(ds), keys_of(ds)
    assert first != second and sorted(first) == sorted(second) and ds.epoch == 1  # the last pass's
    ds.set_epoch(0)
    assert keys_of(ds) == first
    ds.set_epoch(1)
    assert keys_of(ds) == second
    fresh = ShardStream(root, batch_size=5, world=World(0, 1))
    loader = make_loader(fresh, num_workers=2, persistent_workers=True)
    passes = [sorted(keys_of(loader)) for _ in range(3)]
    assert passes[0] == passes[1] == passes[2] == sorted(first)  # every pass complete, no sample twice
    assert fresh.epoch == 2
    fresh.set_epoch(1)
    assert keys_of(loader) != keys_of(ShardStream(root, batch_size=5, world=World(0, 1)))  # epoch 1, not 0


def test_a_peek_before_training_keeps_workers_on_one_epoch(tmp_path):
    root = write_dataset(tmp_path / "d", 60, max_count=10)
    ds = ShardStream(root, batch_size=5, world=World(0, 1))
    next(iter(ds))  # look at one batch in the main process
    keys = keys_of(make_loader(ds, num_workers=2))
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 60


def test_plain_dataloader_with_batch_size_none(tmp_path):
    root = write_dataset(tmp_path / "d", 40, max_count=10)
    ds = ShardStream(root, batch_size=4, world=World(0, 1))
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert len(batches) == 10 and batches[0]["cls"].shape == (4,)
    assert sorted(keys_of(batches)) == sorted(f"s{i:06d}" for i in range(40))


def test_the_jsonl_captions_example_trains(tmp_path, monkeypatch):
    # examples/ stays on sys.path while the example trains: a worker started from forkserver or
    # spawn gets the parent's sys.path at its start and imports the example's transform from there
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "examples"))
    import train_jsonl_captions

    result = train_jsonl_captions.main([str(tmp_path / "out"), "--synthetic", "120", "--epochs", "2", "--batch-size", "8", "--workers", "2"])
    assert result["filtered"] == 2 * 12  # every 10th pair has no caption, in each of 2 epochs
    assert result["batches"] == 120 // 8 and result["losses"][1] < result["losses"][0]


BAD = {f"s{i:06d}" for i in range(5, 15)}  # shard 1 and shard 2 whole (5 samples a shard): a run across chunks


def _fails_on_some(sample):
    """A transform that raises on the samples of BAD (module level: spawned workers import it)."""
    if sample["__key__"] in BAD:
        raise ValueError(f"bad sample {sample['__key__']}")
    return sample


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_that_raises_is_skipped_counted_and_named_under_skip(tmp_path, caplog, workers):
    """webdataset's handler=warn_and_continue is on_error="skip": the transform's failures are
    skipped, counted with the decode errors and logged with key and shard; batches stay equal."""
    root = write_dataset(tmp_path / "d", 40, max_count=5)
    ds = ShardStream(root, batch_size=4, shuffle=False, on_error="skip", transform=_fails_on_some, world=World(0, 1))
    with caplog.at_level(logging.WARNING, logger="shardstream"):
        batches = list(make_loader(ds, num_workers=workers))
    keys = keys_of(batches)
    assert len(batches) == 10 and all(len(b["__key__"]) == 4 for b in batches)  # skipped slots refilled
    assert not BAD & set(keys) and set(keys) == {f"s{i:06d}" for i in range(40)} - BAD
    assert ds.stats()["samples_skipped"] == 10
    if workers == 0:  # workers log in their own processes
        assert "shard-000001.tar, sample 's000005': transform failed: ValueError: bad sample s000005" in caplog.text


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_that_raises_under_raise_names_the_key_and_shard(tmp_path, workers):
    root = write_dataset(tmp_path / "d", 40, max_count=5)
    ds = ShardStream(root, batch_size=4, shuffle=False, transform=_fails_on_some, world=World(0, 1))
    with pytest.raises(
        SampleError,
        match=r"shard-00000[12]\.tar, sample 's0000(0[5-9]|1[0-4])': "
        r"transform failed: ValueError: bad sample s0000(0[5-9]|1[0-4])",
    ) as info:
        list(make_loader(ds, num_workers=workers))
    if workers == 0:
        assert isinstance(info.value.__cause__, ValueError)  # raise ... from the transform's error
    assert ds.stats()["samples_skipped"] == 0


def test_transform_failures_count_against_the_tolerance_across_chunks(tmp_path):
    """Ten consecutive failures over two shards (two chunks, each decoded fine before the
    transform sees it) trip a tolerance of 7, as ten consecutive decode errors would."""
    root = write_dataset(tmp_path / "d", 40, max_count=5)
    ds = ShardStream(root, batch_size=4, shuffle=False, on_error=OnError("skip", tolerance=7), transform=_fails_on_some, world=World(0, 1))
    with pytest.raises(TooManyErrors, match=r"8 consecutive samples failed .*transform failed: ValueError: bad sample s000012"):
        list(make_loader(ds, num_workers=0))
    ds = ShardStream(root, batch_size=4, shuffle=False, on_error=OnError("skip", tolerance=10), transform=_fails_on_some, world=World(0, 1))
    assert len(list(make_loader(ds, num_workers=0))) == 10
