"""The tar parser and header writer against real tar files: ours, Python's tarfile, GNU tar and
webdataset's writer; and against truncated, garbage and hostile bytes."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile

import pytest
import webdataset as wds

from shardstream.errors import ShardFormatError
from shardstream.format.tar import END_OF_ARCHIVE, iter_samples, member_header, padding, split_name


def parse(data: bytes, url: str = "mem://x.tar", read_size: int = 1024):
    stream = io.BytesIO(data)
    samples = iter_samples(stream.read, url=url, start=0, end=len(data), read_size=read_size, require_end_marker=bool(data))
    return [(key, offset, fields) for key, offset, _end, fields in samples]


def build(members: list[tuple[str, bytes]]) -> bytes:
    out = b""
    for name, data in members:
        out += member_header(name, len(data)) + data + padding(len(data))
    return out + END_OF_ARCHIVE


def test_our_headers_read_by_tarfile_including_long_and_unicode_names():
    long_name = "d/" + "x" * 150 + ".txt"
    data = build([("a/b.txt", b"hello"), (long_name, b"long"), ("\u00fcber/k.txt", b"umlaut")])
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        got = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
        assert all(m.mtime == 0 and m.uid == 0 and m.mode == 0o644 for m in tf.getmembers())
    assert got == {"a/b.txt": b"hello", long_name: b"long", "\u00fcber/k.txt": b"umlaut"}
    samples = parse(data)
    assert [(k, f) for k, _, f in samples] == [("a/b", {"txt": b"hello"}), (long_name[:-4], {"txt": b"long"}), ("\u00fcber/k", {"txt": b"umlaut"})]


def test_headers_are_deterministic_and_match_tarfile_checksum_rules():
    assert member_header("k/1.cls", 3) == member_header("k/1.cls", 3)
    info = tarfile.TarInfo.frombuf(member_header("k/1.cls", 3), "utf-8", "strict")  # validates the checksum
    assert (info.name, info.size) == ("k/1.cls", 3)


def test_groups_members_by_key_like_webdataset():
    data = build([("s1.a.b", b"1"), ("s1.cls", b"2"), ("dir/s2.JPG", b"3"), ("noext", b"4")])
    assert [(k, f) for k, _, f in parse(data)] == [("s1", {"a.b": b"1", "cls": b"2"}), ("dir/s2", {"jpg": b"3"})]
    assert split_name(".hidden") == (None, None)
    assert split_name("a/b.c/d.e.f") == ("a/b.c/d", "e.f")


def test_reads_shards_written_by_webdataset_with_pax_float_mtimes(tmp_path):
    path = tmp_path / "wds.tar"
    samples = [{"__key__": f"k{i:03d}", "txt": f"t{i}", "cls": i, "json": {"i": i}} for i in range(50)]
    with wds.TarWriter(str(path)) as w:  # float mtime -> pax headers
        for s in samples:
            w.write(s)
    raw = path.read_bytes()
    assert b"mtime=" in raw  # it really carries pax records
    got = parse(raw, read_size=4096)
    assert [k for k, _, _ in got] == [s["__key__"] for s in samples]
    assert got[7][2] == {"txt": b"t7", "cls": b"7", "json": b'{"i": 7}'}


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")
@pytest.mark.parametrize("fmt", ["gnu", "pax", "ustar"])
def test_reads_gnu_tar_archives(tmp_path, fmt):
    src = tmp_path / "src"
    deep = src / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (deep / "000001.txt").write_text("deep")
    (deep / "000001.cls").write_text("5")
    (src / "000002.txt").write_text("top")
    out = tmp_path / f"{fmt}.tar"
    subprocess.run(["tar", f"--format={fmt}", "-cf", str(out), "-C", str(src), "."], check=True)
    got = {k: f for k, _, f in parse(out.read_bytes())}
    deep_key = f"./{'d' * 60}/{'e' * 60}/000001"
    assert got[deep_key] == {"cls": b"5", "txt": b"deep"}
    assert got["./000002"] == {"txt": b"top"}


def test_offsets_point_at_each_sample_start():
    data = build([("a.txt", b"x" * 700), ("a.cls", b"1"), ("b" * 120 + ".txt", b"y"), ("c.txt", b"z")])
    for key, offset, fields in parse(data):
        rest = data[offset:]  # seek there and parse
        first = parse(rest)[0]
        assert (first[0], first[2]) == (key, fields)


@pytest.mark.parametrize("cut", [1, 100, 511, 512, 600, 1024 + 512])
def test_truncated_shards_raise_with_url_and_offset(cut):
    data = build([("a.txt", b"x" * 1000), ("b.txt", b"y" * 1000)])
    with pytest.raises(ShardFormatError) as err:
        parse(data[: len(data) - len(END_OF_ARCHIVE) - cut])
    assert "mem://x.tar" in str(err.value) and "byte" in str(err.value)


def test_garbage_and_bad_checksums_raise():
    with pytest.raises(ShardFormatError, match="checksum|octal"):
        parse(b"\x07" * 4096)
    data = bytearray(build([("a.txt", b"hello")]))
    data[10] ^= 0xFF  # flip a name byte: checksum no longer matches
    with pytest.raises(ShardFormatError, match="checksum"):
        parse(bytes(data))


def _header_summed(name: str, size: int, signed: bool) -> bytes:
    """A ustar header with a byte above 127 in its unused tail, its checksum the unsigned sum of
    its bytes (the standard) or the signed sum (as some old writers computed it): the two differ."""
    hdr = bytearray(member_header(name, size))
    assert len(hdr) == 512
    hdr[500] = 0xE9
    hdr[148:156] = b"        "
    total = sum(b - 256 if signed and b > 127 else b for b in hdr)
    hdr[148:156] = b"%06o\0 " % total
    return bytes(hdr)


@pytest.mark.parametrize("members", [2, 40])  # few headers per read: checked one by one; many: vectorized
def test_header_checksums_agree_whether_checked_singly_or_vectorized(members):
    """Both ways of checking a read's headers accept the same headers (unsigned and signed sums)
    and name the same corrupt one."""
    body = b""
    for i in range(members):
        data = b"x" * (i + 1)
        body += _header_summed(f"{i:03d}.bin", len(data), signed=bool(i % 2)) + data + padding(len(data))
    data = body + END_OF_ARCHIVE
    got = parse(data, read_size=1 << 20)  # one read: every header checked in one call
    assert [k for k, _, _ in got] == [f"{i:03d}" for i in range(members)]
    assert [f["bin"] for _, _, f in got] == [b"x" * (i + 1) for i in range(members)]
    last = data.rfind(f"{members - 1:03d}.bin".encode())
    broken = bytearray(data)
    broken[last + 1] ^= 0x01  # a name byte of the last header
    with pytest.raises(ShardFormatError, match=rf"byte {last}: tar header checksum mismatch"):
        parse(bytes(broken), read_size=1 << 20)


@pytest.mark.parametrize("read_size", [700, 4096, 1 << 20])
def test_blocks_fetched_into_bytearrays_are_parsed_in_place_and_give_bytes(read_size):
    """An S3 GET reads into a bytearray; the parser reads headers from it where it lies, and every
    field it hands on is ``bytes`` (as from a file), large and small, whole or across blocks."""
    members = [(f"{i:03d}.{ext}", bytes([i]) * n) for i in range(6) for ext, n in (("txt", 5), ("bin", 3000 * i + 1))]
    data = build(members)
    stream = io.BytesIO(data)

    def read(n: int) -> bytearray:
        return bytearray(stream.read(n))

    got = list(iter_samples(read, url="mem://b.tar", start=0, end=len(data), read_size=read_size, require_end_marker=True, large_member=2048))
    assert [k for k, _, _, _ in got] == [f"{i:03d}" for i in range(6)]
    for i, (_, _, _, fields) in enumerate(got):
        assert {ext: type(v) for ext, v in fields.items()} == {"txt": bytes, "bin": bytes}
        assert fields == {"txt": bytes([i]) * 5, "bin": bytes([i]) * (3000 * i + 1)}


def test_size_field_claiming_terabytes_is_rejected_without_allocating():
    hdr = bytearray(member_header("a.txt", 0))
    hdr[124:136] = b"%011o\0" % (0o77777777777)
    hdr[148:156] = b"        "
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    with pytest.raises(ShardFormatError, match="claims"):
        parse(bytes(hdr) + END_OF_ARCHIVE)


@pytest.mark.parametrize("name", ["../evil.txt", "/abs/x.txt", "a/../../b.txt"])
def test_unsafe_member_names_raise(name):
    info = tarfile.TarInfo(name)
    info.size = 1
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        tf.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ShardFormatError, match="unsafe"):
        parse(buf.getvalue())


def test_duplicate_keys_and_fields_raise():
    with pytest.raises(ShardFormatError, match="duplicate key"):
        parse(build([("a.txt", b"1"), ("b.txt", b"2"), ("a.cls", b"3")]))
    with pytest.raises(ShardFormatError, match="duplicate field"):
        parse(build([("a.txt", b"1"), ("a.TXT", b"2")]))


def test_empty_and_zero_length_inputs():
    assert parse(b"") == []
    assert parse(END_OF_ARCHIVE) == []
