"""Member sidecars (format/members.py): ``shardstream index`` records where every member of
others' shards lies, the reader slices them without parsing a header; an older index (no
sidecar) still reads, parsed; a sidecar that does not fit its shard, or a shard changed after it
was indexed, is one typed error naming the shard, never other bytes."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import webdataset as wds

import shardstream
from shardstream.errors import ManifestError, ShardFormatError
from shardstream.format.manifest import load_manifest
from shardstream.format.members import DIGEST, HEADER, MEMBER_CACHE, REBUILD
from shardstream.format.offsets import OFFSET_CACHE
from shardstream.pipeline.read import read_range
from shardstream.plan.epoch import Range
from shardstream.plan.topology import World
from shardstream.tools.index import write_index


class Counted:
    def __init__(self):
        self.counts: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def step(self, what: str, batch: bool = False) -> None:
        pass


@pytest.fixture(autouse=True)
def _fresh_cache():
    MEMBER_CACHE.clear()  # sidecars are cached per process by URL: each test rewrites its own
    yield
    MEMBER_CACHE.clear()


def _webdataset_shard(path, n: int, tag: str = "k", size: int = 1024, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with wds.TarWriter(str(path)) as w:
        for i in range(n):
            w.write({"__key__": f"{tag}{i:05d}", "bin": rng.bytes(size), "cls": i % 7})


def _samples(manifest, rng: Range, counters=None):
    return [(s["__key__"], s["bin"], s["cls"]) for chunk in read_range(manifest, rng, counters=counters) for s in chunk]


def _expected(path):
    return [(s["__key__"], s["bin"], s["cls"]) for s in wds.WebDataset(str(path), shardshuffle=False, empty_check=False)]


def test_webdataset_shards_are_sliced_byte_for_byte_whole_and_from_the_middle(tmp_path):
    shard = tmp_path / "w-000000.tar"
    _webdataset_shard(shard, 3000)
    _, url = write_index(str(shard), str(tmp_path))
    assert (tmp_path / "w-000000.tar.members").exists()
    manifest = load_manifest(url)
    counters = Counted()
    expected = _expected(shard)
    # read blocks smaller than the shard: samples cut by block ends are carried to the next block
    assert [(s["__key__"], s["bin"], s["cls"]) for c in read_range(manifest, Range(0, 0, 3000), read_size=64 << 10) for s in c] == expected
    assert _samples(manifest, Range(0, 0, 3000), counters) == expected
    assert _samples(manifest, Range(0, 1234, 2999), counters) == expected[1234:2999]
    assert counters.counts["ranges_sliced"] == 2


def test_an_index_without_member_sidecars_still_loads_and_reads_parsed(tmp_path):
    shard = tmp_path / "w.tar"
    _webdataset_shard(shard, 500)
    _, url = write_index(str(shard), str(tmp_path))
    doc = json.loads((tmp_path / "index.json").read_text())
    del doc["shards"]["members"]  # as an index written before member sidecars
    (tmp_path / "index.json").write_text(json.dumps(doc))
    os.remove(tmp_path / "w.tar.members")
    manifest = load_manifest(url)
    counters = Counted()
    assert _samples(manifest, Range(0, 0, 500), counters) == _expected(shard)
    assert _samples(manifest, Range(0, 10, 20), counters) == _expected(shard)[10:20]
    assert "ranges_sliced" not in counters.counts and counters.counts["ranges_opened"] == 2


def test_stream_with_workers_reads_through_the_sidecar(tmp_path):
    for i in range(2):
        _webdataset_shard(tmp_path / f"w-{i:06d}.tar", 300, tag=f"s{i}-", seed=i)
    write_index(str(tmp_path / "w-{000000..000001}.tar"), str(tmp_path))
    dataset = shardstream.ShardStream(str(tmp_path), batch_size=50, shuffle=False, decode=False, world=World(0, 1), collate=lambda s: s)
    loader = shardstream.make_loader(dataset, num_workers=2)
    got = sorted((s["__key__"], s["bin"]) for batch in loader for s in batch)
    expected = sorted((k, b) for i in range(2) for k, b, _ in _expected(tmp_path / f"w-{i:06d}.tar"))
    assert got == expected
    stats = dataset.stats()
    assert stats["ranges_sliced"] == stats["ranges_opened"] >= 2


def _indexed(tmp_path, n: int = 400):
    shard = tmp_path / "w.tar"
    _webdataset_shard(shard, n)
    _, url = write_index(str(shard), str(tmp_path))
    return shard, url


def test_a_shard_rewritten_after_indexing_is_a_format_error_naming_it(tmp_path):
    shard, url = _indexed(tmp_path)
    manifest = load_manifest(url)
    _webdataset_shard(shard, 400, tag="j")  # same sizes, same offsets, other names: other headers
    assert shard.stat().st_size == manifest.shards[0].bytes
    for rng in (Range(0, 0, 400), Range(0, 100, 200)):
        with pytest.raises(ShardFormatError, match=r"w\.tar at byte \d+: .*changed since it was packed or indexed") as info:
            _samples(manifest, rng)
        assert str(shard) in str(info.value)


def test_a_shard_cut_short_after_indexing_is_a_format_error_naming_it(tmp_path):
    shard, url = _indexed(tmp_path)
    manifest = load_manifest(url)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardFormatError, match=r"w\.tar at byte \d+: stream ended"):
        _samples(manifest, Range(0, 0, 400))


def test_a_shard_rewritten_larger_never_gives_other_bytes(tmp_path):
    shard, url = _indexed(tmp_path)
    manifest = load_manifest(url)
    _webdataset_shard(shard, 400, size=1500, seed=5)  # the recorded offsets now land inside other members
    with pytest.raises(ShardFormatError, match="changed since it was packed or indexed"):
        _samples(manifest, Range(0, 0, 400))


def _rewrite_sidecar(path, change) -> None:
    body = bytearray(path.read_bytes()[:-DIGEST])
    change(body)
    path.write_bytes(bytes(body) + hashlib.sha256(body).digest())


@pytest.mark.parametrize(
    "damage",
    ["truncated", "longer", "flipped byte", "other shard", "offset into garbage (digest redone)", "start moved (digest redone)"],
)
def test_a_sidecar_that_does_not_fit_its_shard_is_a_manifest_error_naming_the_shard(tmp_path, damage):
    shard, url = _indexed(tmp_path)
    side = tmp_path / "w.tar.members"
    data = side.read_bytes()
    if damage == "truncated":
        side.write_bytes(data[:-100])
    elif damage == "longer":
        side.write_bytes(data + b"\0")
    elif damage == "flipped byte":
        side.write_bytes(data[:500] + bytes([data[500] ^ 1]) + data[501:])
    elif damage == "other shard":  # a sidecar from indexing another shard of as many samples
        other = tmp_path / "other"
        other.mkdir()
        _webdataset_shard(other / "w.tar", 400, tag="q", seed=3)
        write_index(str(other / "w.tar"), str(other))
        side.write_bytes((other / "w.tar.members").read_bytes())
    elif damage == "offset into garbage (digest redone)":
        starts = HEADER.size + 16 * 401  # the member data starts follow the two per-sample columns
        _rewrite_sidecar(side, lambda b: b.__setitem__(slice(starts, starts + 8), (10**12).to_bytes(8, "little")))
    else:
        starts = HEADER.size + 16 * 401 + 8 * 5  # member 5's start, one block on: still inside its sample
        _rewrite_sidecar(
            side, lambda b: b.__setitem__(slice(starts, starts + 8), (int.from_bytes(b[starts : starts + 8], "little") - 512).to_bytes(8, "little"))
        )
    manifest = load_manifest(url)
    if damage == "start moved (digest redone)":  # a sidecar that checks out on its own: the headers do not
        with pytest.raises(ShardFormatError, match="changed since it was packed or indexed") as fmt:
            _samples(manifest, Range(0, 0, 400))
        assert str(shard) in str(fmt.value)
        return
    with pytest.raises(ManifestError, match="re-run `shardstream index`") as info:
        _samples(manifest, Range(0, 0, 400))
    assert str(info.value).startswith(f"{shard}: its member sidecar {side}")


def test_a_members_column_of_the_wrong_shape_is_a_manifest_error(tmp_path):
    _, url = _indexed(tmp_path, 20)
    doc = json.loads((tmp_path / "index.json").read_text())
    doc["shards"]["members"] = ["x"]
    (tmp_path / "index.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="'shards.members' must be a list of 1 entries"):
        load_manifest(url)


def test_shards_that_cannot_be_sliced_get_no_sidecar_and_are_parsed(tmp_path):
    big = tmp_path / "big.tar"
    with wds.TarWriter(str(big)) as w:  # a member of LARGE_MEMBER bytes or more: parsed (read on its own)
        w.write({"__key__": "a", "bin": os.urandom(2 << 20)})
        w.write({"__key__": "b", "bin": b"small"})
    _, url = write_index(str(big), str(tmp_path))
    manifest = load_manifest(url)
    assert manifest.member_bytes.tolist() == [-1] and not (tmp_path / "big.tar.members").exists()
    assert "members" not in json.loads((tmp_path / "index.json").read_text())["shards"]
    counters = Counted()
    got = [(s["__key__"], s["bin"]) for c in read_range(manifest, Range(0, 0, 2), counters=counters) for s in c]
    assert got == [(k, b) for k, b, *_ in ((s["__key__"], s["bin"]) for s in wds.WebDataset(str(big), shardshuffle=False))]
    assert "ranges_sliced" not in counters.counts


def test_verify_checks_the_member_sidecar(tmp_path):
    from shardstream.tools.verify import verify_dataset

    shard, url = _indexed(tmp_path, 200)
    assert verify_dataset(load_manifest(url)) == []
    body = bytearray((tmp_path / "w.tar.members").read_bytes()[:-DIGEST])
    fp = HEADER.size + 16 * 201 + 8 * 400 + 8 * 3  # member 3's fingerprint, the digest redone: checks out on its own
    body[fp] ^= 1
    (tmp_path / "w.tar.members").write_bytes(bytes(body) + hashlib.sha256(body).digest())
    MEMBER_CACHE.clear()
    problems = verify_dataset(load_manifest(url))
    assert [str(p) for p in problems] == [
        f"{shard}: the member sidecar {tmp_path / 'w.tar.members'} is not what a scan of the shard records; {REBUILD}"
    ]


def test_s3_shards_are_sliced_with_read_ahead_and_from_a_cache(s3, tmp_path):
    from shardstream.options import Cache, Read, Store

    bucket, options, client = s3
    local = tmp_path / "w.tar"
    _webdataset_shard(local, 600)
    expected = {k: b for k, b, _ in _expected(local)}
    client.put_object(Bucket=bucket, Key="wds/w.tar", Body=local.read_bytes())
    write_index(f"s3://{bucket}/wds/w.tar", f"s3://{bucket}/wds", storage_options=options)
    assert client.head_object(Bucket=bucket, Key="wds/w.tar.members")["ContentLength"] > 0
    for store in (Store(options=options, read=Read(readahead_bytes=1 << 20)), Store(options=options, cache=Cache(str(tmp_path / "cache"), 1 << 30))):
        MEMBER_CACHE.clear()
        offsets_before, members_before = OFFSET_CACHE.fetches, MEMBER_CACHE.fetches
        stream = shardstream.ShardStream(
            f"s3://{bucket}/wds", batch_size=50, shuffle=False, decode=False, world=World(1, 3), collate=lambda s: s, store=store
        )
        got = {s["__key__"]: s["bin"] for b in stream for s in b}
        assert len(got) == 200 and all(expected[k] == v for k, v in got.items())  # rank 1: samples 200-399, mid-shard
        assert stream.stats()["ranges_sliced"] == stream.stats()["ranges_opened"] == 1
        # the member sidecar, read once, holds the range's offsets too: no offset sidecar is read
        assert (OFFSET_CACHE.fetches - offsets_before, MEMBER_CACHE.fetches - members_before) == (0, 1)


def test_verify_while_streaming_parses_and_hashes_every_header(tmp_path):
    from shardstream.pipeline.read import RangeSource, read_ranges

    shard, url = _indexed(tmp_path, 100)
    manifest = load_manifest(url)
    counters = Counted()
    source = RangeSource(manifest, counters=counters, verify_stream=True)
    got = [(s["__key__"], s["bin"], s["cls"]) for c in read_ranges(source, [Range(0, 0, 100), Range(0, 0, 50)]) for s in c]
    assert got == _expected(shard) + _expected(shard)[:50]
    # the whole shard is verified (parsed and hashed); the part of it is sliced
    assert counters.counts["shards_verified"] == 1 and counters.counts["ranges_sliced"] == 1
