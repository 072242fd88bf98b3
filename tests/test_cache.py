"""The local shard cache against the moto server: one download per shard across concurrent
processes, atomic fills, LRU eviction under the limit that never removes a shard being read,
reuse in the next epoch, and a limit that cannot work failing at construction."""

from __future__ import annotations

import json
import os

import pytest
from conftest import make_samples, rank_context, scaled, spawned_ranks, write_dataset

from shardstream import Cache, Read, ShardStream, Store, World, make_loader
from shardstream.errors import ConfigError, StorageError
from shardstream.stats import StreamStats
from shardstream.storage.cache import ShardCache


def cache_files(cache_dir):
    names = os.listdir(cache_dir)
    return sorted(n for n in names if n.endswith(".tar")), [n for n in names if ".partial-" in n]


def _read_all(rank, url, options, cache_dir, limit, out):
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options, cache=Cache(cache_dir, limit)))
    keys = [k for b in make_loader(ds, num_workers=2, pin_memory=False) for k in b["__key__"]]
    out.put((keys, ds.stats()))


def test_concurrent_processes_download_each_shard_once(s3, tmp_path):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/c", 100, size=2000, storage_options=options)
    cache_dir = str(tmp_path / "cache")
    # three processes of their own (from the suite's forkserver, which imported torch and
    # shardstream once, as the DDP tests' ranks do; spawn imported them in each: 3 interpreters)
    out = rank_context().Queue()
    with spawned_ranks(_read_all, 3, (url, options, cache_dir, 10**9, out)) as procs:
        results = [out.get(timeout=scaled(120)) for _ in procs]
        for p in procs:
            p.join(timeout=scaled(60))
            assert p.exitcode == 0
    expected = sorted(s["__key__"] for s in make_samples(100))
    assert all(sorted(keys) == expected for keys, _ in results)
    assert sum(stats["cache_misses"] for _, stats in results) == 5  # 5 shards, 3 processes x 2 workers
    ranges = sum(stats["ranges_opened"] for _, stats in results)  # workers may share a shard
    assert ranges >= 3 * 5 and sum(stats["cache_hits"] for _, stats in results) == ranges - 5
    tars, partials = cache_files(cache_dir)
    assert len(tars) == 5 and not partials


def test_next_epoch_reads_from_cache_only(s3, tmp_path):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/c", 100, size=2000, storage_options=options)
    ds = ShardStream(url, batch_size=4, world=World(0, 1), store=Store(options=options, cache=Cache(str(tmp_path / "cache"), 10**9)))
    first = sorted(k for b in ds for k in b["__key__"])
    after_first = ds.stats()
    ds.set_epoch(1)
    second = sorted(k for b in ds for k in b["__key__"])
    after_second = ds.stats()
    assert first == second
    assert after_first["cache_misses"] == 5 and after_second["cache_misses"] == 5
    assert after_second["bytes_read"] == after_first["bytes_read"]  # nothing more from storage
    assert after_second["cache_hits"] == after_first["cache_hits"] + 5


def test_eviction_keeps_the_cache_under_its_limit(s3, tmp_path):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/c", 100, size=2000, storage_options=options)
    shard_bytes = max(json.loads(open(_local_manifest(s3, url, tmp_path)).read())["shards"]["bytes"])
    limit = int(shard_bytes * 2.5)
    cache_dir = tmp_path / "cache"
    for epoch in range(2):
        store = Store(options=options, cache=Cache(str(cache_dir), limit), read=Read(readahead_bytes=0))
        ds = ShardStream(url, batch_size=4, world=World(0, 1), store=store)
        ds.set_epoch(epoch)
        assert sorted(k for b in ds for k in b["__key__"]) == sorted(s["__key__"] for s in make_samples(100))
        tars, partials = cache_files(cache_dir)
        assert sum(os.path.getsize(cache_dir / t) for t in tars) <= limit and len(tars) == 2 and not partials


def _local_manifest(s3, url, tmp_path):
    bucket, _, client = s3
    path = tmp_path / "index.json"
    path.write_bytes(client.get_object(Bucket=bucket, Key="c/index.json")["Body"].read())
    return path


def test_shard_in_use_is_never_evicted_and_full_cache_bypasses(tmp_path):
    cache = ShardCache(str(tmp_path / "cache"), limit_bytes=1500)
    stats = StreamStats()
    counters = stats.counters(0)

    def payload(byte):
        return lambda write: write(bytes([byte]) * 1000)

    held = cache.open("s3://b/a.tar", None, 1000, payload(1), counters)
    assert held is not None
    assert cache.open("s3://b/b.tar", None, 1000, payload(2), counters) is None  # a is being read
    assert stats.totals()["cache_bypass"] == 1
    assert held[0].read() == b"\x01" * 1000  # still there, intact
    ShardCache.release(*held)
    second = cache.open("s3://b/b.tar", None, 1000, payload(2), counters)  # now a can go
    assert second is not None and second[0].read() == b"\x02" * 1000
    ShardCache.release(*second)
    assert cache_files(tmp_path / "cache")[0] == [os.path.basename(cache.name("s3://b/b.tar", None, 1000))]


def test_checksum_mismatch_leaves_no_file(s3, tmp_path):
    bucket, options, client = s3
    # (no member sidecar: it would refuse the manifest's other sha256 before the cache is filled)
    url = write_dataset(f"s3://{bucket}/c", 20, size=2000, storage_options=options, member_sidecars=False)
    doc = json.loads(client.get_object(Bucket=bucket, Key="c/index.json")["Body"].read())
    doc["shards"]["sha256"][0] = "0" * 64
    client.put_object(Bucket=bucket, Key="c/index.json", Body=json.dumps(doc).encode())
    ds = ShardStream(url, batch_size=4, world=World(0, 1), store=Store(options=options, cache=Cache(str(tmp_path / "cache"), 10**9)))
    with pytest.raises(StorageError, match="sha256 .* does not match the manifest's 0000"):
        list(ds)
    tars, partials = cache_files(tmp_path / "cache")
    assert not tars and not partials


def test_limit_smaller_than_a_shard_is_a_clear_error(s3, tmp_path):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/c", 20, size=2000, storage_options=options)
    with pytest.raises(ConfigError, match=r"cache_limit 1000 bytes is smaller than shard s3://.*shard-000000.tar"):
        ShardStream(url, batch_size=4, world=World(0, 1), store=Store(options=options, cache=Cache(str(tmp_path / "cache"), 1000)))
    with pytest.raises(ConfigError, match="Cache.limit=.... is bytes of local disk"):
        Cache(str(tmp_path / "c"), 0)


def _cached_tars(cache_dir):
    return [os.path.join(cache_dir, n) for n in cache_files(cache_dir)[0]]


def _flip(path, at, mask):
    """XOR the byte at ``at`` of ``path`` with ``mask`` in place (the size stays); returns the byte as it was."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ mask]))
    return byte


def test_a_flipped_byte_in_a_cached_shard_is_never_served(s3, tmp_path, caplog):
    """A bit flipped on disk after the fill (same size): the next epoch's hit checks the copy
    against the checksum of its fill, drops it with a warning, counts it, fetches the shard again,
    and every sample comes out as packed."""
    import logging

    bucket, options, _ = s3
    samples = make_samples(60, size=2000, seed=5)
    url = write_dataset(f"s3://{bucket}/flip", samples=samples, max_count=20, storage_options=options)
    cache_dir = str(tmp_path / "cache")
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options, cache=Cache(cache_dir, 10**9)))
    assert sum(len(b["__key__"]) for b in ds) == 60
    tars = _cached_tars(cache_dir)
    assert len(tars) == 3 and all(os.path.exists(t[: -len(".tar")] + ".crc32") for t in tars)
    victim = tars[1]
    byte = _flip(victim, 700, 0x10)  # a byte inside a sample's data (past the first header)
    before = ds.stats()
    ds.set_epoch(1)
    with caplog.at_level(logging.WARNING, logger="shardstream.storage.cache"):
        got = {k: bytes(b) for batch in ds for k, b in zip(batch["__key__"], batch["bin"])}
    assert got == {s["__key__"]: s["bin"] for s in samples}  # every byte as packed
    after = ds.stats()
    assert after["cache_corrupt"] - before["cache_corrupt"] == 1
    assert after["cache_misses"] - before["cache_misses"] == 1 and after["cache_hits"] - before["cache_hits"] == 2
    assert any("does not match the CRC-32" in r.getMessage() and victim in r.getMessage() for r in caplog.records), caplog.text
    with open(victim, "rb") as f:  # fetched again: intact
        f.seek(700)
        assert f.read(1) == byte


def test_a_cached_shard_without_a_record_is_checked_once_against_the_manifest(s3, tmp_path):
    """A copy with no CRC record (filled by an older version) is hashed against the manifest's
    sha256 on its first hit and given a record: no refetch when it is intact, a refetch when not."""
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/legacy", 40, max_count=20, size=2000, storage_options=options)
    cache_dir = str(tmp_path / "cache")
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options, cache=Cache(cache_dir, 10**9)))
    assert sum(len(b["__key__"]) for b in ds) == 40
    tars = _cached_tars(cache_dir)
    for t in tars:
        os.unlink(t[: -len(".tar")] + ".crc32")
    _flip(tars[0], 600, 1)  # and one of them is damaged too
    before = ds.stats()
    ds.set_epoch(1)
    assert sorted(k for b in ds for k in b["__key__"]) == sorted(s["__key__"] for s in make_samples(40))
    after = ds.stats()
    assert after["cache_corrupt"] - before["cache_corrupt"] == 1 and after["cache_misses"] - before["cache_misses"] == 1
    assert all(os.path.exists(t[: -len(".tar")] + ".crc32") for t in tars)


def test_an_unusable_cache_directory_is_a_config_error_naming_it(s3, tmp_path):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/c", 20, size=2000, storage_options=options)
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a directory")
    for where, why in ((in_the_way, "a file is in the way"), (in_the_way / "cache", "a file is in the way")):
        with pytest.raises(ConfigError, match=rf"cache directory {where} cannot be used: {why}"):
            ShardStream(url, batch_size=4, world=World(0, 1), store=Store(options=options, cache=Cache(str(where), 10**9)))
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        # root writes through a directory's mode bits: /proc/self is one that refuses even root
        where = str(read_only) if not os.access(read_only, os.W_OK) else "/proc/self"
        with pytest.raises(ConfigError, match=rf"cache directory {where} cannot be used: .*(permission|read-only)"):
            ShardStream(url, batch_size=4, world=World(0, 1), store=Store(options=options, cache=Cache(where, 10**9)))
    finally:
        read_only.chmod(0o755)


def test_without_a_manifest_checksum_the_fill_record_still_guards_every_hit(tmp_path):
    """Shards with no sha256 in their manifest: the CRC-32 recorded at the fill still catches a
    flipped byte; a copy with neither record nor sha256 cannot be checked, and is fetched again
    (not counted as damage)."""
    cache = ShardCache(str(tmp_path / "cache"), limit_bytes=10_000)
    stats = StreamStats()
    counters = stats.counters(0)
    fills = []

    def payload(write):
        fills.append(1)
        write(bytes(range(250)) * 4)

    def read_once():
        handle = cache.open("s3://b/a.tar", None, 1000, payload, counters)
        assert handle is not None
        try:
            return handle[0].read()
        finally:
            ShardCache.release(*handle)

    assert read_once() == bytes(range(250)) * 4 and len(fills) == 1
    shard = cache.name("s3://b/a.tar", None, 1000)
    with open(shard, "r+b") as f:
        f.seek(500)
        f.write(b"\xff")
    assert read_once() == bytes(range(250)) * 4 and len(fills) == 2  # caught, fetched again
    assert stats.totals()["cache_corrupt"] == 1
    os.unlink(shard[: -len(".tar")] + ".crc32")
    assert read_once() == bytes(range(250)) * 4 and len(fills) == 3  # unverifiable: fetched again
    totals = stats.totals()
    assert totals["cache_corrupt"] == 1 and totals["cache_misses"] == 3 and totals["cache_hits"] == 0
    assert read_once() == bytes(range(250)) * 4 and len(fills) == 3 and stats.totals()["cache_hits"] == 1
