"""Mixes and training by steps end to end: real shards, real DataLoader workers, mix files, the
plan report, and the CLI tools taking a mix file where they take a dataset URL."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import make_samples

from shardstream import Schedule, ShardStream, ShardWriter, Source, Store, make_loader
from shardstream.cli.main import main
from shardstream.errors import ConfigError
from shardstream.options import Shuffle
from shardstream.plan.topology import World


def write(root, n, prefix, max_count=13):
    with ShardWriter(str(root), max_count=max_count) as w:
        for s in make_samples(n, seed=len(prefix)):
            s["__key__"] = f"{prefix}{s['__key__']}"
            w.write(s)
    return str(root)


@pytest.fixture
def roots(tmp_path):
    return write(tmp_path / "a", 120, "a"), write(tmp_path / "b", 60, "b"), write(tmp_path / "c", 40, "c")


def run_ranks(make, world, workers):
    """Batches of every rank through a real loader."""
    out = []
    for rank in range(world):
        ds = make(rank)
        loader = make_loader(ds, num_workers=workers, pin_memory=False)
        batches = list(loader)
        assert len(batches) == len(loader) == len(ds)
        out.append((ds, batches))
    return out


@pytest.mark.parametrize("per_batch", ["spread", "exact"])
@pytest.mark.parametrize("world,workers", [(1, 0), (2, 2)])
def test_weighted_mix_every_rank_matches_plan(roots, per_batch, world, workers):
    a, b, c = roots
    sources = [Source(a, weight=0.5, name="a"), Source(b, weight=0.3, name="b"), Source(c, repeat=1.5, name="c")]

    def make(rank):
        return ShardStream(sources, batch_size=10, world=World(rank, world), seed=3, shuffle=Shuffle(30), schedule=Schedule(per_batch=per_batch))

    ranks = run_ranks(make, world, workers)
    plan = ranks[0][0].plan()
    assert len({len(bs) for _, bs in ranks}) == 1  # equal batches on every rank
    keys = [k for _, bs in ranks for batch in bs for k in batch["__key__"]]
    tags = [t for _, bs in ranks for batch in bs for t in batch["__source__"]]
    assert all(k[0] == t for k, t in zip(keys, tags))  # __source__ says where each sample came from
    used = Counter(tags)
    assert {s.name: s.used for s in plan.shares()} == dict(used)  # per-source counts as planned
    assert used["c"] == 60 - plan.shares()[2].dropped  # repeat 1.5 of 40
    assert len(set(k for k in keys if k[0] != "c")) == sum(1 for k in keys if k[0] != "c")  # a, b: no repeats
    for _, bs in ranks:
        for batch in bs:
            per = Counter(batch["__source__"])
            for i, name in enumerate("abc"):
                if per_batch == "exact":
                    assert per[name] == plan.per_batch_counts[i]
                else:
                    assert abs(per[name] - 10 * plan.quotas[i] / plan.total_samples) < 2


def test_mix_epochs_differ_and_repeat_exactly(roots):
    a, b, _ = roots
    ds = ShardStream([Source(a, name="a"), Source(b, repeat=2, name="b")], batch_size=9, world=World(0, 1))
    loader = make_loader(ds, num_workers=2, pin_memory=False)
    first = [k for batch in loader for k in batch["__key__"]]
    b_seen = Counter(k for k in first if k[0] == "b")
    b_share = ds.plan().shares()[1]
    assert max(b_seen.values()) == 2 and sum(b_seen.values()) == b_share.used == 120 - b_share.dropped
    loader.set_epoch(1)
    second = [k for batch in loader for k in batch["__key__"]]
    assert first != second and len(first) == len(second) == len(ds) * 9


def test_steps_run_epochs_back_to_back(roots):
    a, b, _ = roots
    per_epoch = ShardStream([Source(a, weight=1), Source(b, weight=1)], batch_size=8, world=World(1, 2)).plan()
    steps = 3 * per_epoch.batches_per_rank + 2  # more than three epochs of data
    ranks = run_ranks(
        lambda r: ShardStream([Source(a, weight=1), Source(b, weight=1)], batch_size=8, world=World(r, 2), seed=5, schedule=Schedule(steps=steps)),
        2,
        2,
    )
    assert [len(bs) for _, bs in ranks] == [steps, steps]
    keys = [k for _, bs in ranks for batch in bs for k in batch["__key__"]]
    # Every data epoch is whole and fresh: each full epoch's samples are distinct.
    counts = Counter(keys)
    assert max(counts.values()) <= 4
    # The next loader epoch continues the stream where this one ended: nothing repeated early.
    plan = ShardStream([Source(a, weight=1), Source(b, weight=1)], batch_size=8, world=World(0, 1)).plan()
    ds = ShardStream([Source(a, weight=1), Source(b, weight=1)], batch_size=8, world=World(0, 1), schedule=Schedule(steps=plan.batches_per_rank * 2))
    one = [k for batch in make_loader(ds, num_workers=0) for k in batch["__key__"]]
    assert len(one) == 2 * plan.used_samples and len(set(one[: plan.used_samples])) == plan.used_samples
    ds.set_epoch(1)
    nxt = [k for batch in make_loader(ds, num_workers=0) for k in batch["__key__"]]
    assert nxt[: plan.used_samples] != one[: plan.used_samples]


def test_steps_and_samples_per_epoch_for_one_dataset(roots):
    a, _, _ = roots
    ds = ShardStream(a, batch_size=7, world=World(0, 1), shuffle=Shuffle(10), schedule=Schedule(samples_per_epoch=500))
    assert len(ds) == 500 // 7
    loader = make_loader(ds, num_workers=2, pin_memory=False)
    keys = [k for batch in loader for k in batch["__key__"]]
    assert len(keys) == 71 * 7
    assert ds.plan().batches_per_rank == 17  # 71 steps: four whole data epochs of 119 samples and 3 batches
    seen = Counter(keys)
    assert len(seen) == 120 and max(seen.values()) <= 5 and sum(1 for v in seen.values() if v >= 4) >= 116
    with pytest.raises(ConfigError, match="steps=2 per rank but num_workers is 3"):
        make_loader(ShardStream(a, batch_size=7, world=World(0, 1), schedule=Schedule(steps=2)), num_workers=3)
    with pytest.raises(ConfigError, match="steps or samples_per_epoch, not both"):
        ShardStream(a, batch_size=7, schedule=Schedule(steps=3, samples_per_epoch=50))


def test_steps_keys_match_plan_exactly(roots):
    """With steps, a rank yields exactly the planned batches of consecutive data epochs."""
    a, _, _ = roots
    ds = ShardStream(a, batch_size=5, world=World(0, 1), shuffle=Shuffle(0), schedule=Schedule(steps=30))
    got = Counter(k for batch in make_loader(ds, num_workers=2) for k in batch["__key__"])
    want: Counter = Counter()
    for e in (0, 1):
        p = ds.plan(epoch=e)
        n = min(p.batches_per_rank, 30 - e * p.batches_per_rank) * 5
        ranges = p.ranges_between(0, n, ds.counts)
        want.update(f"as{r.shard * 13 + i:06d}" for r in ranges for i in range(r.start, r.stop))
    assert got == want


def test_mix_file_json_and_yaml_everywhere(roots, tmp_path, capsys):
    a, b, c = roots
    (tmp_path / "mix.json").write_text(json.dumps({"sources": [{"url": "a", "weight": 2, "name": "A"}, {"url": b, "weight": 1}]}))
    (tmp_path / "mix.yaml").write_text(f"sources:\n  - url: a\n    weight: 2\n    name: A\n  - url: {b}\n    weight: 1\n")
    for name in ("mix.json", "mix.yaml"):
        ds = ShardStream(str(tmp_path / name), batch_size=6, world=World(0, 1))
        assert ds.sources.mixed and ds.sources.names == ["A", b]
        assert [s.quota for s in ds.plan().shares()] == [120, 60]
        batch = next(iter(ds))
        assert set(batch["__source__"]) <= {"A", b}
    assert main(["ls", str(tmp_path / "mix.yaml")]) == 0
    out = capsys.readouterr().out
    assert "A" in out and "weight 2" in out and "120 samples" in out and "mix of 2 sources" in out
    assert main(["ls", str(tmp_path / "mix.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in doc["sources"]] == ["A", b] and doc["samples"] == 180
    assert main(["bench", str(tmp_path / "mix.json"), "--workers", "0", "--seconds", "0.5", "--batch-size", "8"]) == 0
    assert "samples/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"sources": []}', "non-empty list"),
        ('{"sources": [{"url": "x", "weight": 1, "repeat": 2}]}', "source 1: a source asks for exactly one"),
        ('{"sources": [{"url": "x", "wieght": 1}]}', "unknown keys \\['wieght'\\]"),
        ('{"sources": [{"url": "x"}], "extra": 1}', "unknown top-level keys"),
        ('{"sources": [{"url": "nowhere"}]}', "mix source .*nowhere"),
        ('{"sources": [', "not valid JSON"),
    ],
)
def test_bad_mix_files(tmp_path, text, message):
    (tmp_path / "m.json").write_text(text)
    with pytest.raises(Exception, match=message):
        ShardStream(str(tmp_path / "m.json"), batch_size=2)


def test_mix_in_pad_mode_and_what_a_mix_refuses(roots):
    a, b, c = roots
    ds = ShardStream([Source(a, name="a"), Source(c, name="c")], batch_size=7, mode="pad", world=World(0, 3), shuffle=Shuffle(9))
    plan = ds.plan()
    assert plan.batches_per_rank == -(-160 // 21) and plan.repeated == 3 * 8 * 7 - 160  # 160 samples padded to 3 x 8 x 7
    keys = [
        k
        for r in range(3)
        for batch in ShardStream([Source(a, name="a"), Source(c, name="c")], batch_size=7, mode="pad", world=World(r, 3), shuffle=Shuffle(9))
        for k in batch["__key__"]
    ]
    assert len(keys) == 168 and len(set(keys)) == 160  # every sample at least once, 8 repeated
    with pytest.raises(ConfigError, match="mode='pad' with per_batch='exact' cannot work: .*use per_batch='spread'"):
        ShardStream([Source(a), Source(b)], batch_size=4, mode="pad", schedule=Schedule(per_batch="exact"))
    with pytest.raises(ConfigError, match="share a name"):
        ShardStream([Source(a), Source(a)], batch_size=4)
    with pytest.raises(ConfigError, match="wrap every dataset in Source"):
        ShardStream([Source(a), b], batch_size=4)


def test_mix_file_on_s3_with_relative_sources(s3, roots):
    bucket, options, client = s3
    with ShardWriter(f"s3://{bucket}/data/web", max_count=13, storage_options=options) as w:
        for s in make_samples(30):
            w.write(s)
    doc = {"sources": [{"url": "../data/web", "weight": 1, "name": "web"}, {"url": roots[1], "weight": 1, "name": "disk"}]}
    client.put_object(Bucket=bucket, Key="mixes/m.json", Body=json.dumps(doc).encode())
    ds = ShardStream(f"s3://{bucket}/mixes/m.json", batch_size=5, world=World(0, 1), store=Store(options=options))
    assert ds.sources.mixed and ds.sources.manifests[0].base_url == f"s3://{bucket}/data/web"
    assert ds.sources.storage_options[0] == options and ds.readahead[0] > 0 and ds.readahead[1] == 0
    tags = Counter(t for batch in make_loader(ds, num_workers=0) for t in batch["__source__"])
    assert tags == {s.name: s.used for s in ds.plan().shares()} and tags["web"] == 30


def test_a_source_short_under_skip_keeps_batches_equal(tmp_path):
    a = write(tmp_path / "a", 60, "a")
    b = write(tmp_path / "b", 39, "b")
    (tmp_path / "b" / "shard-000001.tar").unlink()  # 13 of b's samples are gone
    ds = ShardStream([Source(a, name="a"), Source(b, name="b")], batch_size=6, world=World(0, 1), on_error="skip")
    batches = list(make_loader(ds, num_workers=2, pin_memory=False))
    assert len(batches) == len(ds) and all(len(x["__key__"]) == 6 for x in batches)
    tags = Counter(t for x in batches for t in x["__source__"])
    assert tags["a"] >= ds.plan().shares()[0].used and ds.stats()["samples_skipped"] >= 13
