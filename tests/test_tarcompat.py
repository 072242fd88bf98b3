"""Tar dialects read the way webdataset reads them: archives built by GNU tar, bsdtar (where
installed) and Python's tarfile in every format, with long names, ustar prefixes, pax records,
sparse files, metadata members and compression; each read with webdataset and with shardstream
(directly, through ``index`` and through ``pack --kind shards``), keys, fields and bytes equal.
Plus the parser's cost: a large member is copied a fixed number of times, whatever the pieces."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tracemalloc

import pytest
import webdataset as wds

from shardstream.errors import ShardFormatError
from shardstream.format.tar import END_OF_ARCHIVE, iter_samples, member_header, padding
from shardstream.options import Cache, Read, Store
from shardstream.plan.topology import World

GNU_TAR = shutil.which("tar")
BSDTAR = shutil.which("bsdtar")
needs_gnu_tar = pytest.mark.skipif(GNU_TAR is None, reason="GNU tar is not installed")
needs_bsdtar = pytest.mark.skipif(BSDTAR is None, reason="bsdtar is not installed (apt-get install libarchive-tools)")


def parse(data: bytes, read_size: int = 1 << 16) -> list[tuple[str, dict[str, bytes]]]:
    stream = io.BytesIO(data)
    return [(k, f) for k, _o, _e, f in iter_samples(stream.read, url="mem://x.tar", end=len(data), read_size=read_size, require_end_marker=True)]


def wds_samples(path: str) -> list[tuple[str, dict[str, bytes]]]:
    out = []
    for sample in wds.WebDataset(path, shardshuffle=False, empty_check=False):
        out.append((sample["__key__"], {k: v for k, v in sample.items() if not k.startswith("__")}))
    return out


# --- cost: linear in the member size ---------------------------------------------------------


def _allocated_while_parsing(data: bytes, piece: int) -> tuple[int, int]:
    """(bytes allocated by the parser between its read() calls, read() calls): each interval's
    traced peak above the memory held when it began, summed. A parser that rebuilds its buffer
    per piece allocates the growing buffer once per piece (quadratic); one that joins once
    allocates each byte a fixed number of times."""
    stream = io.BytesIO(data)
    total = 0
    calls = 0
    tracemalloc.start()
    mark = tracemalloc.get_traced_memory()[0]

    def read(n: int) -> bytes:
        nonlocal total, mark, calls
        total += tracemalloc.get_traced_memory()[1] - mark
        chunk = stream.read(min(n, piece))
        calls += 1
        tracemalloc.reset_peak()
        mark = tracemalloc.get_traced_memory()[0]
        return chunk

    try:
        samples = list(iter_samples(read, url="mem://big.tar", end=len(data), read_size=1 << 20, require_end_marker=True))
        total += tracemalloc.get_traced_memory()[1] - mark
    finally:
        tracemalloc.stop()
    assert [(k, len(f["bin"])) for k, _o, _e, f in samples] == [("big", 64 << 20)]
    return total, calls


def test_a_64mb_member_is_copied_a_fixed_number_of_times_whatever_the_pieces():
    size = 64 << 20
    payload = os.urandom(1 << 20) * 64
    data = member_header("big.bin", size) + payload + padding(size) + END_OF_ARCHIVE
    few, few_calls = _allocated_while_parsing(data, 16 << 20)
    many, many_calls = _allocated_while_parsing(data, 64 << 10)
    assert many_calls >= 64 * few_calls  # really delivered in many more pieces
    # one join of the pieces and one slice for the field; the quadratic parser allocated ~32x
    assert few <= 3 * size and many <= 3 * size, (few, many)
    assert abs(many - few) <= size // 4, (few, many)


# --- names: prefix + name unless a record overrides it; metadata members ------------------------


def _ustar_with_prefix(name: str, data: bytes, pax: dict[str, str] | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    out = b""
    if pax is not None:  # a pax header with no 'path' record, as bsdtar writes for xattrs or mtimes
        out += tarfile.TarInfo._create_pax_generic_header(pax, tarfile.XHDTYPE, "utf-8")
    return out + info.tobuf(format=tarfile.USTAR_FORMAT) + data + padding(len(data))


def test_ustar_prefix_is_kept_when_a_pax_header_has_no_path_record(tmp_path):
    long_dir = "D" * 60 + "/" + "E" * 60
    data = _ustar_with_prefix(f"{long_dir}/s1.txt", b"one", pax={"mtime": "1.5"}) + _ustar_with_prefix(f"{long_dir}/s2.txt", b"two") + END_OF_ARCHIVE
    path = tmp_path / "prefix.tar"
    path.write_bytes(data)
    expected = [(f"{long_dir}/s1", {"txt": b"one"}), (f"{long_dir}/s2", {"txt": b"two"})]
    assert wds_samples(str(path)) == expected
    assert parse(data) == expected


def test_metadata_members_hidden_files_and_multi_dot_names_split_like_webdataset(tmp_path):
    members = [
        ("__meta__/info.txt", b"m"),
        ("__index__", b"i"),
        ("a.b/c.d.E", b"1"),
        ("a.b/c.JSON", b"2"),
        (".hidden.txt", b"h"),
        ("dir/.hidden.txt", b"h2"),
        ("__x__y.txt", b"3"),
        ("noext", b"n"),
        ("k/s.seg.PNG", b"4"),
        ("k/s.cls", b"5"),
    ]
    path = tmp_path / "names.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload))
    expected = wds_samples(str(path))
    assert [k for k, _ in expected] == ["a.b/c", "dir/", "__x__y", "k/s"]  # dir/.hidden.txt: key "dir/"
    assert parse(path.read_bytes()) == expected


# --- pax size, sparse -------------------------------------------------------------------------


def test_pax_size_record_is_read_and_bounded_by_the_bytes_there():
    info = tarfile.TarInfo("k.bin")
    info.size = 5
    pax = tarfile.TarInfo._create_pax_generic_header({"size": "5"}, tarfile.XHDTYPE, "utf-8")
    header = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    header[124:136] = b"00000000000\0"  # as writers do when the size does not fit the field
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header)
    data = pax + bytes(header) + b"hello" + padding(5) + END_OF_ARCHIVE
    assert parse(data) == [("k", {"bin": b"hello"})]
    huge = tarfile.TarInfo._create_pax_generic_header({"size": str(1 << 40)}, tarfile.XHDTYPE, "utf-8")
    with pytest.raises(ShardFormatError, match="claims 1099511627776 bytes"):
        parse(huge + bytes(header) + b"hello" + padding(5) + END_OF_ARCHIVE)


def _sparse_file(tmp_path) -> bytes:
    path = tmp_path / "src" / "sp.bin"
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(1 << 20)
        f.seek(300_000)
        f.write(b"data in the middle")
        f.seek((1 << 20) - 5)
        f.write(b"tail!")
    (tmp_path / "src" / "sp.cls").write_text("7")
    return path.read_bytes()


@needs_gnu_tar
@pytest.mark.parametrize("fmt", ["pax:0.0", "pax:0.1", "pax:1.0", "gnu"])
def test_gnu_tar_sparse_members_are_expanded(tmp_path, fmt):
    contents = _sparse_file(tmp_path)
    out = tmp_path / "s.tar"
    tar_format, _, version = fmt.partition(":")
    args = [GNU_TAR, f"--format={tar_format}", "--sparse", "-cf", str(out), "sp.bin", "sp.cls"]
    if version:
        args.insert(3, f"--sparse-version={version}")
    subprocess.run(args, cwd=tmp_path / "src", check=True)
    expected = wds_samples(str(out))
    assert expected == [("sp", {"bin": contents, "cls": b"7"})]
    assert parse(out.read_bytes(), read_size=4096) == expected


def test_old_gnu_sparse_with_an_extended_map_is_refused_naming_the_member():
    info = tarfile.TarInfo("sp.bin")
    info.type = tarfile.GNUTYPE_SPARSE
    info.size = 0
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[482] = 1  # "isextended": more map entries follow in extra blocks
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header)
    with pytest.raises(ShardFormatError, match="old GNU sparse member 'sp.bin'.*not supported") as err:
        parse(bytes(header) + END_OF_ARCHIVE)
    assert "mem://x.tar" in str(err.value)


# --- compressed shards ------------------------------------------------------------------------


def _members(n: int, tag: str = "") -> list[tuple[str, bytes]]:
    return [(f"s{tag}{i:03d}.{ext}", data) for i in range(n) for ext, data in (("txt", f"text {tag}{i}".encode()), ("bin", os.urandom(700 + i)))]


def _write_tar(path, members, mode: str = "w", fmt: int = tarfile.PAX_FORMAT) -> None:
    if str(path).endswith(".zst"):
        zstandard = pytest.importorskip("zstandard")
        plain = io.BytesIO()
        _write_tar_fileobj(plain, members, "w", fmt)
        path.write_bytes(zstandard.ZstdCompressor().compress(plain.getvalue()))
        return
    with open(path, "wb") as f:
        _write_tar_fileobj(f, members, mode, fmt)


def _write_tar_fileobj(fileobj, members, mode: str, fmt: int) -> None:
    with tarfile.open(fileobj=fileobj, mode=mode, format=fmt) as tf:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload))


COMPRESSED = [("c.tar.gz", "w:gz"), ("c.tgz", "w:gz"), ("c.tar.bz2", "w:bz2"), ("c.tar.xz", "w:xz"), ("c.tar.zst", "w")]


@pytest.mark.parametrize(("name", "mode"), COMPRESSED)
def test_compressed_shards_read_directly_through_index_and_from_the_middle(tmp_path, name, mode):
    from shardstream.format.manifest import load_manifest
    from shardstream.pipeline.read import read_range
    from shardstream.plan.epoch import Range
    from shardstream.tools.index import write_index

    path = tmp_path / name
    _write_tar(path, _members(12), mode)
    expected = wds_samples(str(path)) if not name.endswith(".zst") else parse(_plain(path))
    manifest, url = write_index(str(path), str(tmp_path))
    manifest = load_manifest(url)
    assert manifest.shards[0].path == name and manifest.shards[0].bytes == path.stat().st_size
    got = [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for chunk in read_range(manifest, Range(0, 0, 12)) for s in chunk]
    assert got == expected
    middle = [s["__key__"] for chunk in read_range(manifest, Range(0, 5, 9)) for s in chunk]
    assert middle == [k for k, _ in expected[5:9]]


def _plain(path) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(path.read_bytes()), read_across_frames=True).read()


def test_compressed_shards_through_shardstream_workers_pack_show_and_verify(tmp_path, capsys):
    from shardstream import ShardStream
    from shardstream.cli.main import main
    from shardstream.write.pack import pack

    src = tmp_path / "src"
    src.mkdir()
    _write_tar(src / "a.tar.gz", _members(10, "a"), "w:gz")
    _write_tar(src / "b.tgz", _members(7, "b"), "w:gz")
    _write_tar(src / "c.tar", _members(5, "c"))
    expected = {k: f for p in ("a.tar.gz", "b.tgz", "c.tar") for k, f in wds_samples(str(src / p))}
    assert main(["index", str(src), str(tmp_path / "idx")]) == 0  # a directory: its *.tar* shards
    stream = ShardStream(str(tmp_path / "idx"), batch_size=2, shuffle=False, decode=False, world=World(1, 2), collate=lambda samples: samples)
    assert "2 compressed shards" in stream.plan().summary()
    other = ShardStream(str(tmp_path / "idx"), batch_size=2, shuffle=False, decode=False, world=World(0, 2), collate=lambda samples: samples)
    import torch.utils.data

    seen = []
    for ds in (other, stream):
        for batch in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
            for s in batch:
                seen.append(s["__key__"])
                assert {k: v for k, v in s.items() if not k.startswith("__")} == expected[s["__key__"]]
    assert len(set(seen)) == len(seen) == 20  # 22 samples, 2 ranks x 5 batches of 2: equal batches, 2 dropped
    result = pack(str(src / "*.t*"), str(tmp_path / "packed"), kind="shards")
    assert result.samples == 22
    repacked = ShardStream(str(tmp_path / "packed"), batch_size=1, shuffle=False, decode=False, world=World(0, 1), collate=lambda samples: samples)
    assert {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for b in repacked for s in b} == expected
    assert main(["verify", str(tmp_path / "idx")]) == 0
    assert main(["show", str(tmp_path / "idx"), "--key", "sb003"]) == 0
    assert "sb003" in capsys.readouterr().out


def test_corrupt_compressed_shard_is_a_format_error_naming_it(tmp_path):
    from shardstream.errors import ShardFormatError as FormatError
    from shardstream.format.scan import scan_shard

    path = tmp_path / "x.tar.gz"
    _write_tar(path, _members(20), "w:gz")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match=r"x\.tar\.gz.*compressed \(gzip\) shard is corrupt or truncated"):
        scan_shard(str(path))


@pytest.mark.parametrize("spelling", ["relative", "dot", "absolute", "file"])
def test_index_resolves_shards_under_dest_however_both_are_spelled(tmp_path, monkeypatch, spelling):
    from shardstream.cli.main import main
    from shardstream.format.manifest import load_manifest

    monkeypatch.chdir(tmp_path)
    (tmp_path / "wds").mkdir()
    for i in range(2):
        _write_tar(tmp_path / "wds" / f"train-{i:06d}.tar", _members(3, str(i)))
    pattern, dest = {
        "relative": ("wds/train-{000000..000001}.tar", "wds"),
        "dot": ("./wds/train-{000000..000001}.tar", "./wds"),
        "absolute": (f"{tmp_path}/wds/*.tar", "wds"),
        "file": (f"file://{tmp_path}/wds/train-{{000000..000001}}.tar", f"file://{tmp_path}/wds"),
    }[spelling]
    assert main(["index", pattern, dest]) == 0
    manifest = load_manifest(str(tmp_path / "wds"))
    assert [s.path for s in manifest.shards] == ["train-000000.tar", "train-000001.tar"]
    assert manifest.total_samples == 6


def test_index_takes_several_inputs_and_a_file_listing_urls(tmp_path):
    from shardstream.cli.main import main
    from shardstream.format.manifest import load_manifest

    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        _write_tar(tmp_path / name / "s.tar", _members(2, name))
    (tmp_path / "list.txt").write_text(f"# shards\n{tmp_path}/c/s.tar\n\n")
    assert main(["index", str(tmp_path / "a" / "*.tar"), str(tmp_path / "b"), str(tmp_path / "list.txt"), str(tmp_path)]) == 0
    assert [s.path for s in load_manifest(str(tmp_path)).shards] == ["a/s.tar", "b/s.tar", "c/s.tar"]


# --- every dialect: GNU tar, bsdtar, tarfile; read by webdataset and shardstream ---------------

SHORT_NAMES = [
    "a/s1.txt",
    "a/s1.cls",
    "\u00fcber/s3.txt",
    "s4/.hidden.txt",
    "__meta__/info.txt",
    "S5.JPG",
    "S5.cls",
    "s6.seg.png",
    "s6.txt",
    "noext",
    "k.v/s7.json",
]
PREFIX_NAMES = ["D" * 60 + "/" + "E" * 60 + "/s2.txt", "D" * 60 + "/" + "E" * 60 + "/s2.bin"]
LONG_NAMES = ["L" * 130 + ".txt"]


def _source_tree(root, names: list[str]) -> None:
    for i, name in enumerate(names):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"{name}:{i}".encode() * (1 + i * 37))


def _names_for(tool: str, fmt: str) -> list[str]:
    if fmt in ("v7",):
        return [n for n in SHORT_NAMES if n.isascii()]
    if fmt in ("ustar",):
        return SHORT_NAMES + PREFIX_NAMES
    return SHORT_NAMES + PREFIX_NAMES + LONG_NAMES


def _build(tmp_path, tool: str, fmt: str, compress: str = "") -> str:
    src = tmp_path / "src"
    names = _names_for(tool, fmt)
    _source_tree(src, names)
    out = tmp_path / ("x.tar" + {"": "", "gz": ".gz", "zst": ".zst"}[compress])
    if tool == "tarfile":
        mode = "w:gz" if compress == "gz" else "w"
        tar_format = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}[fmt]
        with tarfile.open(out, mode, format=tar_format) as tf:
            for name in names:
                tf.add(src / name, arcname=name)
        return str(out)
    flags = {"gz": ["-z"], "zst": ["--zstd"], "": []}[compress]
    if tool == "gnu":
        args = [GNU_TAR, f"--format={fmt}", *flags, "-cf", str(out), *names]
    else:
        args = [BSDTAR, *([f"--format={fmt}"] if fmt != "default" else []), *flags, "-cf", str(out), *names]
    subprocess.run(args, cwd=src, check=True, capture_output=True)
    return str(out)


class _Counted:
    """Stream counters in a dict (read_range's ``counters``)."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def step(self, what: str, batch: bool = False) -> None:
        pass


def _read_all_ways(tmp_path, path: str, *, through_pack: bool = False) -> None:
    from shardstream.format.manifest import load_manifest
    from shardstream.pipeline.read import read_range
    from shardstream.plan.epoch import Range
    from shardstream.tools.index import write_index

    if path.endswith(".zst"):  # webdataset (Python's tarfile) reads no zstd: it reads the decompressed tar
        plain = tmp_path / "plain.tar"
        plain.write_bytes(_plain(tmp_path / path))
        expected = wds_samples(str(plain))
    else:
        expected = wds_samples(path)
    assert len(expected) >= 5 and all(not k.startswith("__meta__") for k, _ in expected)
    manifest, url = write_index(path, str(tmp_path / "idx"))
    manifest = load_manifest(url)
    # Read through the member sidecar `index` wrote (sliced, no header parsed): the whole shard,
    # and a range from its middle; and with the sidecar ignored (parsed, as an older index reads).
    assert manifest.member_bytes[0] > 0, "index wrote no member sidecar for this archive"
    counters = _Counted()
    n = manifest.shards[0].samples
    indexed = [
        (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
        for chunk in read_range(manifest, Range(0, 0, n), counters=counters)
        for s in chunk
    ]
    assert indexed == expected
    middle = [
        (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
        for chunk in read_range(manifest, Range(0, 2, n - 1), counters=counters)
        for s in chunk
    ]
    assert middle == expected[2 : n - 1]
    assert counters.counts["ranges_sliced"] == 2 == counters.counts["ranges_opened"]
    manifest.member_bytes[:] = -1
    parsed = [
        (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
        for chunk in read_range(manifest, Range(0, 0, n), counters=counters)
        for s in chunk
    ]
    assert parsed == expected and counters.counts["ranges_sliced"] == 2
    if path.endswith(".tar"):
        with open(path, "rb") as f:
            assert parse(f.read(), read_size=1024) == expected
    if through_pack:
        from shardstream.write.pack import pack

        pack(path, str(tmp_path / "packed"), kind="shards")
        packed = load_manifest(str(tmp_path / "packed"))
        got = [
            (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
            for i, shard in enumerate(packed.shards)
            for chunk in read_range(packed, Range(i, 0, shard.samples))
            for s in chunk
        ]
        assert got == expected


@pytest.mark.parametrize("fmt", ["ustar", "gnu", "pax"])
def test_python_tarfile_every_format(tmp_path, fmt):
    _read_all_ways(tmp_path, _build(tmp_path, "tarfile", fmt), through_pack=fmt == "pax")


@needs_gnu_tar
@pytest.mark.parametrize(("fmt", "compress"), [("v7", ""), ("oldgnu", ""), ("gnu", ""), ("ustar", ""), ("posix", ""), ("pax", "gz"), ("gnu", "zst")])
def test_gnu_tar_every_format(tmp_path, fmt, compress):
    if compress == "zst":
        pytest.importorskip("zstandard")
        if shutil.which("zstd") is None:
            pytest.skip("the zstd program (for GNU tar --zstd) is not installed")
    _read_all_ways(tmp_path, _build(tmp_path, "gnu", fmt, compress), through_pack=compress == "gz")


@needs_bsdtar
@pytest.mark.parametrize(("fmt", "compress"), [("default", ""), ("pax", ""), ("ustar", ""), ("gnutar", ""), ("pax", "gz")])
def test_bsdtar_every_format(tmp_path, fmt, compress):
    _read_all_ways(tmp_path, _build(tmp_path, "bsdtar", fmt, compress), through_pack=fmt == "default")


@needs_bsdtar
def test_bsdtar_pax_header_for_an_extended_attribute_keeps_the_prefix(tmp_path):
    src = tmp_path / "src"
    _source_tree(src, PREFIX_NAMES)
    try:
        os.setxattr(src / PREFIX_NAMES[0], "user.note", b"x")
    except OSError as exc:
        pytest.skip(f"this filesystem takes no user extended attributes: {exc}")
    out = tmp_path / "x.tar"
    subprocess.run([BSDTAR, "-cf", str(out), *PREFIX_NAMES], cwd=src, check=True)
    expected = wds_samples(str(out))
    assert [k for k, _ in expected] == [PREFIX_NAMES[0][:-4]]
    assert parse(out.read_bytes()) == expected


def test_compressed_shards_from_s3_with_read_ahead_and_cache(s3, tmp_path):
    from shardstream import ShardStream
    from shardstream.tools.index import write_index

    bucket, options, client = s3
    local = tmp_path / "a.tar.gz"
    _write_tar(local, _members(9, "s"), "w:gz")
    expected = dict(wds_samples(str(local)))
    client.put_object(Bucket=bucket, Key="wds/a.tar.gz", Body=local.read_bytes())
    manifest, url = write_index(f"s3://{bucket}/wds/*.tar.gz", f"s3://{bucket}/wds", storage_options=options)
    assert manifest.shards[0].path == "a.tar.gz"
    for store in (Store(options=options, read=Read(readahead_bytes=1 << 20)), Store(options=options, cache=Cache(str(tmp_path / "cache"), 1 << 30))):
        stream = ShardStream(
            f"s3://{bucket}/wds", batch_size=2, shuffle=False, decode=False, world=World(2, 3), collate=lambda samples: samples, store=store
        )
        got = {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for b in stream for s in b}
        assert len(got) == 2 and all(expected[k] == f for k, f in got.items())  # rank 2: samples 4-5, mid-shard
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.stat().st_size == local.stat().st_size]


def test_webdataset_tarwriter_tgz_read_from_bare_urls(tmp_path):
    from shardstream import ShardStream

    path = tmp_path / "w.tgz"
    with wds.TarWriter(str(path)) as w:  # webdataset gzips a shard named .tgz
        for i in range(6):
            w.write({"__key__": f"k{i}", "txt": f"t{i}", "cls": i})
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    expected = wds_samples(str(path))
    stream = ShardStream.from_urls(str(path), batch_size=3, shuffle=False, decode=False, world=World(0, 1), collate=lambda samples: samples)
    assert [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for b in stream for s in b] == expected


@needs_gnu_tar
def test_a_large_sparse_member_kept_as_a_buffer_holds_its_expanded_contents(tmp_path):
    from shardstream.format.tar import iter_samples

    path = tmp_path / "src" / "big.bin"
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))  # 1 MiB stored...
        f.truncate(3 << 20)  # ...and a 2 MiB hole after it
    contents = path.read_bytes()
    out = tmp_path / "big.tar"
    subprocess.run([GNU_TAR, "--format=pax", "--sparse", "-cf", str(out), "big.bin"], cwd=tmp_path / "src", check=True)
    data = out.read_bytes()
    reader = io.BytesIO(data)
    samples = list(iter_samples(reader.read, url="big.tar", end=len(data), read_size=8 << 20, keep_buffers={"bin"}))
    assert [k for k, _, _, _ in samples] == ["big"]
    value = samples[0][3]["bin"]
    assert isinstance(value, memoryview) and bytes(value) == contents
