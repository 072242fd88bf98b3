"""The tar parser's run-at-a-time path (``format.tar._plain_run``) against its member-by-member
loop: the same samples, offsets, lists and errors, on writers' tars, on every kind of member the
fast path leaves to the loop, and on fuzzed bytes; and the pipeline around it (samples built as
dicts once, lists of at most a window, local reads, decode passing lists through)."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import tarfile

import pytest
import webdataset as wds
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardstream.errors import SampleError, ShardFormatError
from shardstream.format import tar
from shardstream.format.scan import scan_shards
from shardstream.format.tar import END_OF_ARCHIVE, PARSE_WINDOW, iter_sample_batches, iter_sample_dicts, member_header, padding
from shardstream.pipeline.decode import Decoder, decode_samples
from shardstream.policy import ErrorPolicy
from shardstream.storage.ranges import FileReader


def build(members: list[tuple[str, bytes]], end: bool = True) -> bytes:
    out = b"".join(member_header(name, len(data)) + data + padding(len(data)) for name, data in members)
    return out + END_OF_ARCHIVE if end else out


def samples_tar(n: int, exts=("bin", "json"), size=1024, seed=0) -> bytes:
    rng = random.Random(seed)
    members = []
    for i in range(n):
        for ext in exts:
            members.append((f"{i:08d}.{ext}", rng.randbytes(size) if ext == "bin" else json.dumps({"label": i}).encode()))
    return build(members)


class Blocks:
    """``read(n)`` over bytes, as ``bytes`` or as ``bytearray`` blocks (what an S3 GET is read into)."""

    def __init__(self, data: bytes, as_bytearray: bool = False):
        self.stream = io.BytesIO(data)
        self.as_bytearray = as_bytearray

    def __call__(self, n: int):
        chunk = self.stream.read(n)
        return bytearray(chunk) if self.as_bytearray else chunk


class BlocksInto(Blocks):
    """The same, with ``readinto`` (as a local file has): the parser may read into a block it reuses."""

    def readinto(self, view) -> int:
        return self.stream.readinto(view)


def parse(
    data: bytes,
    *,
    fast: bool,
    dicts: bool,
    read_size: int = tar.DEFAULT_READ_SIZE,
    as_bytearray: bool = False,
    start: int = 0,
    end: int | None = None,
    require_end_marker: bool = True,
    large_member: int = tar.LARGE_MEMBER,
    reuse: bool = False,
):
    """Every list the parser yields, and the error it ends with (type, message, offset) or None."""
    lists = []
    error = None
    stream = (BlocksInto if reuse else Blocks)(data[start:], as_bytearray)
    try:
        for chunk in tar._parse(
            stream,
            "mem://x.tar",
            start,
            len(data) if end is None else end,
            read_size,
            require_end_marker,
            (),
            large_member,
            None,
            dicts=dicts,
            fast=fast,
            reuse_blocks=reuse,
        ):
            lists.append(chunk)
    except ShardFormatError as exc:
        error = (type(exc), str(exc), exc.offset)
    return lists, error


def same_both_ways(data: bytes, **kwargs) -> tuple[list, object]:
    """Parse ``data`` run at a time and member by member, as tuples and as dicts, and (dicts)
    read into one reused block: all agree."""
    for dicts in (False, True):
        fast = parse(data, fast=True, dicts=dicts, **kwargs)
        slow = parse(data, fast=False, dicts=dicts, **kwargs)
        assert fast == slow
        if dicts:
            # Read into one reused block (a local file): the same samples and error; the run path
            # reads members behind pax headers in larger blocks there (MAX_SPREAD), so its lists
            # may be cut elsewhere.
            for way in (True, False):
                lists, error = parse(data, fast=way, dicts=True, reuse=True, **kwargs)
                assert flat(lists) == flat(fast[0]) and error == fast[1]
        if dicts:
            assert all(list(s)[-2:] == ["__key__", "__url__"] and s["__url__"] == "mem://x.tar" for chunk in fast[0] for s in chunk)
    return parse(data, fast=True, dicts=False, **kwargs)


def flat(lists):
    return [s for chunk in lists for s in chunk]


@pytest.mark.parametrize("read_size", [777, 4096, 65536, 1 << 20, 4 << 20])
@pytest.mark.parametrize("as_bytearray", [False, True])
def test_writers_tars_give_the_same_samples_both_ways(read_size, as_bytearray):
    data = samples_tar(3000)
    lists, error = same_both_ways(data, read_size=read_size, as_bytearray=as_bytearray)
    assert error is None
    got = flat(lists)
    assert [k for k, *_ in got] == [f"{i:08d}" for i in range(3000)]
    assert got[7][3]["json"] == b'{"label": 7}' and all(type(v) is bytes for *_, f in got for v in f.values())


def test_the_run_path_is_taken_and_builds_each_sample_once(monkeypatch):
    calls = []
    real = tar._plain_samples
    monkeypatch.setattr(tar, "_plain_samples", lambda *a: calls.append(1) or real(*a))
    data = samples_tar(500)
    got = flat(list(iter_sample_dicts(Blocks(data), url="u", end=len(data))))
    assert calls and len(got) == 500
    assert list(got[3]) == ["bin", "json", "__key__", "__url__"] and got[3]["__key__"] == "00000003"
    tuples = flat(list(iter_sample_batches(Blocks(data), url="u", end=len(data))))
    assert [{**f, "__key__": k, "__url__": "u"} for k, _, _, f in tuples] == got


def test_lists_hold_at_most_a_window_of_a_block():
    data = samples_tar(4000)  # ~10 MB
    lists, _ = same_both_ways(data, read_size=4 << 20)
    per_sample = 5 * 512
    assert len(lists) > len(data) // (4 << 20)
    assert max(len(chunk) for chunk in lists) <= PARSE_WINDOW // per_sample + 2


@pytest.mark.parametrize(
    "members",
    [
        [("a/b/k1.txt", b"1"), ("a/b/k1.cls", b"2"), ("a/b/k2.txt", b"3"), ("a/b/k2.cls", b"4")],  # keys with folders
        [("k1.JPG", b"x"), ("k1.Seg.PNG", b"y"), ("k2.JPG", b"z"), ("k2.Seg.PNG", b"w")],  # extensions lower-cased
        [("k1.a", b""), ("k1.b", b""), ("k2.a", b""), ("k2.b", b"")],  # empty members
        [("k1.", b"e"), ("k2.", b"f")],  # an empty extension
        [("k1.a", b"1"), ("k2.a", b"1"), ("k2.b", b"2"), ("k3.a", b"3"), ("k3.b", b"3"), ("k3.c", b"3"), ("k4.a", b"4")],  # irregular
        [("k1.a", b"1"), ("__meta__/info.txt", b"m"), ("k2.a", b"2")],  # metadata member
        [("__index__.json", b"{}"), ("k1.a", b"1")],
        [("k1.a", b"1"), ("noext", b"n"), ("k2.a", b"2")],  # no extension: not sample data
        [("k1.a", b"1"), ("dir/.hidden.txt", b"h"), (".x.txt", b"h2"), ("k2.a", b"2")],  # hidden names: webdataset's regex
        [("k1.a", b"1"), ("d" * 120 + "/k.a", b"long"), ("k2.a", b"2")],  # a long name: pax header
        [("k1.a", b"1"), ("\u00fcber.a", b"u"), ("k2.a", b"2")],  # UTF-8 names
        [("x.y/k1.a", b"1"), ("x.y/k1.b", b"1")],  # a dot in a folder name
        [("k1.a..b", b"1"), ("k2.a", b"2")],  # '..' that is not a path component
        [("1", b""), (".0.", b"")],  # as many dots as names, but not one in each
        [("k1", b"x"), ("k2.a.b", b"y"), ("k3.c", b"z")],
        [("d.x/k1", b"x"), ("k2.a", b"y")],  # the only dot in a folder
        [("k1.a", b"1"), ("k1.b", b"1"), ("k2.a", b"2"), ("k1.c", b"1")],  # a key that comes back: error
        [("k1.a", b"1"), ("k1.a", b"1")],  # a field twice: error
        [("k1.a", b"1"), ("k2.a", b"1"), ("k2.a", b"1"), ("k3.a", b"1")],
        [("k1.a", b"1"), ("../evil.a", b"x")],  # unsafe name: error
        [("k1.a", b"1"), ("/abs.a", b"x")],
    ],
)
@pytest.mark.parametrize("read_size", [512, 1024, 4 << 20])
def test_members_the_run_path_leaves_to_the_loop_agree(members, read_size):
    # The same members repeated, so runs form before and after the unusual ones.
    prefix = [(f"p{i:04d}.{ext}", b"v" * i) for i in range(40) for ext in ("a", "b")]
    suffix = [(f"s{i:04d}.{ext}", b"w" * i) for i in range(40) for ext in ("a", "b")]
    for data in (build(members), build(prefix + members + suffix)):
        same_both_ways(data, read_size=read_size)


def test_other_writers_headers_agree():
    """GNU-format and pax headers from Python's tarfile, and a checksum written as 7 digits."""
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
            for i in range(200):
                for ext, payload in (("bin", bytes([i % 256]) * (i * 7)), ("cls", str(i).encode())):
                    info = tarfile.TarInfo(f"dir/{i:05d}.{ext}")
                    info.size = len(payload)
                    tf.addfile(info, io.BytesIO(payload))
        lists, error = same_both_ways(out.getvalue(), read_size=4096)
        assert error is None and len(flat(lists)) == 200
    data = bytearray(samples_tar(50))
    chk = int(data[148:154], 8)
    data[148:156] = b"%07o\0" % chk  # another spelling of the same checksum: the loop takes it
    lists, error = same_both_ways(bytes(data))
    assert error is None and len(flat(lists)) == 50


def test_prefix_field_size_forms_and_sparse_members_agree():
    data = bytearray(samples_tar(40))
    hdr = 5 * 512 * 3  # the header of sample 3's .bin
    data[hdr + 345 : hdr + 348] = b"pre"  # a POSIX prefix: the name becomes pre/...
    data[hdr + 148 : hdr + 156] = b"%06o\0 " % (sum(data[hdr : hdr + 148]) + sum(data[hdr + 156 : hdr + 512]) + 256)
    same_both_ways(bytes(data))
    data = bytearray(samples_tar(40))
    hdr = 5 * 512 * 7 + 3 * 512  # sample 7's .json header
    data[hdr + 124 : hdr + 136] = b"       14 \0 "[:12]  # a size with leading spaces
    data[hdr + 148 : hdr + 156] = b"%06o\0 " % (sum(data[hdr : hdr + 148]) + sum(data[hdr + 156 : hdr + 512]) + 256)
    same_both_ways(bytes(data))


@pytest.mark.parametrize(
    "where", [0, 1, 2, 512 * 5 * 30 + 3, 512 * 5 * 30 + 124, 512 * 5 * 30 + 150, 512 * 5 * 30 + 156, 512 * 5 * 30 + 600, 512 * 5 * 400 + 130]
)
def test_a_corrupt_byte_gives_the_same_samples_and_error(where):
    base = samples_tar(600)
    for value in (0, 0x20, 0x30, 0x37, 0x38, 0x80, 0xFF):
        data = bytearray(base)
        data[where] = value
        for read_size in (3000, 1 << 20):
            same_both_ways(bytes(data), read_size=read_size)


@pytest.mark.parametrize("cut", [100, 512 * 5 * 10, 512 * 5 * 10 + 700, 512 * 5 * 300 + 2000])
def test_truncated_and_ranged_reads_agree(cut):
    data = samples_tar(400)
    same_both_ways(data[:-cut], read_size=65536)
    same_both_ways(data, start=512 * 5 * 17, end=len(data) - 1024 - 512 * 5 * cut // 2560, require_end_marker=False)


def test_large_members_stay_with_the_loop():
    data = build([("k1.a", b"1"), ("k1.big", b"b" * 70_000), ("k2.a", b"2"), ("k2.big", b"c" * 70_000)] * 1)
    for read_size in (4096, 1 << 20):
        same_both_ways(data, read_size=read_size, large_member=65536)


def names():
    part = st.text(alphabet="abcAB01._/-\u00e9", min_size=0, max_size=12)
    return st.one_of(part, st.builds(lambda k, e: f"{k}.{e}", part, part))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(names(), st.integers(0, 1500)), min_size=1, max_size=40),
    st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), max_size=3),
    st.sampled_from([512, 1500, 8192, 1 << 20]),
    st.booleans(),
)
def test_fuzz_both_ways_agree(members, flips, read_size, as_bytearray):
    try:
        data = bytearray(build([(name, bytes([len(name) % 251]) * size) for name, size in members if name]))
    except (ValueError, UnicodeEncodeError):
        return
    for where, value in flips:
        data[where % len(data)] = value
    same_both_ways(bytes(data), read_size=read_size, as_bytearray=as_bytearray)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 12), st.integers(1, 4), st.lists(st.integers(0, 3000), min_size=1, max_size=4), st.sampled_from([700, 4096, 1 << 20]))
def test_fuzz_regular_samples_agree(n, m, sizes, read_size):
    exts = ["a", "b", "c", "d"][:m]
    data = build([(f"{i:03d}.{ext}", b"z" * sizes[(i + j) % len(sizes)]) for i in range(n * 20) for j, ext in enumerate(exts)])
    lists, error = same_both_ways(data, read_size=read_size)
    assert error is None and len(flat(lists)) == n * 20


# -- around the parser ------------------------------------------------------------------------------


class RecordingReader(FileReader):
    """A local file's reader (``FileReader``, as ``open_range`` makes one) that records the size of
    every read asked of it, ``read(n)`` and ``readinto(view)`` alike, in ``asked``."""

    __slots__ = ("asked",)

    def __init__(self, file):
        super().__init__(file, None, None)
        self.asked: list[int] = []

    def __call__(self, n):
        self.asked.append(n)
        return super().__call__(n)

    def readinto(self, view):
        self.asked.append(len(view))
        return super().readinto(view)


def test_local_reads_stay_small(tmp_path):
    from shardstream.format.manifest import Manifest
    from shardstream.pipeline.read import LOCAL_READ, read_range
    from shardstream.plan.epoch import Range

    path = tmp_path / "s.tar"
    path.write_bytes(samples_tar(2000))
    manifest: Manifest = scan_shards([str(path)])
    with open(path, "rb") as f:
        got = flat(read_range(manifest, Range(0, 0, 2000), read=(recording := RecordingReader(f)), read_size=4 << 20))
    with open(path, "rb") as f:
        expected = flat(iter_sample_dicts(f.read, url=manifest.shard_url(0), end=manifest.shards[0].span[1]))
    asked = recording.asked
    assert got == expected and len(got) == 2000 and asked and max(asked) <= LOCAL_READ + 2560


def test_local_reads_of_members_behind_pax_headers_are_larger_by_their_share(tmp_path):
    """webdataset's small samples (a pax header and its payload before each member) are read into
    the reused block in reads larger than a plain tar's by the share of those headers (at most
    MAX_SPREAD times), lists likewise: the same samples as the loop's, as many in a list as a plain
    tar's; a plain tar's reads stay as they were."""
    from shardstream.pipeline.read import LOCAL_READ, read_range
    from shardstream.plan.epoch import Range

    out = io.BytesIO()
    writer = wds.TarWriter(out)
    for i in range(3000):
        writer.write({"__key__": f"{i:06d}", "bin": bytes([i % 256]) * 1024, "json": json.dumps({"label": i}).encode()})
    writer.close()
    path = tmp_path / "w.tar"
    path.write_bytes(out.getvalue())
    manifest = scan_shards([str(path)])
    with open(path, "rb") as f:
        lists = list(read_range(manifest, Range(0, 0, 3000), read=(recording := RecordingReader(f)), read_size=4 << 20))
    with open(path, "rb") as f:
        span_end = manifest.shards[0].span[1]
        expected = flat(tar._parse(f.read, manifest.shard_url(0), 0, span_end, 1 << 16, False, (), tar.LARGE_MEMBER, None, dicts=True, fast=False))
    assert flat(lists) == expected and len(expected) == 3000
    # 9 blocks a sample, 4 of them pax headers and payloads: reads and lists 9/5 of a plain tar's.
    assert LOCAL_READ < max(recording.asked) <= LOCAL_READ * tar.MAX_SPREAD + 4608
    assert max(len(chunk) for chunk in lists) <= PARSE_WINDOW * 9 // 5 // (9 * 512) + 2
    assert max(len(chunk) for chunk in lists) > PARSE_WINDOW // (9 * 512) + 2


def test_decode_passes_lists_through_when_it_has_nothing_to_do():
    chunks = [[{"a": b"1"}], [], [{"a": b"2"}, {"a": b"3"}]]
    policy = ErrorPolicy("raise", 0, None)
    out = list(decode_samples(iter(chunks), Decoder({}), policy))
    assert out == [chunks[0], chunks[2]] and out[0] is chunks[0]


def test_decode_failures_count_as_one_call_per_sample_would():
    """Successes reset the run of consecutive failures: a run of 2 bad samples is within a
    tolerance of 2, 3 in a row is not, whatever the lists."""

    def sample(i, bad):
        return {"cls": b"x" if bad else str(i).encode(), "__key__": str(i), "__url__": "u"}

    def run(pattern, tolerance):
        policy = ErrorPolicy("skip", tolerance, None)
        chunks = [[sample(i, b) for i, b in enumerate(part)] for part in pattern]
        got = [s["cls"] for chunk in decode_samples(iter(chunks), Decoder({"cls": int}), policy) for s in chunk]
        return got, policy.skipped

    assert run([[0, 1, 1, 0, 1, 1, 0]], 2) == ([0, 3, 6], 4)
    assert run([[0, 1], [1, 0, 1], [1, 0]], 2) == ([0, 1, 1], 4)
    from shardstream.errors import TooManyErrors

    with pytest.raises(TooManyErrors):
        run([[0, 1, 1], [1, 0]], 2)
    with pytest.raises(SampleError):
        list(decode_samples(iter([[sample(0, True)]]), Decoder({"cls": int}), ErrorPolicy("raise", 0, None)))


# -- pax headers before every member: webdataset's TarWriter, tarfile's PAX format, GNU tar, bsdtar --

GNU_TAR = shutil.which("tar")
BSDTAR = shutil.which("bsdtar")


def fast_members(data: bytes, read_size: int = 1 << 24) -> tuple[int, int]:
    """(members the run path grouped, members in all) in one parse of ``data`` as dicts."""
    grouped = []
    real = tar._plain_samples

    def counting(run, *args):
        got = real(run, *args)
        if got is not None:
            grouped.append(len(run.keys))
        return got

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tar, "_plain_samples", counting)
        lists, error = parse(data, fast=True, dicts=True, read_size=read_size)
    assert error is None
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        total = sum(1 for m in tf.getmembers() if m.isfile())
    return sum(grouped), total


def first_headers(data: bytes) -> list[int]:
    """Where each regular member's first header (its pax header, if any) starts, by tarfile."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        previous_end = 0
        for m in tf.getmembers():
            if m.isfile():
                out.append(previous_end)
            previous_end = m.offset_data + (m.size + 511) // 512 * 512
    return out


def wds_shard(n: int, mtime: float | None = None) -> bytes:
    out = io.BytesIO()
    writer = wds.TarWriter(out, mtime=mtime)
    for i in range(n):
        writer.write({"__key__": f"{i:06d}", "bin": bytes([i % 256]) * (i % 700), "json": json.dumps({"label": i}).encode()})
    writer.close()
    return out.getvalue()


@pytest.mark.parametrize("read_size", [700, 8192, 1 << 20])
def test_webdataset_shards_take_the_run_path_with_the_loops_samples_and_offsets(read_size):
    data = wds_shard(1500)
    assert data[156:157] == b"x" and b" mtime=" in data[512:1024]  # a pax header (float mtime) before each member
    lists, error = same_both_ways(data, read_size=read_size)
    got = flat(lists)
    assert error is None and [k for k, *_ in got] == [f"{i:06d}" for i in range(1500)]
    assert got[9][3] == {"bin": bytes([9]) * 9, "json": b'{"label": 9}'}
    # A sample's offset is its first header: the pax header of its first member (offset sidecars, resume).
    assert [offset for _, offset, _, _ in got] == first_headers(data)[::2]
    assert [end for _, _, end, _ in got][:-1] == first_headers(data)[2::2]
    fast, total = fast_members(data)
    assert total == 3000 and fast == total
    # With blocks of 64 KiB, only members cut by a block's end go member by member.
    fast, _ = fast_members(data, read_size=65536)
    assert fast >= total - 2 * (len(data) // 65536 + 1)


def _tarfile_shard(fmt: int, mtime) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for i in range(400):
            for ext, payload in (("jpg", bytes([i % 256]) * (i * 3)), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"d/{i:05d}.{ext}")
                info.size, info.mtime, info.uname, info.gname = len(payload), mtime, "user", "group"
                tf.addfile(info, io.BytesIO(payload))
    return out.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
@pytest.mark.parametrize("mtime", [1795738509.0581176, 1795738509])
def test_tarfile_formats_with_float_mtimes_take_the_run_path(fmt, mtime):
    data = _tarfile_shard(fmt, mtime)
    if fmt == tarfile.PAX_FORMAT and isinstance(mtime, float):
        assert data[156:157] == b"x"
    lists, error = same_both_ways(data, read_size=4096)
    assert error is None and len(flat(lists)) == 400
    fast, total = fast_members(data)
    assert fast == total == 800


def _tool_shard(tmp_path, args: list[str]) -> bytes:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(300):
        (src / f"{i:06d}.bin").write_bytes(os.urandom(i * 5 % 1500))
        (src / f"{i:06d}.cls").write_text(str(i))
    names = sorted(p.name for p in src.iterdir())
    subprocess.run([*args, "-cf", str(tmp_path / "x.tar"), *names], cwd=src, check=True, capture_output=True)
    return (tmp_path / "x.tar").read_bytes()


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["gnu"], id="gnu-default"),
        pytest.param(["gnu", "--format=posix"], id="gnu-posix"),
        pytest.param(["gnu", "--format=ustar"], id="gnu-ustar"),
        pytest.param(["bsd"], id="bsdtar-default"),
        pytest.param(["bsd", "--format=pax"], id="bsdtar-pax"),
        pytest.param(["bsd", "--format=ustar"], id="bsdtar-ustar"),
    ],
)
def test_gnu_tar_and_bsdtar_archives_take_the_run_path(tmp_path, args):
    tool = {"gnu": GNU_TAR, "bsd": BSDTAR}[args[0]]
    if tool is None:
        pytest.skip(f"{args[0]} tar is not installed (bsdtar: apt-get install libarchive-tools)")
    data = _tool_shard(tmp_path, [tool, *args[1:]])
    if "--format=posix" in args or "--format=pax" in args:
        assert data[156:157] == b"x"  # a pax header (atime, ctime, mtime) before each member
    for read_size in (1000, 1 << 20):
        lists, error = same_both_ways(data, read_size=read_size)
        got = flat(lists)
        assert error is None and len(got) == 300 and [o for _, o, _, _ in got] == first_headers(data)[::2]
    fast, total = fast_members(data)
    assert fast == total == 600


def pax_member(payload: bytes, kind: bytes = tarfile.XHDTYPE) -> bytes:
    """A pax header ('x') carrying ``payload`` as it is (well-formed or not)."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = kind, len(payload)
    return info.tobuf(format=tarfile.USTAR_FORMAT) + payload + padding(len(payload))


def record(keyword: str, value: str | bytes) -> bytes:
    body = b" " + keyword.encode() + b"=" + (value if isinstance(value, bytes) else value.encode()) + b"\n"
    n = len(body) + 1
    n += len(str(n + len(str(n)))) - 1  # the length counts its own digits
    return str(n).encode() + body


def wds_like(keys: range, payload_for=lambda i, ext: record("mtime", f"{i}.5")) -> bytes:
    return b"".join(
        pax_member(payload_for(i, ext)) + member_header(f"{i:05d}.{ext}", len(data)) + data + padding(len(data))
        for i in keys
        for ext, data in (("a", b"x" * (i % 600)), ("b", str(i).encode()))
    )


@pytest.mark.parametrize(
    "odd",
    [
        record("path", "other/99999.a"),  # a new name: the loop applies it
        record("path", "00042.a"),  # a name that repeats a key: the loop's error
        record("size", "3"),  # a new size: the loop applies it
        record("size", "99999999"),  # past the end
        record("linkpath", "x"),
        record("hdrcharset", "BINARY"),
        record("GNU.sparse.size", "10") + record("GNU.sparse.map", "0,1"),
        record("mtime", "1.5") + record("path", "z/00041.a"),  # harmful after harmless
        record("SCHILY.xattr.user.some_long_attribute_name", "v"),  # harmless, a long keyword
        record("LIBARCHIVE.xattr.user.x", "dg==") + record("SCHILY.dev", "1") + record("comment", "c"),
        record("uname", "a\nb"),  # a newline in a value (the length covers it)
        record("unknown", "1"),  # a keyword not known harmless
        record("mtimes", "1"),
        record("mtim", "1"),
        record("", "1"),
        b"28 mtime=1795738509.0581176",  # no newline at the end
        b"27 mtime=1795738509.0581176\n",  # a length one short
        b"29 mtime=1795738509.0581176\n",  # one long: past the payload
        b"2x mtime=1795738509.0581176\n",  # not a number
        b"028 mtime=1795738509.058117\n",  # leading zero (int() takes it)
        b" 28 mtime=1795738509.058117\n",
        b"28 mtime=1795738509.0581176\n\0\0\0",  # NUL padding after the records
        b"28 mtime=1795\x0038509.0581176\n",  # a NUL in a value
        b"10 mtime\n",  # no '='
        b"5 a=\n",  # a record shorter than its digits and keyword need
        b"99999 mtime=1\n",
        b"\n",
        b"",  # an empty payload
        record("mtime", "1") * 40,  # a payload of several blocks
    ],
)
@pytest.mark.parametrize("read_size", [1024, 1 << 20])
def test_odd_pax_headers_give_the_loops_answer(odd, read_size):
    """Pax headers the run path must leave to the loop (path, size, linkpath... records;
    malformed or truncated payloads), among harmless ones: the same samples and errors."""
    for at in (0, 41, 79):
        data = wds_like(range(80), lambda i, ext, at=at: odd if (i == at and ext == "a") else record("mtime", f"{i}.5")) + END_OF_ARCHIVE
        lists, error = same_both_ways(data, read_size=read_size)
        if error is None:
            assert len(flat(lists)) >= 79


def test_pax_headers_out_of_place_give_the_loops_answer():
    good = wds_like(range(30))
    one = wds_like(range(30, 31))
    rest = wds_like(range(31, 60))
    dir_member = tarfile.TarInfo("dir/")
    dir_member.type = tarfile.DIRTYPE
    cases = [
        good + pax_member(record("mtime", "1")) + one + rest,  # two pax headers before one member
        good + pax_member(record("mtime", "1")) + dir_member.tobuf(format=tarfile.USTAR_FORMAT) + rest,  # before a directory
        good + pax_member(record("mtime", "1"), tarfile.XGLTYPE) + rest,  # a global header
        good + pax_member(record("mtime", "1")),  # at the end: the archive ends after it
        good + pax_member(record("mtime", "1"))[:700],  # cut in its payload
        good + pax_member(record("mtime", "1")) + member_header("00030.a", 5)[:300],
        good + one[:512] + one[1024:] + rest,  # (a member header where the payload was)
    ]
    for data in cases:
        for read_size in (1024, 1 << 20):
            same_both_ways(data + END_OF_ARCHIVE, read_size=read_size)
            same_both_ways(data, read_size=read_size)


@pytest.mark.parametrize("where", [3, 124, 150, 156, 345, 512 + 1, 512 + 3, 512 + 27, 1024 + 156])
def test_a_corrupt_byte_in_a_pax_header_gives_the_loops_answer(where):
    # 120 samples (490 KiB): the byte in the first member or in sample 50's, 70 samples after it
    # read across about 100 block edges at 3,000 bytes, and in one read at 1 MiB
    base = wds_shard(120)
    for offset in (0, 4 * 512 * 101):
        for value in (0, 0x0A, 0x20, 0x30, 0x3D, 0x78, 0xFF):
            data = bytearray(base)
            data[offset + where] = value
            for read_size in (3000, 1 << 20):
                same_both_ways(bytes(data), read_size=read_size)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("read_size", [1500, 1 << 20])
def test_a_corrupt_header_keeps_the_complete_samples_before_it(fast, reuse, read_size):
    """Samples shown complete before a corrupt header (by a header of the next key that comes
    before it) are delivered, then the error naming it, wherever the parse's lists and reads
    happen to end (one read of the whole shard, too). The sample just before the corrupt header is
    not: that header may have been one of its members."""
    members = []
    for i in range(12):
        for ext, size in (("a", 7 * i % 900), ("bb", 13 * i % 700)):  # irregular: the general loop's
            members.append(member_header(f"{i:04d}.{ext}", size) + b"q" * size + padding(size))
    data = bytearray(b"".join(members) + END_OF_ARCHIVE)
    bad = sum(len(m) for m in members[:16])  # sample 0008's first header
    data[bad + 5] ^= 0x40  # its checksum no longer matches
    lists, error = parse(bytes(data), fast=fast, dicts=True, reuse=reuse, read_size=read_size)
    assert [s["__key__"] for s in flat(lists)] == [f"{i:04d}" for i in range(7)]
    assert error == (ShardFormatError, f"mem://x.tar at byte {bad}: tar header checksum mismatch (corrupt or not a tar file)", bad)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.lists(
            st.tuples(
                st.sampled_from(["mtime", "atime", "uid", "uname", "path", "size", "SCHILY.xattr.k", "x", "GNU.sparse.map"]),
                st.text(alphabet="019az./\n=", max_size=8),
            ),
            max_size=3,
        ),
        min_size=1,
        max_size=30,
    ),
    st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), max_size=2),
    st.sampled_from([512, 1500, 1 << 20]),
)
# A corrupt header in a read-into block that also holds the end of the archive: the block's
# complete sample before it was dropped by the run path (found by this test, once)
@example(records=[[], [("mtime", "")], [], []], flips=[(1 << 30, 0)], read_size=1500)
def test_fuzz_pax_records_both_ways_agree(records, flips, read_size):
    payloads = [b"".join(record(k, v) for k, v in recs) for recs in records]
    data = bytearray(
        b"".join(
            (pax_member(payloads[i]) if payloads[i] or i % 2 else b"")
            + member_header(f"{i // 2:04d}.{'ab'[i % 2]}", i * 13 % 900)
            + b"q" * (i * 13 % 900)
            + padding(i * 13 % 900)
            for i in range(len(payloads))
        )
        + END_OF_ARCHIVE
    )
    for where, value in flips:
        data[where % len(data)] = value
    same_both_ways(bytes(data), read_size=read_size)


def one_record_check(payloads: list[bytes]) -> bool:
    """``_one_harmless_record_each`` on these payloads, laid out as the run path lays them out
    (a row each, as wide as the longest, the rest of the row what follows in the block: zeros)."""
    import numpy as np

    widest = max(len(p) for p in payloads)
    rows = np.zeros((len(payloads), widest), np.uint8)
    for i, p in enumerate(payloads):
        rows[i, : len(p)] = np.frombuffer(p, np.uint8)
    return tar._one_harmless_record_each(rows, np.array([len(p) for p in payloads], dtype=np.int64))


def test_webdataset_pax_payloads_take_the_one_record_check(monkeypatch):
    """webdataset's payloads ("27 mtime=1795748319.707674\\n", one per member) pass the few-call
    check, so the general record scan never runs on them; the samples are the loop's."""
    answers = []
    real = tar._one_harmless_record_each
    monkeypatch.setattr(tar, "_one_harmless_record_each", lambda *a: answers.append(real(*a)) or answers[-1])
    data = wds_shard(800)
    lists, error = same_both_ways(data, read_size=1 << 20)
    assert error is None and len(flat(lists)) == 800
    assert answers and all(answers)
    assert one_record_check([record("mtime", "1795748319.707674"), record("atime", "1.5")]) is False  # two keywords: general scan
    assert one_record_check([record("mtime", "1.5") + record("atime", "1.5")]) is False  # two records: general scan


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.builds(
                record,
                st.sampled_from(["mtime", "atime", "uid", "path", "size", "mtim", "SCHILY.xattr.k"]),
                st.text(alphabet="0159.=\n\t\0 az", max_size=12),
            ),
            st.binary(min_size=1, max_size=40),
            st.builds(lambda n, rest: str(n).encode() + rest, st.integers(0, 120), st.binary(max_size=30)),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_the_one_record_check_accepts_only_what_the_loop_parses_as_harmless(payloads):
    """Whatever the check accepts, ``_parse_pax`` reads without an error as one record per
    payload, with a keyword the run path may ignore."""
    if one_record_check(payloads):
        for p in payloads:
            records = tar._parse_pax(p, "u", 0)
            assert len(records) == 1
            (keyword,) = records
            assert keyword.encode() in tar._HARMLESS_PAX_KEYWORDS or keyword.encode().startswith(tar._HARMLESS_PAX_PREFIXES)
            assert p.count(b"\n") == 1 and p.endswith(b"\n") and b"\0" not in p


def short_records_check(payloads: list[bytes]) -> bool:
    """``_short_harmless_records`` on these payloads, joined as the run path joins them."""
    import numpy as np

    return tar._short_harmless_records(np.frombuffer(b"".join(payloads), np.uint8), np.array([len(p) for p in payloads], dtype=np.int64))


def test_gnu_tar_and_bsdtar_pax_payloads_take_the_short_records_check(monkeypatch):
    """Payloads of several records with two-digit lengths (GNU tar's and bsdtar's pax formats:
    "30 atime=...\\n30 ctime=...\\n") pass the short-records check; the samples are the loop's."""
    answers = []
    real = tar._short_harmless_records
    monkeypatch.setattr(tar, "_short_harmless_records", lambda *a: answers.append(real(*a)) or answers[-1])
    data = wds_like(range(600), lambda i, ext: record("atime", f"17957{i:05d}.833819224") + record("ctime", f"{i}.5")) + END_OF_ARCHIVE
    lists, error = same_both_ways(data, read_size=1 << 20)
    assert error is None and len(flat(lists)) == 600
    assert answers and all(answers)
    assert short_records_check([record("atime", "1.5") + record("ctime", "2.25"), record("mtime", "3")]) is True
    assert short_records_check([record("atime", "1.5") + record("path", "x.txt")]) is False  # path: not harmless
    assert short_records_check([record("atime", "1.5") + record("SCHILY.xattr.k", "v")]) is False  # long keyword: general scan
    assert short_records_check([record("atime", "x" * 100)]) is False  # three-digit length: general scan
    assert short_records_check([record("atime", "1.5\n2")]) is False  # a newline inside a value
    assert short_records_check([record("atime", "1.5")[:-1] + b" "]) is False  # no closing newline


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.lists(
            st.one_of(
                st.builds(
                    record,
                    st.sampled_from(["mtime", "atime", "ctime", "uid", "path", "size", "mtim", "gname", "comment", "SCHILY.dev"]),
                    st.text(alphabet="0159.=\n\t\0 az", max_size=14),
                ),
                st.binary(min_size=1, max_size=30),
                st.builds(lambda n, rest: str(n).encode() + rest, st.integers(0, 120), st.binary(max_size=30)),
            ),
            min_size=1,
            max_size=3,
        ).map(b"".join),
        min_size=1,
        max_size=5,
    )
)
def test_the_short_records_check_accepts_only_what_the_loop_parses_as_harmless(payloads):
    """Whatever the check accepts, ``_parse_pax`` reads without an error, every record's keyword
    one the run path may ignore, each record's length field its own length (the newlines are
    exactly the records' ends), no NUL."""
    if short_records_check(payloads):
        for p in payloads:
            records = tar._parse_pax(p, "u", 0)
            assert records and all(k.encode() in tar._HARMLESS_PAX_KEYWORDS for k in records)
            assert p.endswith(b"\n") and b"\0" not in p
            pos, ends = 0, []
            while pos < len(p):
                pos += int(p[pos : p.index(b" ", pos)])
                ends.append(pos - 1)
            assert pos == len(p) and ends == [i for i, c in enumerate(p) if c == 10]


def test_a_threads_parses_take_turns_with_one_reused_block():
    """A parse into a reused block (a local file) starts from the block the thread's last finished
    parse grew (lent: no new memory for each range of a pass); parses that overlap in one thread
    (two sources read in turn, one abandoned half-way) or run in other threads each have a block
    of their own: every one gives the loop's samples."""
    import threading

    datas = [samples_tar(700, seed=seed) for seed in range(3)]
    expected = [flat(parse(data, fast=False, dicts=True)[0]) for data in datas]

    def reused(data):
        return iter_sample_dicts(BlocksInto(data), url="mem://x.tar", end=len(data), read_size=65536, reuse_blocks=True)

    assert flat(reused(datas[0])) == expected[0]
    block = tar._ARENAS.block
    assert isinstance(block, bytearray) and len(block) >= 65536 and len(block) % tar.ARENA_STEP == 0
    assert flat(reused(datas[1])) == expected[1]
    assert tar._ARENAS.block is block  # the next range's parse read into the same block
    # Two parses in turn in one thread, and one abandoned after its first list.
    a, b, c = reused(datas[0]), reused(datas[1]), reused(datas[2])
    got_a, got_b = [], []
    first_c = next(c)
    for x, y in zip(a, b):
        got_a += x
        got_b += y
    got_a += flat(a)
    got_b += flat(b)
    c.close()
    assert got_a == expected[0] and got_b == expected[1] and first_c == expected[2][: len(first_c)]
    results: dict[int, list] = {}

    def work(i):
        results[i] = flat(reused(datas[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert [results[i] for i in range(3)] == expected
