"""Retries that end: a read whose every answer is cut after a few bytes fails at about the deadline
with a StorageUnavailable naming the resets, after a bounded number of GETs (once every byte
received started the deadline again, and the read went on without end at about 186 GETs a second);
a slow read that keeps making real progress still succeeds; and every wait, the backoff sleeps of
a 503 burst included, is counted in ``storage_wait_us``."""

from __future__ import annotations

import time

import pytest
from conftest import load_factor, scaled, write_dataset
from faultproxy import FaultProxy

from shardstream import Read, ShardStream, StorageConfig, Store, World
from shardstream.errors import StorageUnavailable


def _samples(n, size, seed):
    """n samples of exactly ``size`` random bytes each."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"__key__": f"s{i:06d}", "bin": rng.bytes(size), "cls": i % 7, "txt": f"sample {i}"} for i in range(n)]


def _gets(proxy, name):
    return sum(1 for method, path, _ in proxy.log if method == "GET" and name in path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("s3_client", ["obstore", "s3fs"])
def test_a_read_cut_after_a_few_bytes_every_time_ends_at_the_deadline(s3, s3_client):
    bucket, options, _ = s3
    samples = _samples(8, 40_000, seed=1)  # one shard of ~330 KB
    url = write_dataset(f"s3://{bucket}/cut-early", samples=samples, max_count=8, storage_options=options, member_sidecars=False)
    deadline = 2.0
    config = StorageConfig(s3_client=s3_client, deadline=deadline, backoff_base=0.05, backoff_cap=0.5)
    with FaultProxy(options["endpoint_url"], cut="rst") as proxy:
        store = Store(options={"endpoint_url": proxy.url}, config=config, read=Read(readahead_bytes=0))
        ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=store)
        proxy.reset_after = 16  # from here every GET's body is cut after 16 bytes
        began = time.monotonic()
        with pytest.raises(StorageUnavailable, match=r"shard-000000\.tar: .* tries in .*connections reset after \d+ bytes") as info:
            list(ds)
        took = time.monotonic() - began
    gets = _gets(proxy, "shard-000000.tar")
    assert info.value.url.endswith("shard-000000.tar")
    assert info.value.resets >= 2 and info.value.resets <= gets
    assert took < scaled(deadline + 3.0), took  # ends at about the deadline, not at a watchdog
    # backed off: a few dozen GETs at most (once: one GET per 16 bytes, with no pause, 20,000 for this shard)
    assert 2 <= gets <= 40, gets
    assert ds.stats()["storage_wait_us"] >= 0.5 * deadline * 1e6  # the backoff sleeps are counted


@pytest.mark.timeout(60)
@pytest.mark.parametrize("s3_client", ["obstore", "s3fs"])
def test_a_slow_read_cut_after_real_progress_still_succeeds(s3, s3_client):
    """Bodies cut after 100 KB (more than the 64 KiB of real progress) at 300 KB/s: the shard (~2 s
    of transfer) takes longer than the 1 s deadline and is cut 5 times, and every byte still comes
    through. On a loaded machine the deadline is longer and the link slower by the same factor (a
    try must still make 64 KiB of progress, 0.2 s of transfer, within what is left of its budget,
    which a busy CPU slows too: the budget leaves it 5 times that)."""
    bucket, options, _ = s3
    samples = _samples(12, 50_000, seed=2)  # one shard of ~610 KB
    url = write_dataset(f"s3://{bucket}/slow", samples=samples, max_count=12, storage_options=options)
    slower = load_factor()
    config = StorageConfig(s3_client=s3_client, deadline=1.0 * slower, backoff_base=0.05, backoff_cap=0.2)
    with FaultProxy(options["endpoint_url"], cut="fin") as proxy:
        store = Store(options={"endpoint_url": proxy.url}, config=config, read=Read(readahead_bytes=0))
        ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=store)
        proxy.reset_after, proxy.bandwidth = 100_000, int(300_000 / slower)
        began = time.monotonic()
        got = {k: bytes(b) for batch in ds for k, b in zip(batch["__key__"], batch["bin"])}
        took = time.monotonic() - began
    assert got == {s["__key__"]: s["bin"] for s in samples}
    assert took > config.deadline  # the read as a whole outlasted the deadline: progress kept it going
    assert proxy.counts["resets"] >= 4 and ds.stats()["resumes"] >= 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("s3_client", ["obstore", "s3fs"])
def test_the_backoff_of_a_503_burst_is_counted_as_storage_wait(s3, s3_client):
    """A burst of 503 SlowDown answers the loader waits out: ``storage_wait_us`` holds most of the
    time the read took (it once counted only the requests' own time, 0.2 s of 20-50 s)."""
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/burst-wait", 20, max_count=20, size=2000, storage_options=options)
    config = StorageConfig(s3_client=s3_client, backoff_base=0.2, backoff_cap=0.4)
    with FaultProxy(options["endpoint_url"]) as proxy:
        store = Store(options={"endpoint_url": proxy.url}, config=config, read=Read(readahead_bytes=0))
        ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=store)
        proxy.slowdown_burst = 10
        began = time.monotonic()
        keys = [k for batch in ds for k in batch["__key__"]]
        waited = time.monotonic() - began
    assert len(keys) == 20 and proxy.counts["slowdowns"] == 10
    stats = ds.stats()
    assert stats["throttles"] == 10
    assert waited > 0.3  # (10 backoffs of up to 0.4 s each)
    assert stats["storage_wait_us"] >= 0.7 * waited * 1e6, (stats["storage_wait_us"], waited)
