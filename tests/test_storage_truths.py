"""Errors that say what is true (issue 25): hostile offset sidecars and shards shorter than their
manifest fail with typed errors that name the object (on local disk and on S3 alike), a retry
message's time is the wall time the request took, ``ls`` on a missing bucket says so, and the
shard cache never trusts a file cut short after its fill. Against the moto server (real HTTP),
real tar files and the fault proxy."""

from __future__ import annotations

import json
import re
import socket
import struct
import time

import fsspec
import pytest
from conftest import make_samples, write_dataset
from faultproxy import FaultProxy
from test_http import RangeServer

from shardstream import Cache, ShardStream, Store, World
from shardstream.cli.main import main
from shardstream.errors import BucketNotFound, ManifestError, ShardFormatError, StorageError, StorageNotFound, StorageUnavailable
from shardstream.format.manifest import load_manifest
from shardstream.format.offsets import decode_offsets, encode_offsets
from shardstream.storage.config import StorageConfig
from shardstream.storage.ranges import read_object

HOSTILE = 2**64 - 512  # read as a signed int64: -512


def closed_port() -> int:
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hostile_sidecar(data: bytes) -> bytes:
    offsets = list(struct.unpack(f"<{(len(data) - 16) // 8}Q", data[16:]))
    offsets[0] = HOSTILE
    return encode_offsets(offsets)


# -- 2. hostile sidecars, short shards ---------------------------------------------------------------
def test_a_sidecar_offset_of_2_64_minus_512_is_refused_naming_sidecar_and_offset():
    offsets = [0, 1024, 2048, 4096]
    data = hostile_sidecar(encode_offsets(offsets))
    with pytest.raises(ManifestError, match=rf"s3://b/d/shard-000000.tar.idx: .*sample #0 is byte {HOSTILE}, outside the shard's 5120"):
        decode_offsets(data, "s3://b/d/shard-000000.tar.idx", 3, 5120)
    ok = decode_offsets(encode_offsets(offsets), "x.idx", 3, 5120)
    assert ok.tolist() == offsets and ok.dtype.kind == "i"
    with pytest.raises(ManifestError, match="end of the last sample is byte 5121, outside the shard's 5120 bytes"):
        decode_offsets(encode_offsets([0, 1024, 2048, 5121]), "x.idx", 3, 5120)


def test_a_hostile_sidecar_is_a_manifest_error_on_local_disk(tmp_path):
    root = write_dataset(tmp_path / "d", max_count=10, member_sidecars=False)
    sidecar = tmp_path / "d" / "shard-000000.tar.idx"
    sidecar.write_bytes(hostile_sidecar(sidecar.read_bytes()))
    # 12 ranks x 5 samples: rank 0 reads samples 0-4 of shard 0, from the sidecar's first offset
    with pytest.raises(ManifestError, match=rf"shard-000000.tar.idx: .*sample #0 is byte {HOSTILE}"):
        list(ShardStream(root, batch_size=5, shuffle=False, world=World(0, 12)))


@pytest.mark.parametrize("s3_client", ["obstore", "s3fs"])
def test_a_hostile_sidecar_is_a_manifest_error_on_s3(s3, s3_client):
    bucket, options, client = s3
    url = write_dataset(f"s3://{bucket}/d", max_count=10, storage_options=options, member_sidecars=False)
    key = "d/shard-000000.tar.idx"
    data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=hostile_sidecar(data))
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 12), store=Store(options=options, config=StorageConfig(s3_client=s3_client)))
    with pytest.raises(ManifestError, match=rf"s3://{bucket}/{key}: .*sample #0 is byte {HOSTILE}"):
        list(ds)


def _truncation_error(src, **kwargs) -> ShardFormatError:
    with pytest.raises(ShardFormatError) as raised:
        list(ShardStream(src, batch_size=5, shuffle=False, **kwargs))
    return raised.value


@pytest.mark.parametrize("world", [World(0, 1), World(1, 2)], ids=["whole", "from-the-sidecar"])
@pytest.mark.parametrize("how", ["obstore", "s3fs", "cache"])
def test_a_shard_shorter_than_its_manifest_is_a_truncated_shard_on_s3_as_on_local_disk(s3, tmp_path, how, world):
    """S3 answers 416 to a range that starts past the object's end: for a range the manifest
    promised that is a truncated shard (as a short local file is), not a request to check."""
    bucket, options, client = s3
    samples = make_samples(30, size=3000)
    local = write_dataset(tmp_path / "local", samples=samples, max_count=10)
    url = write_dataset(f"s3://{bucket}/d", samples=samples, max_count=10, storage_options=options)
    shard = tmp_path / "local" / "shard-000001.tar"
    cut = shard.read_bytes()[:15_000]  # both halves of the shard start past 15000 for World(1, 2)
    shard.write_bytes(cut)
    client.put_object(Bucket=bucket, Key="d/shard-000001.tar", Body=cut)
    on_disk = _truncation_error(local, world=world)
    cache = Cache(str(tmp_path / "cache"), 10**8) if how == "cache" else None
    on_s3 = _truncation_error(
        url, world=world, store=Store(options=options, config=StorageConfig(s3_client="s3fs" if how == "s3fs" else "obstore"), cache=cache)
    )
    assert "416" not in str(on_s3) and "truncated shard" in str(on_s3)
    assert str(on_s3).startswith(f"s3://{bucket}/d/shard-000001.tar at byte ")
    if how != "cache":  # the same words as on local disk: where the stream ended, where it should have
        assert str(on_s3).replace(f"s3://{bucket}/d", str(tmp_path / "local")) == str(on_disk)
    else:  # the cache fetches the whole shard: it names the manifest's size
        size = int(ShardStream(url, batch_size=5, store=Store(options=options)).manifest.sizes[1])
        assert str(on_s3).endswith(f"stream ended at byte 15000, expected {size} (truncated shard)")


@pytest.mark.parametrize("world", [World(0, 1), World(1, 2)], ids=["whole", "from-the-sidecar"])
@pytest.mark.parametrize("where", ["memory", "file", "http", "http-no-range"])
def test_a_shard_shorter_than_its_manifest_is_a_truncated_shard_at_once_on_fsspec_stores(tmp_path, where, world):
    """fsspec's stores answer a read that starts past an object's end with no bytes (memory://, as
    a slice would) or a 416 (HTTP): either ends the stream at once, a truncated shard in the words
    local disk uses. (memory:// took the empty answer for a failed try and retried it until the
    deadline, then said it could not reach storage.)"""
    samples = make_samples(30, size=3000)
    local = write_dataset(tmp_path / "local", samples=samples, max_count=10)
    shard = tmp_path / "local" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:15_000])  # both halves of the shard start past 15000 for World(1, 2)
    on_disk = _truncation_error(local, world=world)
    server, memory = None, fsspec.filesystem("memory")
    if where == "memory":
        url = f"memory://{tmp_path.name}/d"
        for f in sorted((tmp_path / "local").iterdir()):
            memory.pipe(f"{url}/{f.name}", f.read_bytes())
    elif where == "file":
        url = f"file://{local}"
    else:
        server = RangeServer(str(tmp_path))
        server.ranges = where == "http"
        url = f"{server.url}/local"
    try:
        if where == "http-no-range":  # (python -m http.server) said at the first read that shows it: rank
            # 1's from an offset of the cut shard gets all its 15000 bytes (once taken for bytes from there)
            shown = r"shard-000000\.tar: asked for bytes 0-"
            if world.rank:
                shown = r"shard-000001\.tar: asked for bytes \d+-\d+, the server sent 15000 bytes, the whole object"
            with pytest.raises(StorageError, match=rf"{shown}.*: it does not support HTTP Range requests"):
                list(ShardStream(url, batch_size=5, shuffle=False, world=world))
            return
        # a deadline the test can wait out: before the fix memory:// ended in StorageUnavailable at it
        on_store = _truncation_error(url, world=world, store=Store(config=StorageConfig(deadline=5)))
    finally:
        if server is not None:
            server.stop()
        if where == "memory":
            memory.rm(url, recursive=True)
    assert str(on_store).replace(url, local) == str(on_disk)
    if server is not None:  # rank 1's read starts past the end: one 416, not retried
        assert [r[3] for r in server.gets("/local/shard-000001.tar")].count(416) == world.rank


# -- 3. a retry message's time is the wall time -------------------------------------------------------
def _reported_seconds(message: str) -> float:
    found = re.search(r"after \d+ tries in ([0-9.]+) s", message)
    assert found, message
    return float(found.group(1))


@pytest.mark.parametrize("s3_client", ["obstore", "s3fs"])
def test_the_time_a_retry_message_reports_is_the_wall_time_of_the_request(s3, s3_client):
    bucket, options, client = s3
    client.put_object(Bucket=bucket, Key="k", Body=b"x" * 100)
    small = dict(max_attempts=3, backoff_base=0.01, backoff_cap=0.02, s3_client=s3_client)
    # refused at once, from a filesystem made for this request (its setup is part of the request)
    began = time.monotonic()
    with pytest.raises(StorageUnavailable) as refused:
        read_object(f"s3://{bucket}/k", {"endpoint_url": f"http://127.0.0.1:{closed_port()}"}, config=StorageConfig(**small))
    elapsed = time.monotonic() - began
    assert "connection refused" in str(refused.value) and "after 3 tries" in str(refused.value)
    assert _reported_seconds(str(refused.value)) >= elapsed - 0.2
    assert refused.value.waited >= elapsed - 0.2
    # each try waits out its read timeout: the tries themselves, not only the sleeps, are the time
    with FaultProxy(options["endpoint_url"], stall="accept") as proxy:
        began = time.monotonic()
        with pytest.raises(StorageUnavailable) as stalled:
            read_object(f"s3://{bucket}/k", {"endpoint_url": proxy.url}, config=StorageConfig(read_timeout=0.3, **small))
        elapsed = time.monotonic() - began
    assert "timeout" in str(stalled.value) and proxy.counts["stalls"] == 3
    assert _reported_seconds(str(stalled.value)) >= elapsed - 0.2
    assert stalled.value.waited >= 3 * 0.3


# -- 4. ls on a missing bucket ----------------------------------------------------------------------
def test_ls_says_the_bucket_does_not_exist_as_pack_does(s3, tmp_path, capsys):
    _, options, _ = s3
    endpoint = ["--endpoint-url", options["endpoint_url"]]
    assert main(["ls", "s3://typo-bucket-25/x", *endpoint]) != 0
    said = capsys.readouterr().err
    assert "s3://typo-bucket-25/x/index.json: the bucket does not exist (check the URL and --endpoint-url)" in said
    assert "shardstream index" not in said
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"__key__": "a", "txt": "a"}) + "\n")
    assert main(["pack", str(source), "s3://typo-bucket-25/x", *endpoint]) != 0
    assert "the bucket does not exist (check the URL and --endpoint-url)" in capsys.readouterr().err
    with pytest.raises(BucketNotFound):  # one class for it, found by type (a StorageNotFound still)
        read_object("s3://typo-bucket-25/x/index.json", options)
    assert issubclass(BucketNotFound, StorageNotFound)
    with pytest.raises(ManifestError, match="the bucket does not exist") as info:  # the library says it too
        load_manifest("s3://typo-bucket-25/x", options)
    assert "shardstream index" not in str(info.value) and isinstance(info.value.__cause__, BucketNotFound)


# -- 5. the cache never trusts a short file ---------------------------------------------------------
def test_a_cached_shard_cut_short_after_its_fill_is_fetched_again(s3, tmp_path):
    bucket, options, _ = s3
    samples = make_samples(30, size=3000)
    url = write_dataset(f"s3://{bucket}/c", samples=samples, max_count=10, storage_options=options)
    cache_dir = tmp_path / "cache"
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=options, cache=Cache(str(cache_dir), 10**8)))
    expected = [(s["__key__"], s["bin"]) for s in samples]
    assert [(k, bytes(b)) for batch in ds for k, b in zip(batch["__key__"], batch["bin"])] == expected
    first = ds.stats()
    assert first["cache_misses"] == 3
    files = sorted(cache_dir.glob("*.tar"))
    sizes = {f.name: f.stat().st_size for f in files}
    assert sorted(sizes.values()) == sorted(int(n) for n in ds.manifest.sizes)
    with open(files[0], "r+b") as f:  # what a power loss can leave after a rename: a short file
        f.truncate(sizes[files[0].name] // 3)
    with open(files[1], "r+b") as f:  # or an empty one
        f.truncate(0)
    ds.set_epoch(1)
    assert [(k, bytes(b)) for batch in ds for k, b in zip(batch["__key__"], batch["bin"])] == expected
    second = ds.stats()
    assert second["cache_misses"] - first["cache_misses"] == 2  # the two damaged entries, fetched again
    assert second["cache_hits"] - first["cache_hits"] == 1
    assert second["bytes_read"] - first["bytes_read"] == sizes[files[0].name] + sizes[files[1].name]
    assert {f.name: f.stat().st_size for f in cache_dir.glob("*.tar")} == sizes  # whole again
