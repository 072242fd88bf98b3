"""Broken and hostile input on every read path: a clear error naming the shard and offset, or a
counted skip under on_error="skip"; never a hang, never silent loss. Fuzzed with hypothesis."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import tracemalloc

import pytest
from conftest import make_samples, write_dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardstream import Decode, ShardStream, ShardWriter, World
from shardstream.errors import ManifestError, SampleError, ShardFormatError, StorageError
from shardstream.format.manifest import Manifest, load_manifest
from shardstream.format.offsets import encode_offsets
from shardstream.format.scan import scan_shard
from shardstream.format.tar import END_OF_ARCHIVE, iter_samples, member_header, padding


def valid_tar(n=6) -> bytes:
    out = b""
    for i in range(n):
        for ext, data in (("cls", str(i).encode()), ("txt", b"x" * (i * 300))):
            out += member_header(f"k{i}.{ext}", len(data)) + data + padding(len(data))
    return out + END_OF_ARCHIVE


VALID = valid_tar()


def parse_all(data: bytes):
    return list(iter_samples(io.BytesIO(data).read, url="fuzz.tar", start=0, end=len(data), read_size=777, require_end_marker=True))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_mutated_tar_terminates_with_samples_or_documented_error(flips):
    data = bytearray(VALID)
    for pos, value in flips:
        data[pos] = value
    tracemalloc.start()
    try:
        samples = parse_all(bytes(data))
        assert all(isinstance(k, str) and isinstance(f, dict) for k, _, _, f in samples)
    except ShardFormatError as exc:
        assert exc.url == "fuzz.tar" and 0 <= exc.offset <= len(data)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 50 * len(VALID) + 1_000_000  # memory bounded by the input, not by size fields


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=4096), st.integers(0, len(VALID)))
def test_fuzz_random_and_truncated_bytes(junk, cut):
    for data in (junk, VALID[:cut], VALID[:cut] + junk):
        try:
            parse_all(data)
        except ShardFormatError:
            pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["format", "version", "shards", "total_samples", "path", "samples", "bytes", "offsets", "sha256"]), json_values, max_size=6
    ),
    st.lists(st.dictionaries(st.sampled_from(["path", "samples", "bytes", "offsets", "sha256"]), json_values, max_size=5), max_size=3),
    st.dictionaries(
        st.sampled_from(["path", "samples", "bytes", "sha256", "data_start", "data_end", "index"]), st.lists(json_values, max_size=3), max_size=7
    ),
    st.sampled_from([1, 2]),
)
def test_fuzz_manifest_reader(doc, shards, columns, version):
    doc = {"format": "shardstream-index", "version": version, **doc}
    if "shards" not in doc:
        doc["shards"] = shards if version == 1 else columns
    try:
        manifest = Manifest.from_json(json.loads(json.dumps(doc)), "fuzz/index.json")
    except ManifestError as exc:
        assert str(exc).startswith("fuzz/index.json")
    else:
        for i, shard in enumerate(manifest.shards):
            assert shard.span is not None and 0 <= shard.span[0] <= shard.span[1] <= shard.bytes
            if manifest.version == 1:
                offsets = manifest.offsets(i)
                assert len(offsets) == shard.samples + 1 and offsets[-1] <= shard.bytes


def test_zero_length_object_and_non_utf8_name(tmp_path):
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    with pytest.raises(ShardFormatError, match="empty.tar at byte 0: no end-of-archive"):
        scan_shard(str(empty))
    info = tarfile.TarInfo("x")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tf:
        info = tarfile.TarInfo("caf\xe9.txt")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ShardFormatError, match="not UTF-8"):
        parse_all(buf.getvalue())


@pytest.mark.parametrize("members", [False, True], ids=["parsed", "sliced"])
def test_broken_shard_skipped_by_policy_batches_stay_equal(tmp_path, caplog, members):
    """A broken header: the parser's checksum finds it in a shard without a member sidecar; in one
    with a sidecar (what pack writes), its fingerprint, before any sample of its block goes out."""
    root = write_dataset(tmp_path / "d", max_count=10, member_sidecars=members)
    shard = tmp_path / "d" / "shard-000002.tar"
    data = bytearray(shard.read_bytes())
    offset = int(load_manifest(root).offsets(2)[3])
    data[offset + 10] ^= 0xFF  # the header of the shard's 4th sample
    shard.write_bytes(bytes(data))
    what = "this member's header is not the one its member sidecar records" if members else "tar header checksum mismatch"
    with pytest.raises(ShardFormatError, match=rf"shard-000002.tar at byte {offset}: {what}"):
        list(ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1)))
    ds = ShardStream(root, batch_size=4, shuffle=False, on_error="skip", world=World(0, 1))
    with caplog.at_level("WARNING"):
        batches = list(ds)
    keys = [k for b in batches for k in b["__key__"]]
    assert len(batches) == len(ds) == 15
    if members:  # the block's samples never went out: the whole range is skipped
        assert "skipped 10 bad samples, repeated 10 to keep batches equal" in caplog.text
        assert all(f"s{i:06d}" not in keys for i in range(20, 30))
    else:  # the sample in progress at the break is dropped too: the broken header might have been its own
        assert "skipped 8 bad samples, repeated 8 to keep batches equal" in caplog.text
        assert all(f"s{i:06d}" not in keys for i in range(22, 30))  # the rest of that range was skipped
        assert {"s000020", "s000021"} <= set(keys)  # what came before the break was kept


def test_missing_shard_names_url(tmp_path):
    root = write_dataset(tmp_path / "d", max_count=10)
    (tmp_path / "d" / "shard-000004.tar").unlink()
    with pytest.raises(StorageError, match=r"shard-000004.tar: not found \(it is listed in the manifest"):
        list(ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1)))


def test_offsets_past_the_end_and_bytes_that_lie(tmp_path):
    root = write_dataset(tmp_path / "d", max_count=10, member_sidecars=False)  # (member sidecars that lie: test_members.py)
    path = tmp_path / "d" / "index.json"
    doc = json.loads(path.read_text())
    doc["shards"]["data_end"][0] = doc["shards"]["bytes"][0] + 512
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="within the shard's"):
        ShardStream(root, batch_size=4, world=World(0, 1))
    doc["shards"]["data_end"][0] -= 512 + 1024  # back to the truth (the data ends before the end-of-archive blocks)
    path.write_text(json.dumps(doc))
    sidecar = tmp_path / "d" / "shard-000000.tar.idx"
    offsets = list(struct.unpack("<11Q", sidecar.read_bytes()[16:]))
    offsets[-1] = doc["shards"]["bytes"][0] + 512
    sidecar.write_bytes(encode_offsets(offsets))
    with pytest.raises(ManifestError, match="past the shard's"):  # the sidecar is read for a range inside the shard
        list(ShardStream(root, batch_size=5, shuffle=False, world=World(0, 12)))
    offsets[-1] -= 512 + 1024
    offsets[5] += 512  # into the middle of a sample
    sidecar.write_bytes(encode_offsets(offsets))
    for rank in (0, 1):  # 12 ranks x 5 samples: rank 0 ends, rank 1 starts at the bad offset
        with pytest.raises(ShardFormatError, match=r"shard-000000.tar at byte \d+"):
            list(ShardStream(root, batch_size=5, shuffle=False, world=World(rank, 12)))


def test_sample_missing_required_field_under_skip(tmp_path):
    samples = make_samples(20)
    for s in samples[:3]:
        del s["cls"]
    with ShardWriter(str(tmp_path / "d")) as w:
        for s in samples:
            w.write(s)
    ds = ShardStream(str(tmp_path / "d"), batch_size=4, shuffle=False, decode=Decode(required=["cls"]), on_error="skip", world=World(0, 1))
    keys = [k for b in ds for k in b["__key__"]]
    assert len(keys) == 20 and not {"s000000", "s000001", "s000002"} & set(keys)
    with pytest.raises(SampleError, match="s000000.*missing required field 'cls'"):
        list(ShardStream(str(tmp_path / "d"), batch_size=4, shuffle=False, decode=Decode(required=["cls"]), world=World(0, 1)))


def test_extract_never_writes_outside_dir(tmp_path):
    from shardstream.errors import ShardstreamError
    from shardstream.tools.preview import extract_sample

    with pytest.raises(ShardstreamError, match="outside"):
        extract_sample({"__key__": "../../escape", "txt": b"x"}, str(tmp_path / "out"))
    assert not (tmp_path / "escape.txt").exists()
