"""Start-up work is per shard, not per sample: version-1 manifest offsets load as one compact
array with vectorised checks (version 2 keeps them in sidecars: tests/test_scale.py), and a
range's first reads are small so the first batch comes from a few hundred KiB rather than a full
read block."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import drop_member_sidecars

from shardstream import ShardStream, ShardWriter, load_manifest
from shardstream.errors import ManifestError
from shardstream.format.manifest import Manifest
from shardstream.format.tar import DEFAULT_READ_SIZE
from shardstream.pipeline import read as readmod
from shardstream.plan.topology import World


def write(root, n=300, size=2000):
    with ShardWriter(str(root), max_count=1000) as w:
        for i in range(n):
            w.write_encoded(f"{i:06d}", {"bin": bytes([i % 251]) * size, "cls": str(i % 7).encode()})
    return str(root)


def version_1(root):
    """The dataset's manifest in the old format, offsets inline."""
    m = load_manifest(root)
    doc = json.loads(m.dumps())
    doc["version"] = 1
    doc["shards"] = [
        {"path": m.paths[i], "samples": int(m.counts[i]), "bytes": int(m.sizes[i]), "sha256": m.sha256(i), "offsets": m.offsets(i).tolist()}
        for i in range(len(m.paths))
    ]
    return doc


def test_offsets_load_as_compact_array_with_the_same_values(tmp_path):
    root = write(tmp_path / "d")
    drop_member_sidecars(root)  # (version 1 had none: its conversion has no member column)
    doc = version_1(root)
    manifest = Manifest.from_json(doc, root)
    offsets = manifest.offsets(0)
    assert isinstance(offsets, np.ndarray) and offsets.dtype == np.int64
    assert offsets.tolist() == doc["shards"][0]["offsets"]
    assert all(type(o) is int for o in manifest.byte_range(0, 3, 7))  # Python ints, not numpy scalars
    assert json.loads(json.dumps(manifest.to_json()))["shards"] == json.loads(load_manifest(root).dumps())["shards"]


@pytest.mark.parametrize(
    "bad,message",
    [
        (lambda o: [True] + o[1:], "byte offsets"),  # JSON true where the first offset is
        (lambda o: o[:1] + [True] + o[2:], "byte offsets"),
        (lambda o: o[:5] + [1.5] + o[6:], "byte offsets"),
        (lambda o: o[:5] + ["9"] + o[6:], "byte offsets"),
        (lambda o: o[:5] + [2**70] + o[6:], "byte offsets"),
        (lambda o: [-512] + o[1:], "byte offsets"),
        (lambda o: o[:5] + [o[4]] + o[6:], "not strictly increasing"),
        (lambda o: o[:5] + [False] + o[6:], "not strictly increasing"),
        (lambda o: o[:-1] + [o[-1] + 10**9], "past the shard"),
        (lambda o: o[:-1], r"samples \+ 1"),
    ],
)
def test_bad_offsets_are_refused_at_load(tmp_path, bad, message):
    root = write(tmp_path / "d", n=20)
    doc = version_1(root)
    doc["shards"][0]["offsets"] = bad(doc["shards"][0]["offsets"])
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(doc, root)


def test_first_reads_are_small_then_grow_to_read_size(tmp_path, monkeypatch):
    root = write(tmp_path / "d", n=1000, size=3000)
    sizes = []
    real_open = readmod.open_range

    def recording_open(*args, **kwargs):
        read, close = real_open(*args, **kwargs)

        def read_recorded(n):
            data = read(n)
            sizes.append(len(data))
            return data

        return read_recorded, close

    monkeypatch.setattr(readmod, "open_range", recording_open)
    ds = ShardStream(root, batch_size=64, shuffle=True, world=World(0, 1))
    first = next(iter(ds))
    assert len(first["__key__"]) == 64
    # The first batch came from reads of 256 KiB, 512 KiB, ... (doubling), less than one 4 MiB block in all.
    assert sizes == [readmod.FIRST_READ << i for i in range(len(sizes))]
    assert sum(sizes) < DEFAULT_READ_SIZE
    keys = [k for b in ds for k in b["__key__"]]
    assert len(keys) == len(set(keys)) == 960  # the rest of the epoch still reads every planned sample once


def test_plans_do_not_look_at_every_shard_url(tmp_path, monkeypatch):
    """plan() runs at construction, in len(), in make_loader and in every worker: it must not join
    or inspect every shard's URL (over 10,000 shards that cost seconds). Which shards are
    compressed is a manifest column, computed once when the manifest is loaded."""
    from shardstream.format.manifest import Manifest

    with ShardWriter(str(tmp_path / "d"), max_count=2) as w:
        for i in range(60):
            w.write_encoded(f"{i:06d}", {"cls": str(i).encode()})
    ds = ShardStream(str(tmp_path / "d"), batch_size=4, world=World(0, 1))
    calls = []
    real = Manifest.shard_url
    monkeypatch.setattr(Manifest, "shard_url", lambda self, i: calls.append(i) or real(self, i))
    plans = [ds.plan(epoch=epoch) for epoch in range(3)]
    assert calls == [] and len(ds) == 15 and all(p.compressed_shards == 0 for p in plans)
    assert sum(len(b["__key__"]) for b in ds) == 60


def test_construction_plans_no_shard_order(tmp_path, monkeypatch):
    """``ShardStream(...)`` and ``make_loader(...)`` check the settings with counts alone: the
    epoch's shard permutation (and numpy.random's import, ~25-60 ms cold on this VM) waits for
    the first pass; the same ConfigErrors still come at construction."""
    from shardstream import make_loader
    from shardstream.errors import ConfigError
    from shardstream.plan import mix as planner

    root = write(tmp_path / "d", n=640, size=10)

    def refuse(*args):
        raise AssertionError("a shard order was planned at construction")

    monkeypatch.setattr(planner, "shard_permutation", refuse)  # the one planner's draws: a single dataset's order
    monkeypatch.setattr(planner, "_passes", refuse)  # and any source's passes
    ds = ShardStream(root, batch_size=64, world=World(0, 1))
    make_loader(ds, num_workers=2, log_interval=None, pin_memory=False)
    with pytest.raises(ConfigError, match="num_workers is 11"):
        make_loader(ds, num_workers=11, log_interval=None)
    with pytest.raises(ConfigError, match="samples per step"):
        ShardStream(root, batch_size=1000, world=World(0, 1))
    monkeypatch.undo()
    assert sum(len(b["__key__"]) for b in make_loader(ds, num_workers=0, log_interval=None)) == 640
