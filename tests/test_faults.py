"""S3 streaming through a fault-injecting proxy in front of the moto server: resets mid-object,
503 SlowDown, latency. The stream must produce exactly the samples of a clean run, in the same
order; permanent errors fail fast with what to check. Every test is bounded in time."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from conftest import make_samples, write_dataset
from faultproxy import FaultProxy

from shardstream import Read, ShardStream, Shuffle, Store, World, make_loader
from shardstream.errors import ManifestError, StorageError


def keys_and_bytes(url, options, rank, world, workers, read_size):
    ds = ShardStream(
        url, batch_size=5, seed=4, shuffle=Shuffle(20), world=World(rank, world), store=Store(options=options, read=Read(read_size=read_size))
    )
    loader = make_loader(ds, num_workers=workers, pin_memory=False)
    out = [(k, b) for batch in loader for k, b in zip(batch["__key__"], batch["bin"])]
    return out, ds.stats()


@pytest.mark.slow
def test_resets_slowdowns_and_latency_change_nothing(s3):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/f", 150, max_count=40, size=3000, storage_options=options)
    clean = {r: keys_and_bytes(url, options, r, 2, 2, 64 * 1024)[0] for r in (0, 1)}
    with FaultProxy(options["endpoint_url"], reset_after=20_000, slowdown_every=5, latency=0.002) as proxy:
        faulty_options = {"endpoint_url": proxy.url}
        for rank in (0, 1):
            got, stats = keys_and_bytes(url, faulty_options, rank, 2, 2, 64 * 1024)
            assert got == clean[rank]  # same samples, same bytes, same order
            assert stats["retries"] > 0 and stats["resumes"] > 0 and stats["throttles"] > 0
            assert stats["retries"] >= stats["resumes"]
    assert proxy.counts["resets"] > 0 and proxy.counts["slowdowns"] > 0


def test_stats_count_bytes_and_ranges(s3):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/f", 60, max_count=40, size=3000, storage_options=options)
    ds = ShardStream(url, batch_size=5, world=World(0, 1), store=Store(options=options))
    assert sum(len(b["__key__"]) for b in ds) == 60
    stats = ds.stats()
    assert stats["ranges_opened"] == 2 and stats["bytes_read"] > 60 * 100 and stats["retries"] == 0


def test_missing_shard_fails_fast_naming_it(s3):
    bucket, options, client = s3
    url = write_dataset(f"s3://{bucket}/f", 60, max_count=40, size=3000, storage_options=options)
    client.delete_object(Bucket=bucket, Key="f/shard-000001.tar")
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=options))
    with pytest.raises(StorageError, match=r"shard-000001.tar: not found \(it is listed in the manifest"):
        list(ds)
    assert ds.stats()["retries"] == 0  # fails fast: no retry on a 404


def test_missing_bucket_and_unreachable_endpoint_fail_with_what_to_check(s3_endpoint):
    started = time.monotonic()
    with pytest.raises(ManifestError, match="no-such-bucket-x"):
        ShardStream("s3://no-such-bucket-x/data", batch_size=1, world=World(0, 1), store=Store(options={"endpoint_url": s3_endpoint}))
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ManifestError, match="cannot read the manifest"):
        ShardStream(
            "s3://bucket/data",
            batch_size=1,
            world=World(0, 1),
            store=Store(options={"endpoint_url": dead, "config_kwargs": {"retries": {"max_attempts": 1}}}),
        )
    assert time.monotonic() - started < 60


def test_unreachable_endpoint_mid_stream_gives_up_after_bounded_retries(s3):
    from shardstream.errors import StorageUnavailable
    from shardstream.storage.config import StorageConfig

    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/f", 40, max_count=40, size=3000, storage_options=options)
    ds = ShardStream(url, batch_size=5, world=World(0, 1), store=Store(options=options, config=StorageConfig(backoff_cap=0.05)))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    ds.storage_options = {"endpoint_url": dead}  # the store goes away after planning
    with pytest.raises(StorageUnavailable, match=r"connection refused .* after 8 tries in .*check the endpoint URL and the network"):
        list(ds)
    assert ds.stats()["retries"] == 7  # bounded: 8 tries, then the error


@pytest.mark.parametrize("cut", ["rst", "fin"])
@pytest.mark.parametrize("direct_get", [True, False], ids=["direct", "s3fs"])
def test_cut_bodies_resume_where_they_broke_on_both_paths(s3, direct_get, cut):
    """Every GET body is cut after 40 KB (a TCP reset or an orderly close): both S3 paths keep the
    bytes that arrived and resume at the byte where the cut fell, and every byte comes through intact
    (direct GETs once restarted every try from the range's first byte and gave up after 8 tries)."""
    from shardstream.storage.config import StorageConfig
    from shardstream.storage.ranges import resolve

    bucket, options, _ = s3
    samples = make_samples(36, size=60_000, seed=3)  # ~1 MB in two shards (moto copies an object per GET)
    url = write_dataset(f"s3://{bucket}/cut", samples=samples, max_count=18, storage_options=options)
    config = StorageConfig(direct_get=direct_get, backoff_base=0.001, backoff_cap=0.01)
    with FaultProxy(options["endpoint_url"], reset_after=40_000, cut=cut) as proxy:
        faulty = {"endpoint_url": proxy.url}
        fetch = resolve(f"{url}/shard-000000.tar", faulty, config)[2]
        assert fetch is not None and fetch.kind == ("direct" if direct_get else "s3fs")
        ds = ShardStream(
            url,
            batch_size=4,
            shuffle=False,
            world=World(0, 1),
            store=Store(options=faulty, config=config, read=Read(read_size=256 << 10, readahead_bytes=0)),
        )
        got = {k: bytes(b) for batch in ds for k, b in zip(batch["__key__"], batch["bin"])}
        stats = ds.stats()
    assert got == {s["__key__"]: s["bin"] for s in samples}  # every byte, none lost, none repeated
    assert proxy.counts["resets"] > 0 and stats["resumes"] > 0
    assert stats["bytes_read"] == int(ds.manifest.sizes.sum())  # each shard's bytes exactly once


@pytest.mark.parametrize("direct_get", [True, False], ids=["direct", "s3fs"])
def test_an_offset_sidecar_is_read_under_the_streams_storage_config(s3, direct_get):
    """The sidecar a range inside a shard needs is read with the stream's StorageConfig (its tries,
    deadline and timeouts), like the shard's bytes: here 2 tries of a store that throttles every
    GET, where the default policy would make 8."""
    from shardstream import StorageConfig
    from shardstream.format.offsets import OFFSET_CACHE

    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/sidecar-policy", 80, max_count=20, size=2000, storage_options=options)
    OFFSET_CACHE.clear()
    config = StorageConfig(direct_get=direct_get, max_attempts=2, backoff_base=0.001, backoff_cap=0.01)
    with FaultProxy(options["endpoint_url"]) as proxy:
        # 3 ranks of 25 samples: rank 1 starts inside shard 1 (samples 5-20): its sidecar first
        ds = ShardStream(url, batch_size=5, shuffle=False, world=World(1, 3), store=Store(options={"endpoint_url": proxy.url}, config=config))
        proxy.slowdown_every = 1  # from here every GET is answered 503 SlowDown
        with pytest.raises(StorageError, match=r"shard-000001\.tar\.idx: .*offset sidecar.*after 2 tries"):
            list(ds)
    # each read of a sidecar (the range's opener and the parser may each try one) made 2 tries, not 8
    sidecar_gets = Counter(p.split("?")[0] for method, p, _ in proxy.log if method == "GET" and p.split("?")[0].endswith(".idx"))
    assert sidecar_gets and all(n % 2 == 0 and n < StorageConfig().max_attempts for n in sidecar_gets.values()), sidecar_gets


def test_show_reads_its_samples_under_its_storage_config(s3):
    """``shardstream show`` (tools.preview) reads samples, and looks for a key, with the command's
    StorageConfig: 2 tries of a store that throttles every GET, not the default 8."""
    from shardstream import StorageConfig
    from shardstream.format.manifest import load_manifest
    from shardstream.format.offsets import OFFSET_CACHE
    from shardstream.tools.preview import find_key, iter_dataset_samples

    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/show-policy", 20, max_count=10, size=500, storage_options=options)
    OFFSET_CACHE.clear()
    config = StorageConfig(max_attempts=2, backoff_base=0.001, backoff_cap=0.01)
    with FaultProxy(options["endpoint_url"]) as proxy:
        proxied = {"endpoint_url": proxy.url}
        manifest = load_manifest(url, proxied, config=config)
        proxy.slowdown_every = 1  # from here every GET is answered 503 SlowDown
        with pytest.raises(StorageError, match="after 2 tries"):
            next(iter_dataset_samples(manifest, proxied, config=config))
        with pytest.raises(StorageError, match="after 2 tries"):
            find_key(manifest, "no-such-key", proxied, config=config)
