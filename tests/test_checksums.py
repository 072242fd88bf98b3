"""sha256 checked while streaming (``Read(verify_stream=True)``): every whole-shard range is hashed on its
way through the parser, trailer included, and compared with the manifest at the end of the shard;
a shard changed after packing is a ChecksumError naming it (or, under on_error="skip", logged and
counted). Local disk, the moto server with read-ahead and DataLoader workers, others' tars whose
first sample does not start at byte 0, and partial ranges that cannot be checked."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from conftest import make_samples, write_dataset

from shardstream import ChecksumError, Read, ShardFormatError, ShardStream, Store, World, make_loader
from shardstream.tools.index import write_index


def tamper(data: bytes, offset: int) -> bytes:
    """Flip one byte of a member's data (the tar headers stay valid, so only the hash can tell)."""
    return data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1 :]


def keys(ds, workers=0):
    loader = make_loader(ds, num_workers=workers, pin_memory=False) if workers else ds
    return [k for batch in loader for k in batch["__key__"]]


def test_intact_shards_are_verified_and_read_the_same(tmp_path):
    url = write_dataset(str(tmp_path / "ds"), size=500)
    plain = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1))
    checked = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(read=Read(verify_stream=True)))
    assert keys(checked) == keys(plain) == [s["__key__"] for s in make_samples(60)]
    assert checked.stats()["shards_verified"] == 3 and checked.stats()["checksum_failures"] == 0
    assert plain.stats()["shards_verified"] == 0


def test_a_changed_shard_is_named_after_its_samples(tmp_path):
    url = write_dataset(str(tmp_path / "ds"), size=500)
    shard = tmp_path / "ds" / "shard-000001.tar"
    shard.write_bytes(tamper(shard.read_bytes(), 512 + 3))  # inside the first member's data
    # Without the check the change goes unnoticed: headers and counts are all still right.
    assert len(keys(ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1)))) == 60
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(read=Read(verify_stream=True)))
    seen = []
    with pytest.raises(ChecksumError, match=r"shard-000001\.tar: sha256 [0-9a-f]{64} does not match the manifest's"):
        for batch in ds:
            seen += batch["__key__"]
    assert seen[:20] == [s["__key__"] for s in make_samples(20)]  # shard 0 came through first
    assert ds.stats()["checksum_failures"] == 1


def test_under_skip_a_mismatch_is_logged_and_counted(tmp_path, caplog):
    url = write_dataset(str(tmp_path / "ds"), size=500)
    shard = tmp_path / "ds" / "shard-000002.tar"
    shard.write_bytes(tamper(shard.read_bytes(), 512 + 1))
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), on_error="skip", store=Store(read=Read(verify_stream=True)))
    assert len(keys(ds)) == 60
    stats = ds.stats()
    assert stats["checksum_failures"] == 1 and stats["shards_verified"] == 2 and stats["samples_skipped"] == 0
    assert "shard-000002.tar: sha256" in caplog.text


def test_s3_with_readahead_and_workers(s3):
    bucket, options, client = s3
    url = write_dataset(f"s3://{bucket}/v", n=80, storage_options=options, size=500)
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options, read=Read(verify_stream=True)))
    assert ds.readahead_bytes > 0  # the remote default: verified bytes come through the prefetcher
    assert sorted(keys(ds, workers=2)) == [s["__key__"] for s in make_samples(80)]
    assert ds.stats()["shards_verified"] == 4
    body = client.get_object(Bucket=bucket, Key="v/shard-000003.tar")["Body"].read()
    client.put_object(Bucket=bucket, Key="v/shard-000003.tar", Body=tamper(body, 512 + 5))
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options, read=Read(verify_stream=True)))
    with pytest.raises(ChecksumError, match=r"s3://.*/v/shard-000003\.tar: sha256"):
        keys(ds)


def test_others_tar_with_a_directory_entry_first(tmp_path):
    """A GNU-style tar whose first member is a directory: the first sample starts past byte 0, and
    the hash still covers the whole object."""
    root = tmp_path / "others"
    root.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("data")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        for i in range(7):
            payload = json.dumps({"i": i}).encode()
            member = tarfile.TarInfo(f"data/{i:03d}.json")
            member.size = len(payload)
            tar.addfile(member, io.BytesIO(payload))
    (root / "a.tar").write_bytes(buf.getvalue())
    manifest, _ = write_index(str(root / "a.tar"), str(root))
    assert manifest.offsets(0)[0] > 0 and manifest.shards[0].span[0] > 0
    ds = ShardStream(str(root), batch_size=7, shuffle=False, world=World(0, 1), store=Store(read=Read(verify_stream=True)))
    assert [x["i"] for b in ds for x in b["json"]] == list(range(7))
    assert ds.stats()["shards_verified"] == 1


def test_partial_ranges_are_not_claimed_as_verified(tmp_path):
    url = write_dataset(str(tmp_path / "ds"), n=40, max_count=40, size=500)  # one shard, split across 4 ranks
    total = 0
    for rank in range(4):
        ds = ShardStream(url, batch_size=2, shuffle=False, world=World(rank, 4), store=Store(read=Read(verify_stream=True)))
        total += len(keys(ds))
        assert ds.stats()["shards_verified"] == 0 and ds.stats()["checksum_failures"] == 0
    assert total == 40


def test_a_shard_cut_in_its_trailer_is_caught_only_when_verifying(tmp_path):
    url = write_dataset(str(tmp_path / "ds"), n=20, size=500)
    shard = tmp_path / "ds" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:-100])  # end-of-archive zeros: no sample is touched
    assert len(keys(ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1)))) == 20
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(read=Read(verify_stream=True)))
    with pytest.raises(ShardFormatError, match=r"shard-000000\.tar at byte \d+: stream ended with 100 bytes"):
        keys(ds)
