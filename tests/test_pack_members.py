"""pack writes each shard's member sidecar as it writes the shard (``sidecar.MemberLog``), on every
path that writes shards: a local tree (one process, or workers writing whole shards), loaded
sources (JSONL, an iterable: ``ShardWriter``, the samples encoded in workers or here), and shard
tasks under an executor. Each sidecar is byte for byte what ``shardstream index`` records for the
same shard, the reader slices the shards it packed, and a shard that is not one to slice (a member
of 1 MiB or more) has none and is parsed. Overwriting, merging and verifying know the sidecars."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import webdataset as wds
from test_members import Counted  # (a stream counter that records what it is told)

import shardstream
from shardstream.format.manifest import load_manifest
from shardstream.format.members import MEMBER_CACHE
from shardstream.pipeline.read import read_range
from shardstream.plan.epoch import Range
from shardstream.tools.index import write_index
from shardstream.tools.merge import merge_datasets
from shardstream.tools.verify import verify_dataset


@pytest.fixture(autouse=True)
def _fresh_cache():
    MEMBER_CACHE.clear()
    yield
    MEMBER_CACHE.clear()


def _tree(root, n: int = 40, seed: int = 0):
    """An ImageFolder-like tree: two classes, files of many sizes (block-aligned ones too), and a
    caption beside some images (samples of one and of two fields)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        folder = root / ("cat" if i % 2 else "dog")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:04d}.jpg").write_bytes(rng.bytes([0, 1, 511, 512, 513, 3000][i % 6] + i))
        if i % 3 == 0:
            (folder / f"{i:04d}.txt").write_text(f"caption {i}")
    return root


def _index_copy(packed, where):
    """The packed shards copied into ``where`` and indexed there by ``shardstream index``."""
    where.mkdir(parents=True)
    names = sorted(p for p in os.listdir(packed) if p.endswith(".tar"))
    for name in names:
        shutil.copy(packed / name, where / name)
    write_index([str(where / name) for name in names], str(where))
    return names


def _assert_as_index_records(packed, tmp_path):
    """Every shard of ``packed`` has a member sidecar, the bytes ``shardstream index`` writes for it."""
    names = _index_copy(packed, tmp_path / "indexed")
    assert names
    for name in names:
        assert (packed / f"{name}.members").read_bytes() == (tmp_path / "indexed" / f"{name}.members").read_bytes(), name
    manifest = load_manifest(str(packed))
    assert (manifest.member_bytes > 0).all()
    assert json.loads((packed / "index.json").read_text())["shards"]["members"] == [os.path.getsize(packed / f"{n}.members") for n in names]
    return manifest


def _read_sliced(manifest):
    """Every sample of ``manifest`` as the reader gives it, and how many ranges were sliced."""
    counters = Counted()
    got = []
    for i, n in enumerate(manifest.counts.tolist()):
        got += [s for chunk in read_range(manifest, Range(i, 0, n), counters=counters) for s in chunk]
    return got, counters.counts


def _as_webdataset_reads(packed):
    last = len(load_manifest(str(packed)).paths) - 1
    return [
        {k: v for k, v in s.items() if k != "__local_path__"}
        for s in wds.WebDataset(f"{packed}/shard-{{000000..{last:06d}}}.tar", shardshuffle=False)
    ]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_local_tree_packed_gets_the_member_sidecars_index_writes(tmp_path, workers):
    packed = tmp_path / "packed"
    shardstream.pack(str(_tree(tmp_path / "train")), str(packed), max_count=7, workers=workers)
    manifest = _assert_as_index_records(packed, tmp_path)
    got, counts = _read_sliced(manifest)
    assert counts["ranges_sliced"] == counts["ranges_opened"] == len(manifest.paths)
    expected = _as_webdataset_reads(packed)
    assert len(got) == 40
    assert [{k: v for k, v in s.items() if k != "__url__"} for s in got] == [{k: v for k, v in s.items() if k != "__url__"} for s in expected]
    assert verify_dataset(manifest) == []


def test_jsonl_packed_with_workers_gets_the_member_sidecars_index_writes(tmp_path):
    """Samples loaded and encoded in workers, written by ``ShardWriter.write_members``; keys too
    long for a ustar name (a pax header before the member) and non-ASCII ones."""
    lines = [
        {"__key__": f"doc{i:03d}" + ("-" + "x" * 120 if i % 5 == 0 else "") + ("-é" if i % 7 == 0 else ""), "txt": f"text {i}" * i, "cls": i % 3}
        for i in range(30)
    ]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    packed = tmp_path / "packed"
    shardstream.pack(str(tmp_path / "docs.jsonl"), str(packed), max_count=8, workers=2)
    manifest = _assert_as_index_records(packed, tmp_path)
    got, counts = _read_sliced(manifest)
    assert counts["ranges_sliced"] == len(manifest.paths)
    assert [s["__key__"] for s in got] == [line["__key__"] for line in lines]
    assert [s["txt"].decode() for s in got] == [line["txt"] for line in lines]


def _samples(i):
    return {"__key__": f"s{i:04d}", "bin": bytes([i % 251]) * (i * 97 % 4000), "json": {"i": i}}


def test_a_function_here_and_as_shard_tasks_gets_the_member_sidecars_index_writes(tmp_path):
    shardstream.pack(_samples, range(50), str(tmp_path / "here"), max_count=9)
    _assert_as_index_records(tmp_path / "here", tmp_path / "a")
    with ProcessPoolExecutor(2) as executor:
        shardstream.pack(_samples, range(50), str(tmp_path / "tasks"), max_count=9, executor=executor)
    _assert_as_index_records(tmp_path / "tasks", tmp_path / "b")
    for name in sorted(os.listdir(tmp_path / "tasks")):  # the same samples in the same shards: the same bytes
        assert (tmp_path / "tasks" / name).read_bytes() == (tmp_path / "here" / name).read_bytes() or name == "index.json"


def test_a_shard_with_a_large_member_has_no_member_sidecar_and_is_parsed(tmp_path):
    samples = [{"__key__": f"s{i}", "bin": os.urandom((2 << 20) if i == 3 else 100)} for i in range(8)]
    packed = tmp_path / "packed"
    shardstream.pack(samples.__getitem__, range(8), str(packed), max_count=4)
    manifest = load_manifest(str(packed))
    assert manifest.member_bytes.tolist()[0] == -1 and manifest.member_bytes.tolist()[1] > 0
    assert not (packed / "shard-000000.tar.members").exists() and (packed / "shard-000001.tar.members").exists()
    assert json.loads((packed / "index.json").read_text())["shards"]["members"] == [None, os.path.getsize(packed / "shard-000001.tar.members")]
    got, counts = _read_sliced(manifest)
    assert [s["bin"] for s in got] == [s["bin"] for s in samples]
    assert counts["ranges_opened"] == 2 and counts["ranges_sliced"] == 1
    assert verify_dataset(manifest) == []


def test_overwriting_a_pack_replaces_its_member_sidecars_and_leaves_none_stale(tmp_path):
    packed = tmp_path / "packed"
    shardstream.pack(_samples, range(40), str(packed), max_count=10)
    assert (packed / "shard-000003.tar.members").exists()
    with pytest.raises(shardstream.DestinationError, match="already holds a dataset"):  # a dataset, not "other entries"
        shardstream.pack(_samples, range(40), str(packed), max_count=10)
    os.remove(packed / "index.json")  # the files of a pack and nothing else: taken for an interrupted pack's, not foreign
    shardstream.pack(_samples, range(40, 60), str(packed), max_count=10)
    shardstream.pack(_samples, range(15), str(packed), max_count=10, overwrite=True)
    assert sorted(os.listdir(packed)) == ["index.json"] + [f"shard-00000{i}.tar{s}" for i in range(2) for s in ("", ".idx", ".members")]
    got, counts = _read_sliced(load_manifest(str(packed)))
    assert [s["__key__"] for s in got] == [f"s{i:04d}" for i in range(15)] and counts["ranges_sliced"] == 2


def test_a_merge_of_packs_reads_their_member_sidecars(tmp_path):
    shardstream.pack(_samples, range(20), str(tmp_path / "a"), max_count=10)
    shardstream.pack(_samples, range(20, 35), str(tmp_path / "b"), max_count=10)
    merged, _ = merge_datasets(str(tmp_path / "all"), [str(tmp_path / "a"), str(tmp_path / "b")])
    manifest = load_manifest(str(tmp_path / "all"))
    assert manifest.member_bytes.tolist() == [
        os.path.getsize(tmp_path / p / f"shard-00000{i}.tar.members") for p, i in (("a", 0), ("a", 1), ("b", 0), ("b", 1))
    ]
    got, counts = _read_sliced(manifest)
    assert [s["__key__"] for s in got] == [f"s{i:04d}" for i in range(35)] and counts["ranges_sliced"] == 4


def test_the_lean_writer_agrees_with_the_reader_on_every_constant_and_fingerprint():
    """pack's workers write member sidecars from ``sidecar`` and ``write.members`` (no format
    package): the reader's constants are the same, the data starts and sizes ``encode_members``
    notes point at each field's bytes (pax headers before long and non-ASCII names too), and the
    fingerprints ``block_fingerprints`` takes are the reader's of the same headers."""
    import random

    from shardstream import sidecar
    from shardstream.format import members, tar
    from shardstream.write.members import encode_members

    assert (sidecar.LARGE_MEMBER, sidecar.MEMBERS_MAGIC, sidecar.MEMBERS_HEADER.format) == (tar.LARGE_MEMBER, members.MAGIC, members.HEADER.format)
    chars = "abcXYZ019_-./é"
    rnd = random.Random(7)
    log = sidecar.MemberLog()
    blocks, at = [], 0
    for _ in range(300):
        key = "".join(rnd.choice(chars) for _ in range(rnd.randint(1, 140)))
        fields = {"bin": bytes(rnd.randint(0, 1500)), "json": b"{}"}
        first = len(log.starts)
        pieces, size = encode_members(key, fields, log, at)
        log.keep(key)
        blocks.append(b"".join(pieces))
        assert len(blocks[-1]) == size and log.exts[first:] == sorted(fields)
        for ext, start, n in zip(log.exts[first:], log.starts[first:], log.sizes[first:]):
            assert blocks[-1][start - at : start - at + n] == fields[ext]
        at += size
    shard = b"".join(blocks)
    log.flushed(shard, 0)
    words = np.frombuffer(shard, dtype="<u8").reshape(-1, 64)
    assert log.fps == members.fingerprints(words[[(s >> 9) - 1 for s in log.starts]]).tolist()
    log.drop()  # nothing appended since the last keep: nothing dropped
    assert len(log.starts) == len(log.fps) == log.firsts[-1] == 600
