"""ShardStream end to end on real shards with real DataLoader workers: exact epochs, shuffle,
decode, batching, error policy and manifests that lie."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
import webdataset as wds
from conftest import drop_member_sidecars, write_dataset
from PIL import Image

from shardstream import Decode, ShardStream, Shuffle, World, make_loader, to_device
from shardstream.errors import ConfigError, ManifestError, SampleError, ShardFormatError, TooManyErrors


def keys_of(batches):
    return [k for b in batches for k in b["__key__"]]


@pytest.fixture
def dataset_root(tmp_path):
    return write_dataset(tmp_path / "ds", n=200, max_count=23)


@pytest.mark.parametrize("world,workers,batch", [(1, 0, 7), (2, 2, 5), (3, 2, 4)])
def test_every_rank_and_worker_real_dataloader(dataset_root, world, workers, batch):
    seen = []
    lengths = set()
    for rank in range(world):
        ds = ShardStream(dataset_root, batch_size=batch, world=World(rank, world), seed=1, shuffle=Shuffle(50))
        loader = make_loader(ds, num_workers=workers)
        batches = list(loader)
        assert len(batches) == len(loader) == len(ds)
        assert all(len(b["__key__"]) == batch for b in batches)
        lengths.add(len(batches))
        seen.append(keys_of(batches))
    assert len(lengths) == 1
    flat = [k for ks in seen for k in ks]
    plan = ds.plan()
    assert len(flat) == len(set(flat)) == 200 - plan.dropped


def test_batch_contents_are_decoded_and_collated(dataset_root):
    ds = ShardStream(dataset_root, batch_size=8, shuffle=False, world=World(0, 1))
    first = next(iter(ds))
    assert first["__key__"] == [f"s{i:06d}" for i in range(8)]
    assert first["cls"].tolist() == [i % 7 for i in range(8)] and first["cls"].dtype == torch.int64
    assert first["txt"] == [f"sample {i}" for i in range(8)]
    assert isinstance(first["bin"][0], bytes)
    assert first["__url__"][0].endswith("shard-000000.tar")


def test_decoders_by_extension_and_overrides(tmp_path):
    img = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    samples = [
        {
            "__key__": f"k{i}",
            "png": img,
            "npy": np.full((2, 3), i, np.float32),
            "json": {"i": i},
            "pth": torch.tensor([i, i]),
            "cls": i,
            "txt": "t",
            "seg.png": img,
        }
        for i in range(4)
    ]
    root = write_dataset(tmp_path / "d", samples=samples, max_count=23)
    batch = next(iter(ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1))))
    assert batch["png"].shape == (4, 3, 4, 6) and batch["png"].dtype == torch.uint8
    assert torch.equal(batch["png"][0], torch.from_numpy(img).permute(2, 0, 1))
    assert torch.equal(batch["seg.png"], batch["png"])
    assert batch["npy"].shape == (4, 2, 3) and batch["npy"][3, 0, 0] == 3
    assert batch["json"] == [{"i": i} for i in range(4)]
    assert batch["pth"].tolist() == [[i, i] for i in range(4)]
    pil = next(
        iter(ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1), decode=Decode({"txt": lambda b: b.decode().upper()}, image="pil")))
    )
    assert isinstance(pil["png"][0], Image.Image) and pil["txt"] == ["T"] * 4
    raw = next(iter(ShardStream(root, batch_size=4, shuffle=False, decode=False, world=World(0, 1))))
    assert isinstance(raw["png"][0], bytes)


def test_transform_and_custom_collate(dataset_root):
    ds = ShardStream(
        dataset_root,
        batch_size=4,
        shuffle=False,
        world=World(0, 1),
        transform=lambda s: {"__key__": s["__key__"], "y": s["cls"] * 2},
        collate=lambda samples: [s["y"] for s in samples],
    )
    assert next(iter(ds)) == [0, 2, 4, 6]


def test_corrupt_image_follows_error_policy(tmp_path):
    good = np.zeros((4, 4, 3), np.uint8)
    samples = [{"__key__": f"k{i:03d}", "png": good, "cls": i} for i in range(40)]
    samples[5]["png"] = b"this is not a png"
    root = write_dataset(tmp_path / "d", samples=samples, max_count=10)
    with pytest.raises(SampleError, match=r"shard-000000.tar, sample 'k005': cannot decode field 'png'"):
        list(ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1)))
    ds = ShardStream(root, batch_size=4, shuffle=False, on_error="skip", world=World(0, 1))
    batches = list(ds)
    assert len(batches) == len(ds) == 10  # still every planned batch: the gap is refilled
    keys = keys_of(batches)
    assert "k005" not in keys and len(set(keys)) == 39
    broken = [{"__key__": f"k{i:03d}", "png": b"junk", "cls": i} for i in range(40)]
    root2 = write_dataset(tmp_path / "e", samples=broken, max_count=23)
    with pytest.raises(TooManyErrors, match=r"17 consecutive samples failed under on_error='skip' \(tolerance 16; last: .*k\d+"):
        list(ShardStream(root2, batch_size=4, on_error="skip", world=World(0, 1)))


def test_missing_required_field(tmp_path):
    samples = [{"__key__": f"k{i}", "txt": "x"} for i in range(8)]
    samples[2]["cls"] = 1
    root = write_dataset(tmp_path / "d", samples=samples, max_count=23)
    with pytest.raises(SampleError, match="missing required field 'cls'"):
        list(ShardStream(root, batch_size=2, shuffle=False, decode=Decode(required=["cls"]), world=World(0, 1)))


def test_set_epoch_reaches_persistent_workers(dataset_root):
    ds = ShardStream(dataset_root, batch_size=10, seed=3, world=World(0, 1))
    loader = make_loader(ds, num_workers=2, persistent_workers=True)
    orders = []
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        orders.append(keys_of(loader))
    assert orders[0] == orders[2] != orders[1]
    assert sorted(orders[0]) != orders[0]  # shuffled


def test_same_seed_same_order_across_instances(dataset_root):
    a = keys_of(ShardStream(dataset_root, batch_size=10, seed=9, world=World(1, 2)))
    b = keys_of(ShardStream(dataset_root, batch_size=10, seed=9, world=World(1, 2)))
    c = keys_of(ShardStream(dataset_root, batch_size=10, seed=10, world=World(1, 2)))
    assert a == b != c


def test_pad_mode_for_small_eval_sets(tmp_path):
    root = write_dataset(tmp_path / "d", n=10, max_count=3)
    batches = []
    for rank in range(3):
        ds = ShardStream(root, batch_size=4, mode="pad", shuffle=False, world=World(rank, 3))
        assert len(ds) == 1 and ds.plan().repeated == 2
        batches += list(ds)
    keys = keys_of(batches)
    assert len(keys) == 12 and len(set(keys)) == 10


def test_impossible_settings_fail_at_construction(dataset_root):
    with pytest.raises(ConfigError, match="batch_size 64 x world_size 4 = 256 samples per step, but the dataset has only 200"):
        ShardStream(dataset_root, batch_size=64, world=World(0, 4))
    ds = ShardStream(dataset_root, batch_size=50, world=World(0, 2))
    with pytest.raises(ConfigError, match="num_workers is 3"):
        make_loader(ds, num_workers=3)


def test_shard_urls_without_manifest_are_indexed(tmp_path):
    samples = [{"__key__": f"k{i:04d}", "txt": f"t{i}", "cls": i} for i in range(70)]
    with wds.ShardWriter(str(tmp_path / "w-%02d.tar"), maxcount=30, verbose=0) as w:
        for s in samples:
            w.write(s)
    for source in (str(tmp_path / "w-{00..02}.tar"), str(tmp_path / "w-*.tar"), [str(p) for p in sorted(tmp_path.glob("w-*.tar"))]):
        ds = ShardStream.from_urls(source, batch_size=7, shuffle=False, world=World(0, 1))
        keys = keys_of(ds)
        assert keys == [s["__key__"] for s in samples]
    with pytest.raises(ConfigError, match="no shards match"):
        ShardStream.from_urls(str(tmp_path / "x-*.tar"), batch_size=7)


def test_the_constructor_refuses_shard_urls_and_says_what_to_do(tmp_path):
    # Indexing reads every shard: it happens on request (from_urls, `shardstream index`), never as a side effect.
    for source in (str(tmp_path / "w-{00..02}.tar"), str(tmp_path / "w-*.tar"), str(tmp_path / "a.tar"), [str(tmp_path / "a.tar")]):
        with pytest.raises(ConfigError, match=r"names shard files.*ShardStream\.from_urls.*shardstream index"):
            ShardStream(source, batch_size=7)  # type: ignore[arg-type]


def test_manifests_that_lie(tmp_path, dataset_root):
    path = tmp_path / "ds" / "index.json"
    doc = json.loads(path.read_text())
    lying = json.loads(json.dumps(doc))
    lying["shards"]["samples"][0] -= 1
    lying["total_samples"] -= 1
    path.write_text(json.dumps(lying))
    # the shard's member sidecar (what pack writes) says otherwise: loading it finds the lie
    with pytest.raises(ManifestError, match=r"member sidecar .* describes a shard of 23 samples and \d+ bytes .*the manifest one of 22"):
        list(ShardStream(dataset_root, batch_size=1, shuffle=False, world=World(0, 1)))
    drop_member_sidecars(dataset_root)  # without it, the parser counts the samples the shard holds
    with pytest.raises(ShardFormatError, match="manifest lists 22 samples"):
        list(ShardStream(dataset_root, batch_size=1, shuffle=False, world=World(0, 1)))
    cases = [
        ("not json", "not valid JSON"),
        (json.dumps({**doc, "version": 99}), "unknown manifest format version 99"),
        (json.dumps({**doc, "shards": {k: v + v[:1] for k, v in doc["shards"].items() if v is not None}}), "listed twice"),
        (json.dumps({**doc, "total_samples": 5}), "total_samples says 5"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(ManifestError, match=message):
            ShardStream(dataset_root, batch_size=1, world=World(0, 1))
    path.unlink()
    with pytest.raises(ManifestError, match="cannot read the manifest"):
        ShardStream(dataset_root, batch_size=1, world=World(0, 1))


def test_to_device_on_cpu_passes_batches_through(dataset_root):
    loader = make_loader(ShardStream(dataset_root, batch_size=10, world=World(0, 1)), num_workers=0)
    moved = list(to_device(loader, "cpu"))
    assert len(moved) == len(loader) == 20 and moved[0]["cls"].device.type == "cpu"


def test_dataset_pickles_for_spawned_workers(dataset_root):
    ds = ShardStream(dataset_root, batch_size=10, world=World(0, 1))
    ds.set_epoch(4)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.epoch == 4 and keys_of(clone) == keys_of(ds)
    ctx = torch.multiprocessing.get_context("spawn")
    loader = make_loader(ds, num_workers=2, multiprocessing_context=ctx)
    assert sorted(keys_of(loader)) == sorted(keys_of(ds))
