"""Datasets at scale: manifest version 2 (offset sidecars read only when a range needs them),
upgrade from version 1, verify of sidecars, small pickles; packing as shard tasks on a process
pool and on a real Dask LocalCluster (local disk and moto S3, a worker killed mid-pack); merge."""

from __future__ import annotations

import json
import os
import pickle
import struct
import threading
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import distributed
import numpy as np
import pytest
from conftest import drop_member_sidecars, make_samples, write_image_folder
from packfns import make_pair  # importable by pack's spawned workers without this module's imports

from shardstream import ShardStream, ShardWriter, Shuffle, World
from shardstream.cli.main import main
from shardstream.errors import ManifestError, SourceError
from shardstream.format.manifest import Manifest, ShardInfo, load_manifest
from shardstream.format.offsets import OFFSET_CACHE, OffsetCache, sidecar_size
from shardstream.tools.merge import merge_datasets
from shardstream.tools.verify import verify_dataset
from shardstream.write.pack import pack


def write(root, n=60, max_count=10, size=100):
    with ShardWriter(str(root), max_count=max_count) as w:
        for s in make_samples(n, size=size):
            w.write(s)
    return str(root)


def keys_of(ds):
    return [k for b in ds for k in b["__key__"]]


def files_of(root):
    """Every file under root (bytes), the manifest without its creation time."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            data = open(path, "rb").read()
            if name == "index.json":
                doc = json.loads(data)
                doc.pop("created")
                data = json.dumps(doc).encode()
            out[os.path.relpath(path, root)] = data
    return out


def objects_of(client, bucket, prefix):
    out = {}
    for obj in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
        data = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        if obj["Key"].endswith("index.json"):
            doc = json.loads(data)
            doc.pop("created")
            data = json.dumps(doc).encode()
        out[obj["Key"][len(prefix) + 1 :]] = data
    return out


def to_version_1(root):
    """Rewrite a dataset's manifest in the old format (offsets inline) and drop its sidecars."""
    manifest = load_manifest(root)
    doc = json.loads(open(os.path.join(root, "index.json")).read())
    doc["version"] = 1
    doc["shards"] = [
        {
            "path": manifest.paths[i],
            "samples": int(manifest.counts[i]),
            "bytes": int(manifest.sizes[i]),
            "sha256": manifest.sha256(i),
            "offsets": manifest.offsets(i).tolist(),
        }
        for i in range(len(manifest.paths))
    ]
    for path in manifest.paths:
        os.unlink(os.path.join(root, path + ".idx"))
    with open(os.path.join(root, "index.json"), "w") as f:
        json.dump(doc, f)


# -- manifest version 2 ---------------------------------------------------------------------------
def _two_shards(url: str, options: dict) -> Manifest:
    """20 samples in two shards (each with its offset sidecar, and no member sidecar: what these
    tests read is the offset sidecar) under ``url``; their manifest."""
    with ShardWriter(url, max_count=10, storage_options=options) as w:
        for s in make_samples(20):
            w.write(s)
    drop_member_sidecars(url, options)
    return load_manifest(url, storage_options=options)


def test_a_sidecar_is_one_ranged_get_on_s3_and_a_longer_one_is_refused(s3, monkeypatch):
    import s3fs

    bucket, options, client = s3
    manifest = _two_shards(f"s3://{bucket}/side", options)
    heads = []
    real_info = s3fs.S3FileSystem._info

    async def counting_info(self, path, *args, **kwargs):
        heads.append(path)
        return await real_info(self, path, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_info", counting_info)
    OFFSET_CACHE.clear()
    a, b = manifest.byte_range(0, 2, 5, options)  # inside the shard: its sidecar is read
    assert heads == [] and 0 < a < b < int(manifest.sizes[0])
    key = "side/shard-000001.tar.idx"
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=body + b"\0" * 8)  # overwritten by something longer
    with pytest.raises(ManifestError, match="expected"):
        manifest.byte_range(1, 2, 5, options)


def test_an_s3_manifest_is_one_get_without_a_head_and_a_large_one_is_read_whole(s3, monkeypatch):
    """The manifest is the first request of every run: one ranged GET of up to FIRST_READ_OBJECT
    bytes, no HEAD first. A manifest that fills that read is read whole, by its size. A missing
    manifest is still reported as one."""
    import s3fs

    from shardstream.storage import objects, ranges

    bucket, options, _ = s3
    url = f"s3://{bucket}/manifest-reads"
    _two_shards(url, options)
    heads = []  # HEADs by either S3 client: obstore's (the default) and s3fs's
    real_info, real_size = s3fs.S3FileSystem._info, objects.Client.size

    async def counting_info(self, path, *args, **kwargs):
        heads.append(path)
        return await real_info(self, path, *args, **kwargs)

    def counting_size(self, path):
        heads.append(path)
        return real_size(self, path)

    monkeypatch.setattr(s3fs.S3FileSystem, "_info", counting_info)
    monkeypatch.setattr(objects.Client, "size", counting_size)
    whole = load_manifest(url, storage_options=options)
    assert heads == [] and len(whole.paths) == 2
    monkeypatch.setattr(ranges, "FIRST_READ_OBJECT", 100)  # far less than the manifest's size
    big = load_manifest(url, storage_options=options)
    assert [p for p in heads if p.endswith("index.json")] and big.paths == whole.paths
    assert big.counts.tolist() == whole.counts.tolist() and big.sizes.tolist() == whole.sizes.tolist()
    monkeypatch.setattr(ranges, "FIRST_READ_OBJECT", 8 << 20)
    with pytest.raises(ManifestError, match="not found"):
        load_manifest(f"s3://{bucket}/no-such-dataset", storage_options=options)


def test_a_sidecar_read_survives_a_throttled_answer(s3):
    from faultproxy import FaultProxy

    from shardstream.storage.ranges import read_head

    bucket, options, _ = s3
    url = f"s3://{bucket}/retried"
    manifest = _two_shards(url, options)
    clean = manifest.byte_range(0, 2, 5, options)
    OFFSET_CACHE.clear()
    with FaultProxy(options["endpoint_url"], slowdown_every=2) as proxy:
        faulty = {"endpoint_url": proxy.url}
        assert read_head(f"{url}/shard-000000.tar", 512, faulty)[:1]  # the proxy's first GET passes
        assert manifest.byte_range(0, 2, 5, faulty) == clean  # its second, the sidecar's, is answered 503 first
    assert proxy.counts["slowdowns"] == 1


def test_manifest_grows_with_shards_and_sidecars_hold_the_offsets(tmp_path):
    small = load_manifest(write(tmp_path / "a", n=20, max_count=10))
    large = load_manifest(write(tmp_path / "b", n=2000, max_count=1000))
    size_a = os.path.getsize(tmp_path / "a" / "index.json")
    size_b = os.path.getsize(tmp_path / "b" / "index.json")
    assert abs(size_a - size_b) < 64  # 2 shards each: 100x the samples, the same manifest size
    assert os.path.getsize(tmp_path / "b" / "shard-000000.tar.idx") == sidecar_size(1000) == 16 + 8 * 1001
    assert small.version == large.version == 2 and not large._inline
    offsets = large.offsets(1)
    tar = (tmp_path / "b" / "shard-000001.tar").read_bytes()
    assert len(offsets) == 1001 and offsets[0] == 0 and (large.spans[1] == (offsets[0], offsets[-1])).all()
    assert all(tar[o + 257 : o + 262] == b"ustar" for o in offsets[:-1])  # each one a tar header


def test_whole_shard_ranges_read_no_sidecar_and_partial_ones_one_each(tmp_path):
    root = write(tmp_path / "d", n=60, max_count=10)
    drop_member_sidecars(root)  # (with them, the member sidecar holds the offsets: test_pack_members.py)
    OFFSET_CACHE.clear()
    before = OFFSET_CACHE.fetches
    ds = ShardStream(root, batch_size=10, shuffle=False, world=World(0, 1))
    assert len(keys_of(ds)) == 60 and OFFSET_CACHE.fetches == before  # six whole shards: no sidecar read
    got = []
    for rank in range(4):  # 4 ranks x 15 samples: ranks 0-2 end inside a shard, ranks 1-3 start inside one
        got += keys_of(ShardStream(root, batch_size=5, shuffle=False, world=World(rank, 4)))
    assert sorted(got) == [f"s{i:06d}" for i in range(60)]
    assert OFFSET_CACHE.fetches - before == 2  # shards 1 and 4 are split: each sidecar read once (then cached)


def test_offset_cache_is_bounded():
    cache = OffsetCache(max_bytes=3 * 8 * 100)
    for i in range(10):
        cache.get(f"k{i}", lambda: np.zeros(100, dtype=np.int64))
    assert cache._bytes <= cache.max_bytes and len(cache._entries) == 3 and cache.fetches == 10
    cache.get("k9", lambda: pytest.fail("a hit must not load"))


def test_a_sidecar_asked_for_by_two_threads_at_once_is_loaded_once():
    """The reader and its read-ahead thread both need a split range's bytes: the second waits for
    the first's GET instead of making its own; if that one fails, the waiter loads it itself."""
    cache = OffsetCache()
    started, release = threading.Event(), threading.Event()
    loads = []

    def slow_load():
        loads.append(threading.current_thread().name)
        started.set()
        assert release.wait(10)
        return np.arange(11, dtype=np.int64)

    got = {}
    first = threading.Thread(target=lambda: got.setdefault("first", cache.get("k", slow_load)), name="first")
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: got.setdefault("second", cache.get("k", slow_load)), name="second")
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waiting for the first load, not loading
    release.set()
    first.join(10), second.join(10)
    assert loads == ["first"] and cache.fetches == 1 and got["first"] is got["second"]

    started.clear(), release.clear()

    def failing_load():
        started.set()
        assert release.wait(10)
        raise OSError("the first GET failed")

    errors = []
    failing = threading.Thread(target=lambda: errors.append(pytest.raises(OSError, cache.get, "f", failing_load)))
    failing.start()
    assert started.wait(10)
    waiter = threading.Thread(target=lambda: got.setdefault("f", cache.get("f", lambda: np.zeros(3, np.int64))))
    waiter.start()
    release.set()
    failing.join(10), waiter.join(10)
    assert len(errors) == 1 and got["f"].tolist() == [0, 0, 0]  # the waiter's own load


def test_a_forked_child_does_not_wait_for_its_parents_sidecar_load():
    """A load in flight in the parent when it forks (a DataLoader starting its workers while the
    read-ahead thread reads a sidecar) is never finished in the child: the child loads its own."""
    cache = OffsetCache()
    started, release = threading.Event(), threading.Event()

    def slow_load():
        started.set()
        assert release.wait(10)
        return np.arange(5, dtype=np.int64)

    parent_load = threading.Thread(target=cache.get, args=("k", slow_load))
    parent_load.start()
    assert started.wait(10)
    ctx = get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=lambda: out.put(cache.get("k", lambda: np.full(2, 7, np.int64)).tolist()))
    child.start()
    child.join(20)
    hung = child.is_alive()
    if hung:
        child.kill()
    release.set()
    parent_load.join(10)
    assert not hung and out.get(timeout=5) == [7, 7]


def test_pickled_dataset_is_compact_for_many_shards(tmp_path):
    n = 20_000
    shards = [ShardInfo(f"shard-{i:06d}.tar", 10_000, 50_000_000, "ab" * 32, index=f"shard-{i:06d}.tar.idx", span=(0, 49_998_976)) for i in range(n)]
    (tmp_path / "index.json").write_bytes(Manifest(shards=shards).dumps())
    ds = ShardStream(str(tmp_path), batch_size=256, world=World(0, 8))
    blob = pickle.dumps(ds)
    assert len(blob) < 120 * n  # compact columns: about 60 bytes per shard, nothing per sample
    assert ds.manifest.total_samples == 200_000_000 and not ds.manifest._inline
    assert isinstance(ds.counts, np.ndarray) and ds.counts.dtype == np.int64
    copy = pickle.loads(blob)
    assert copy.plan(num_workers=4).ranges(0, 3, copy.counts) == ds.plan(num_workers=4).ranges(0, 3, ds.counts)


def test_version_1_reads_and_upgrades_in_place(tmp_path, capsys):
    root = write(tmp_path / "d", n=45, max_count=10)
    expected = keys_of(ShardStream(root, batch_size=3, shuffle=False, world=World(1, 2)))
    to_version_1(root)
    old = load_manifest(root)
    assert old.version == 1 and len(old._inline) == 5
    assert keys_of(ShardStream(root, batch_size=3, shuffle=False, world=World(1, 2))) == expected
    assert main(["index", "--upgrade", root]) == 0
    assert "upgraded to version 2" in capsys.readouterr().out
    new = load_manifest(root)
    assert new.version == 2 and not new._inline and (tmp_path / "d" / "shard-000004.tar.idx").exists()
    assert keys_of(ShardStream(root, batch_size=3, shuffle=False, world=World(1, 2))) == expected
    assert verify_dataset(new) == []
    assert main(["index", "--upgrade", root]) == 0
    assert "already version 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[:-8], "expected 104 for 10 samples"),
        (lambda d: d[:8] + struct.pack("<Q", 9) + d[16:], "for 9 samples, the manifest says 10"),
        (lambda d: d[:24] + d[32:40] + d[24:32] + d[40:], "not strictly increasing"),
        (lambda d: d[:24] + struct.pack("<Q", struct.unpack("<Q", d[24:32])[0] + 512) + d[32:], "offset of sample #1 is"),
        (lambda d: b"garbage!" + d[8:], "bad magic"),
    ],
)
def test_verify_checks_sidecars(tmp_path, damage, message):
    root = write(tmp_path / "d", n=20, max_count=10)
    sidecar = tmp_path / "d" / "shard-000001.tar.idx"
    sidecar.write_bytes(damage(sidecar.read_bytes()))
    problems = verify_dataset(load_manifest(root))
    assert len(problems) == 1 and "shard-000001.tar" in str(problems[0]) and message in str(problems[0])
    assert main(["verify", root]) == 1


def test_index_writes_sidecars_for_shards_outside_the_manifest_dir(tmp_path):
    src = write(tmp_path / "src", n=30, max_count=10)
    for name in os.listdir(src):
        if name.endswith((".idx", ".members")) or name == "index.json":  # shards as others write them
            os.unlink(os.path.join(src, name))
    assert main(["index", f"{src}/shard-{{000000..000002}}.tar", str(tmp_path / "meta")]) == 0
    # an offset sidecar and a member sidecar (format/members.py) per shard
    assert sorted(os.listdir(tmp_path / "meta" / "offsets")) == [f"00000{i}.{ext}" for i in range(3) for ext in ("idx", "members")]
    assert sorted(os.listdir(src)) == [f"shard-00000{i}.tar" for i in range(3)]  # nothing written beside others' shards
    got = keys_of(ShardStream(str(tmp_path / "meta"), batch_size=4, shuffle=False, world=World(1, 3)))
    assert got == [f"s{i:06d}" for i in range(8, 16)]


# -- packing as shard tasks ------------------------------------------------------------------------
def fail_on_13(i):
    if i == 13:
        raise RuntimeError("thirteen is unlucky")
    return {"__key__": f"k{i:03d}", "txt": str(i)}


def test_executor_pack_is_byte_identical_to_one_process(tmp_path):
    root = tmp_path / "imgs"
    write_image_folder(root, classes=3, per_class=7)
    pack(str(root), str(tmp_path / "one"), label_from_dir=True, max_count=4, shuffle=True, seed=3)
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        result = pack(str(root), str(tmp_path / "pool"), label_from_dir=True, max_count=4, shuffle=True, seed=3, executor=pool, in_flight=2)
    assert result.samples == 21 and result.shards == 6
    assert files_of(tmp_path / "one") == files_of(tmp_path / "pool")


def test_pack_fn_same_bytes_for_any_worker_count_and_error_policy(tmp_path):
    inputs = list(range(30))
    pack(make_pair, inputs, str(tmp_path / "a"), max_count=8)
    pack(make_pair, inputs, str(tmp_path / "b"), max_count=8, workers=2)
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")
    manifest = load_manifest(str(tmp_path / "a"))
    assert manifest.total_samples == 30 + 5 and list(manifest.counts) == [10, 9, 9, 7]  # 8 inputs per shard
    keys = keys_of(ShardStream(str(tmp_path / "a"), batch_size=5, shuffle=False, world=World(0, 1), decode=False))
    assert keys[:3] == ["in0000", "in0000b", "in0001"]
    with pytest.raises(SourceError, match=r"input #13 \(13\): RuntimeError: thirteen is unlucky"):
        pack(fail_on_13, range(20), str(tmp_path / "c"), max_count=8)
    assert not (tmp_path / "c" / "index.json").exists()
    result = pack(fail_on_13, range(20), str(tmp_path / "c"), max_count=8, on_error="skip")
    assert result.samples == 19 and result.skipped_count == 1
    assert load_manifest(str(tmp_path / "c")).skipped["items"][0]["source"] == "input #13 (13)"


# -- Dask -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dask_client(s3_endpoint):
    """Two worker processes, one thread each; started after moto's credentials are in the environment."""
    cluster = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address="127.0.0.1:0", host="127.0.0.1")
    client = distributed.Client(cluster)
    yield client
    client.close()
    cluster.close()


def write_jsonl(tmp_path, n=37):
    (tmp_path / "blobs").mkdir()
    lines = []
    for i in range(n):
        (tmp_path / "blobs" / f"{i}.bin").write_bytes(bytes([i]) * (50 + i))
        lines.append(json.dumps({"__key__": f"row{i:03d}", "txt": f"caption {i}", "bin": {"$file": f"blobs/{i}.bin"}}))
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "rows.jsonl")


def test_dask_packs_tree_and_jsonl_like_one_process(tmp_path, dask_client, s3):
    bucket, options, client = s3
    root = tmp_path / "imgs"
    write_image_folder(root, classes=3, per_class=9)
    jsonl = write_jsonl(tmp_path)
    endpoint = ["--endpoint-url", options["endpoint_url"]]
    address = dask_client.scheduler.address
    for name, src, extra in (("tree", str(root), ["--label-from-dir"]), ("jsonl", jsonl, [])):
        common = [*extra, "--max-count", "5", "--no-progress"]
        assert main(["pack", src, str(tmp_path / f"{name}-one"), "--workers", "1", *common]) == 0
        assert main(["pack", src, str(tmp_path / f"{name}-dask"), "--dask", address, *common]) == 0
        assert main(["pack", src, f"s3://{bucket}/{name}", "--dask", address, *common, *endpoint]) == 0
        one = files_of(tmp_path / f"{name}-one")
        assert len(one) > 8 and files_of(tmp_path / f"{name}-dask") == one
        assert objects_of(client, bucket, name) == one


def die_once(arg):
    """Kill the worker process running input 17 the first time (a lost task), then behave."""
    marker, i = arg
    if i == 17 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return {"__key__": f"k{i:03d}", "txt": f"sample {i}" * 3}


def test_dask_survives_a_worker_killed_mid_pack(tmp_path, s3_endpoint):
    marker = str(tmp_path / "died")
    inputs = [(marker, i) for i in range(40)]
    # A cluster of its own, closed here: the nanny's restart of the killed worker belongs to this test.
    with (
        distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address="127.0.0.1:0", host="127.0.0.1") as cluster,
        distributed.Client(cluster) as client,
    ):
        result = pack(die_once, inputs, str(tmp_path / "dask"), max_count=6, executor=client.get_executor(pure=False, retries=2))
    assert os.path.exists(marker)  # a worker did die
    assert result.samples == 40
    pack(die_once, inputs, str(tmp_path / "one"), max_count=6)
    assert files_of(tmp_path / "dask") == files_of(tmp_path / "one")
    assert not [n for n in os.listdir(tmp_path / "dask") if ".partial-" in n]


# -- merge ----------------------------------------------------------------------------------------
def test_merge_reads_as_one_dataset_with_exact_epochs(tmp_path, capsys):
    dest = tmp_path / "all"
    with ShardWriter(str(dest / "day-01"), max_count=7) as w:
        for s in make_samples(30):
            w.write(s)
    with ShardWriter(str(dest / "day-02"), max_count=9) as w:
        for s in make_samples(42, seed=1)[30:]:
            w.write(s)
    to_version_1(str(dest / "day-02"))  # a part in the old format gets its sidecars on merge
    assert main(["merge", str(dest), str(dest / "day-01"), str(dest / "day-02")]) == 0
    assert "7 shards, 42 samples" in capsys.readouterr().out
    doc = json.loads((dest / "index.json").read_text())
    assert doc["shards"]["path"][0] == "day-01/shard-000000.tar" and doc["shards"]["path"][-1] == "day-02/shard-000001.tar"
    assert (dest / "day-02" / "shard-000001.tar.idx").exists()
    for epoch in (0, 1):
        seen = []
        for rank in range(3):
            ds = ShardStream(str(dest), batch_size=2, seed=5, world=World(rank, 3), shuffle=Shuffle(buffer=4))
            ds.set_epoch(epoch)
            assert len(ds) == 7
            seen += keys_of(ds)
        assert sorted(seen) == [f"s{i:06d}" for i in range(42)]  # 3 ranks x 7 batches x 2: every sample once
    assert verify_dataset(load_manifest(str(dest))) == []
    with pytest.raises(ManifestError, match="listed by both"):
        merge_datasets(str(dest), [str(dest), str(dest / "day-02")])
    assert main(["merge", str(tmp_path / "x"), str(dest / "day-01")]) == 0
    assert main(["merge", str(tmp_path / "x"), str(dest / "day-02")]) == 1  # would replace x: needs --overwrite
