"""Issue 10: fail fast, stay bounded, stay inside the dataset. Real parts only: the moto server,
the fault proxy (stalls after accept and after headers), DataLoader workers, processes killed
with SIGKILL, and a size-limited tmpfs for a full disk."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time

import pytest
from conftest import drop_member_sidecars, make_samples, rank_context, scaled, spawned_ranks
from faultproxy import FaultProxy

from shardstream import Cache, Read, ShardStream, ShardWriter, Store, World, make_loader
from shardstream.errors import ManifestError, ShardFormatError, StorageTimeout
from shardstream.storage.config import StorageConfig

# a try's timeouts of 1 s, tries until a deadline of 3 s: a stalled store is tried at least twice
FAST = StorageConfig(connect_timeout=1, read_timeout=1, deadline=3, max_attempts=8, backoff_cap=0.2)


def write_s3(bucket, options, prefix="ds", n=60, max_count=20, size=2000, member_sidecars=True):
    with ShardWriter(f"s3://{bucket}/{prefix}", max_count=max_count, storage_options=options) as w:
        for s in make_samples(n, size=size):
            w.write(s)
    if not member_sidecars:  # (the first request of a shard's read is then the shard's own)
        drop_member_sidecars(f"s3://{bucket}/{prefix}", options)
    return f"s3://{bucket}/{prefix}"


# -- a hung server ends in a bounded time, with the right message ---------------------------------
@pytest.mark.parametrize("stall", ["accept", "headers"])
def test_stalled_shard_read_fails_within_the_deadline(s3, stall):
    bucket, options, _ = s3
    url = write_s3(bucket, options, member_sidecars=False)
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=options, config=FAST, read=Read(readahead_bytes=0)))
    with FaultProxy(options["endpoint_url"], stall=stall) as proxy:
        ds.storage_options = {"endpoint_url": proxy.url}  # the store hangs after planning
        started = time.monotonic()
        with pytest.raises(StorageTimeout, match=r"s3://.*/ds/shard-000000.tar: .*timeout.* after \d+ tries in"):
            list(ds)
        waited = time.monotonic() - started
    assert waited < FAST.deadline + 10  # generous margin on a loaded machine; the point is "not 8 x 60 s"
    tries = proxy.counts["stalls"]
    assert tries >= 2 and ds.stats()["retries"] == tries - 1  # every try counted, the last one raised


def test_stalled_manifest_read_fails_within_the_deadline(s3):
    bucket, options, _ = s3
    url = write_s3(bucket, options, n=20)
    with FaultProxy(options["endpoint_url"], stall="headers") as proxy:
        started = time.monotonic()
        with pytest.raises(ManifestError, match=r"cannot read the manifest: s3://.*/ds/index.json: .*timeout") as info:
            ShardStream(url, batch_size=5, world=World(0, 1), store=Store(options={"endpoint_url": proxy.url}, config=FAST))
        assert time.monotonic() - started < FAST.deadline + 10
    assert isinstance(info.value.__cause__, StorageTimeout) and "packed dataset root" not in str(info.value)
    assert proxy.counts["stalls"] >= 2


def test_stall_reaches_the_training_loop_as_the_same_type_through_workers(s3):
    bucket, options, _ = s3
    url = write_s3(bucket, options)
    ds = ShardStream(url, batch_size=5, world=World(0, 1), store=Store(options=options, config=FAST))
    with FaultProxy(options["endpoint_url"], stall="accept") as proxy:
        ds.storage_options = {"endpoint_url": proxy.url}
        with pytest.raises(StorageTimeout, match="timeout"):
            list(make_loader(ds, num_workers=2, pin_memory=False))


def test_default_policy_bounds_a_dead_endpoint_within_a_minute():
    cfg = StorageConfig()
    assert cfg.deadline <= 60 and cfg.connect_timeout < cfg.deadline and cfg.read_timeout < cfg.deadline


# -- a manifest cannot reach outside its dataset --------------------------------------------------
@pytest.mark.parametrize("entry", ["/etc/passwd", "file:///etc/passwd", "../other/x.tar", "s3://{other}/x.tar", "sub/../../other/x.tar"])
def test_manifest_entries_outside_the_root_are_refused(s3, entry):
    bucket, options, client = s3
    url = write_s3(bucket, options, n=20)
    other = f"{bucket}-o"
    doc = json.loads(client.get_object(Bucket=bucket, Key="ds/index.json")["Body"].read())
    doc["shards"]["path"][0] = entry.format(other=other)  # manifest v2: shards as columns
    client.put_object(Bucket=bucket, Key="ds/index.json", Body=json.dumps(doc).encode())
    with FaultProxy(options["endpoint_url"]) as proxy:
        with pytest.raises(ManifestError, match=r"shard #0 .* points outside the dataset's root"):
            ShardStream(url, batch_size=4, world=World(0, 1), store=Store(options={"endpoint_url": proxy.url}))
        assert proxy.counts["requests"] == 1  # the manifest's one GET: no shard was touched


def test_allow_list_lets_a_dataset_span_buckets(s3):
    bucket, options, client = s3
    url = write_s3(bucket, options, n=40)
    other = f"{bucket}-o"
    client.create_bucket(Bucket=other)
    for name in ("shard-000001.tar", "shard-000001.tar.idx", "shard-000001.tar.members"):  # the shard and its sidecars
        client.copy_object(Bucket=other, Key=f"x/{name}", CopySource={"Bucket": bucket, "Key": f"ds/{name}"})
    client.delete_object(Bucket=bucket, Key="ds/shard-000001.tar")
    doc = json.loads(client.get_object(Bucket=bucket, Key="ds/index.json")["Body"].read())
    doc["shards"]["path"][1] = f"s3://{other}/x/shard-000001.tar"
    client.put_object(Bucket=bucket, Key="ds/index.json", Body=json.dumps(doc).encode())
    with pytest.raises(ManifestError, match="points outside"):
        ShardStream(url, batch_size=4, world=World(0, 1), store=Store(options=options))
    allowed = StorageConfig(allow_roots=(f"s3://{other}/x",))
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options, config=allowed))
    keys = [k for b in make_loader(ds, num_workers=2, pin_memory=False) for k in b["__key__"]]
    assert sorted(keys) == sorted(s["__key__"] for s in make_samples(40))


def test_manifest_and_header_that_lie_about_sizes(tmp_path):
    root = tmp_path / "d"
    with ShardWriter(str(root), max_count=10) as w:
        for s in make_samples(10):
            w.write(s)
    drop_member_sidecars(root)  # (its member sidecar would refuse the manifest's sizes at once: test_members.py)
    doc = json.loads((root / "index.json").read_text())
    columns = doc["shards"]
    huge = 1 << 50
    columns["bytes"][0] = huge + 4096
    columns["data_end"][0] = huge  # the last sample "ends" a petabyte in
    columns["sha256"][0] = None
    (root / "index.json").write_text(json.dumps(doc))
    ds = ShardStream(str(root), batch_size=10, shuffle=False, world=World(0, 1))
    assert sum(len(b["__key__"]) for b in ds) == 10  # the samples themselves are intact
    path = root / "shard-000000.tar"
    data = bytearray(path.read_bytes())
    data[124:136] = b"%011o\0" % (huge // 2)  # the first member's header claims half a petabyte
    data[148:156] = b" " * 8
    data[148:156] = b"%06o\0 " % sum(data[:512])  # with a valid checksum: only the size lies
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match=r"shard-000000.tar at byte \d+: .*(truncated|ended)"):
        list(ShardStream(str(root), batch_size=10, shuffle=False, world=World(0, 1)))


# -- the shard cache keeps its promise ------------------------------------------------------------
def _du(path):
    total = 0
    for name in os.listdir(path):
        try:
            total += os.stat(os.path.join(path, name)).st_size
        except FileNotFoundError:
            pass
    return total


def _read_rank(rank, url, options, cache_dir, limit, out):
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(rank, 2), store=Store(options=options, cache=Cache(cache_dir, limit)))
    keys = [k for b in make_loader(ds, num_workers=2, pin_memory=False) for k in b["__key__"]]
    out.put((rank, keys))


def _slow_fill(rank, url, endpoint, cache_dir, limit):
    store = Store(options={"endpoint_url": endpoint}, cache=Cache(cache_dir, limit), read=Read(readahead_bytes=0))
    ds = ShardStream(url, batch_size=4, world=World(0, 1), store=store)
    for _ in ds:
        pass


def test_killed_fill_is_reclaimed_and_the_limit_holds_across_processes(s3, tmp_path):
    bucket, options, _ = s3
    url = write_s3(bucket, options, n=120, max_count=10, size=4000)  # 12 shards of about 25 KB
    cache_dir = str(tmp_path / "cache")
    manifest = ShardStream(url, batch_size=4, world=World(0, 1), store=Store(options=options)).manifest
    limit = int(max(s.bytes for s in manifest.shards) * 3.5)
    # processes of their own, from the suite's forkserver (torch and shardstream imported once
    # there, as the DDP tests' ranks are; spawn imported them in each of the 3)
    with FaultProxy(options["endpoint_url"], bandwidth=20_000) as proxy:  # slow: the kill lands mid-download
        with spawned_ranks(_slow_fill, 1, (url, proxy.url, cache_dir, limit)) as (victim,):
            deadline = time.monotonic() + scaled(60)
            while not (os.path.isdir(cache_dir) and any(".partial-" in n for n in os.listdir(cache_dir))):
                assert time.monotonic() < deadline and victim.is_alive()
                time.sleep(0.05)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join()
    assert any(".partial-" in n for n in os.listdir(cache_dir))  # the leftover a dead process leaves
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _du(cache_dir))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    out = rank_context().Queue()
    try:
        with spawned_ranks(_read_rank, 2, (url, options, cache_dir, limit, out)) as procs:
            results = dict(out.get(timeout=scaled(180)) for _ in procs)
            for p in procs:
                p.join(timeout=scaled(60))
                assert p.exitcode == 0
    finally:
        stop.set()
        watcher.join()
    assert sorted(results[0] + results[1]) == sorted(s["__key__"] for s in make_samples(120))
    assert 0 < peak[0] <= limit  # a hard bound at every poll, 2 ranks x 2 workers on one directory
    names = os.listdir(cache_dir)
    assert not any(".partial-" in n for n in names) and any(n.endswith(".tar") for n in names)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    path = tmp_path / "tmpfs"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_falls_back_to_streaming_with_one_warning(s3, tiny_tmpfs, caplog):
    bucket, options, _ = s3
    url = write_s3(bucket, options, n=120, max_count=10, size=4000)  # 12 shards of ~25 KB on a 64 KB disk
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options, cache=Cache(str(tiny_tmpfs), 10**9)))
    with caplog.at_level(logging.WARNING, logger="shardstream"):
        keys = [k for b in ds for k in b["__key__"]]
    assert sorted(keys) == sorted(s["__key__"] for s in make_samples(120))  # every sample once
    full = [r for r in caplog.records if "disk is full" in r.getMessage()]
    assert len(full) == 1
    stats = ds.stats()
    assert stats["cache_bypass"] >= 1 and stats["cache_misses"] == 12
    names = os.listdir(tiny_tmpfs)
    assert not any(".partial-" in n for n in names) and any(n.endswith(".tar") for n in names)


def test_shard_larger_than_the_limit_is_streamed_not_cached(s3, tmp_path, caplog):
    bucket, options, client = s3
    with ShardWriter(f"s3://{bucket}/mixed", max_count=10, storage_options=options) as w:
        for s in make_samples(15, size=4000):  # one full shard of 10 samples, one of 5
            w.write(s)
    url = f"s3://{bucket}/mixed"
    doc = json.loads(client.get_object(Bucket=bucket, Key="mixed/index.json")["Body"].read())
    small, big = sorted(doc["shards"]["bytes"])
    cache_dir = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="shardstream"):
        ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=options, cache=Cache(str(cache_dir), small + 100)))
    assert any("larger than cache_limit" in r.getMessage() for r in caplog.records)
    assert sorted(k for b in ds for k in b["__key__"]) == sorted(s["__key__"] for s in make_samples(15))
    tars = [os.path.getsize(cache_dir / n) for n in os.listdir(cache_dir) if n.endswith(".tar")]
    assert ds.stats()["cache_bypass"] == 1 and tars == [small] and _du(cache_dir) <= small + 100  # (the shard and its checksum record)


def test_local_manifest_refuses_climbing_out_and_remote_urls(tmp_path):
    root = tmp_path / "d"
    with ShardWriter(str(root), max_count=10) as w:
        for s in make_samples(20):
            w.write(s)
    doc = json.loads((root / "index.json").read_text())
    for entry in ("../other/x.tar", "sub/../../x.tar", "s3://bucket/x.tar", "memory://x.tar"):
        bad = json.loads(json.dumps(doc))
        bad["shards"]["path"][0] = entry
        (root / "index.json").write_text(json.dumps(bad))
        with pytest.raises(ManifestError, match=r"shard #0 .* points outside the dataset's root"):
            ShardStream(str(root), batch_size=4, world=World(0, 1))
    moved = tmp_path / "elsewhere.tar"  # what `shardstream index` writes for a shard outside DEST
    (root / "shard-000000.tar").rename(moved)
    (root / "shard-000000.tar.members").rename(f"{moved}.members")  # its member sidecar goes with it
    doc["shards"]["path"][0] = str(moved)
    (root / "index.json").write_text(json.dumps(doc))
    ds = ShardStream(str(root), batch_size=4, world=World(0, 1))
    assert sorted(k for b in ds for k in b["__key__"]) == sorted(s["__key__"] for s in make_samples(20))
