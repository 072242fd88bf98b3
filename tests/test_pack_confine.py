"""pack reads only what it was given: ``$file`` references and symlinks stay inside the source's
own root (a JSONL file's folder or bucket prefix, a tree's folder) unless ``allow_outside`` /
``--allow-outside`` names another; FIFOs, devices and sockets are never opened; names that are
not UTF-8 are refused in one line; hidden files are counted and said."""

from __future__ import annotations

import json
import os
import threading

import pytest

from shardstream.cli.main import main
from shardstream.errors import SourceError
from shardstream.format.manifest import load_manifest
from shardstream.write.pack import pack


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def secret(tmp_path):
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"TOP SECRET")
    return outside / "secret.txt"


@pytest.mark.parametrize("how", ["absolute", "dotdot", "file_url", "symlink"])
def test_a_file_reference_outside_the_jsonl_folder_is_refused_naming_the_line(tmp_path, secret, how):
    src = tmp_path / "captions"
    src.mkdir()
    (src / "ok.bin").write_bytes(b"fine")
    ref = {"absolute": str(secret), "dotdot": "../private/secret.txt", "file_url": f"file://{secret}", "symlink": "link.bin"}[how]
    if how == "symlink":
        os.symlink(secret, src / "link.bin")
    path = _jsonl(src / "c.jsonl", [{"__key__": "a", "bin": {"$file": "ok.bin"}}, {"__key__": "b", "bin": {"$file": ref}}])
    with pytest.raises(SourceError, match=r"c\.jsonl:2: field 'bin': \$file .* outside the source's root") as info:
        pack(path, str(tmp_path / "out"))
    assert "\n" not in str(info.value) and "--allow-outside" in str(info.value)
    assert not (tmp_path / "out" / "index.json").exists()
    # skipped under on_error="skip": nothing of the secret reaches a shard
    result = pack(path, str(tmp_path / "skip"), on_error="skip")
    assert result.samples == 1 and result.skipped_count == 1 and result.skipped[0]["source"].endswith("c.jsonl:2")
    assert not any(b"TOP SECRET" in p.read_bytes() for p in (tmp_path / "skip").rglob("*.tar"))
    # the user's explicit trust of that folder packs it
    result = pack(path, str(tmp_path / "trusted"), allow_outside=[str(secret.parent)])
    assert result.samples == 2


def test_cli_allow_outside_is_repeatable_and_one_line_without(tmp_path, secret, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "o.bin").write_bytes(b"other")
    src = tmp_path / "c.d"
    src.mkdir()
    path = _jsonl(src / "c.jsonl", [{"__key__": "a", "bin": {"$file": str(secret)}}, {"__key__": "b", "bin": {"$file": str(other / "o.bin")}}])
    assert main(["pack", path, str(tmp_path / "o1"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "c.jsonl:1" in err[0] and "outside the source's root" in err[0]
    argv = ["pack", path, str(tmp_path / "o2"), "--no-progress", "--allow-outside", str(secret.parent), "--allow-outside", str(other)]
    assert main(argv) == 0
    assert load_manifest(str(tmp_path / "o2")).total_samples == 2


def test_a_fifo_a_device_and_a_symlink_out_of_a_tree_are_never_read(tmp_path, secret):
    src = tmp_path / "tree"
    src.mkdir()
    (src / "a.txt").write_text("a")
    os.mkfifo(src / "fifo.bin")  # opened for reading, it would block pack forever
    os.symlink("/dev/zero", src / "zero.bin")  # read, it would end in MemoryError
    os.symlink(secret, src / "leak.txt")
    os.symlink(secret.parent, src / "leakdir")  # a folder that leads out
    inner = src / "sub"
    inner.mkdir()
    (inner / "b.txt").write_text("b")
    os.symlink(inner / "b.txt", src / "inside.txt")  # a symlink that stays inside is fine
    (src / ".hidden.txt").write_text("h")
    (src / ".git").mkdir()
    (src / ".git" / "config.txt").write_text("h")
    done = threading.Event()
    result: dict = {}

    def run():
        try:
            with pytest.raises(SourceError, match=r"fifo\.bin: is a FIFO, not a regular file: not read \(and 3 more problems\)"):
                pack(str(src), str(tmp_path / "o1"))
            result["skip"] = pack(str(src), str(tmp_path / "o2"), on_error="skip")
        except BaseException as exc:  # handed to the test's thread
            result["exc"] = exc
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(30), "pack hung on a FIFO"
    if "exc" in result:
        raise result["exc"]
    got = result["skip"]
    assert got.samples == 3 and got.skipped_count == 4 and got.hidden == 2
    reasons = {os.path.basename(s["source"]): s["error"] for s in got.skipped}
    assert "FIFO" in reasons["fifo.bin"]
    assert "symlink to /dev/zero" in reasons["zero.bin"] and "symlink to" in reasons["leak.txt"]
    assert f"symlink to {secret.parent}" in reasons["leakdir"]


def test_a_jsonl_fifo_reference_is_refused_without_hanging(tmp_path):
    src = tmp_path / "j"
    src.mkdir()
    os.mkfifo(src / "f.bin")
    os.symlink("/dev/zero", src / "z.bin")
    fifo = _jsonl(src / "fifo.jsonl", [{"__key__": "a", "bin": {"$file": "f.bin"}}])
    with pytest.raises(SourceError, match=r"fifo\.jsonl:1 field 'bin': .*f\.bin is a FIFO, not a regular file: not read$"):
        pack(fifo, str(tmp_path / "o"))
    (src / "ok.bin").write_bytes(b"ok")
    records = [{"__key__": "a", "bin": {"$file": "f.bin"}}, {"__key__": "b", "bin": {"$file": "z.bin"}}, {"__key__": "c", "bin": {"$file": "ok.bin"}}]
    path = _jsonl(src / "c.jsonl", records)
    with pytest.raises(SourceError, match=r"c\.jsonl:2: field 'bin': \$file 'z\.bin' \(is a symlink to /dev/zero\) is outside"):
        pack(path, str(tmp_path / "o1"))
    # trusted /dev: the symlink may lead there, yet a device is still never read
    result = pack(path, str(tmp_path / "o2"), on_error="skip", allow_outside=["/dev"])
    assert result.samples == 1 and result.skipped_count == 2 and all("device" in s["error"] or "FIFO" in s["error"] for s in result.skipped)


def test_a_name_that_is_not_utf8_is_refused_in_one_line_and_hidden_files_are_said(tmp_path, capsys):
    src = tmp_path / "tree"
    src.mkdir()
    (src / "a.txt").write_text("a")
    with open(os.path.join(os.fsencode(src), b"caf\xe9.txt"), "wb") as f:
        f.write(b"latin-1 name")
    (src / ".DS_Store").write_bytes(b"x")
    assert main(["pack", str(src), str(tmp_path / "o1"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"shardstream pack: error: {src}/caf\\xe9.txt: file name is not UTF-8 (a key must be): rename it"]
    assert main(["pack", str(src), str(tmp_path / "o2"), "--no-progress", "--on-error", "skip"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 bad samples" in out and "caf\\xe9.txt" in out
    assert "left out 1 hidden files" in out


def test_an_s3_jsonl_reads_only_its_own_prefix(s3, tmp_path):
    bucket, options, client = s3
    client.put_object(Bucket=bucket, Key="captions/img/a.bin", Body=b"mine")
    client.put_object(Bucket=bucket, Key="private/secret.txt", Body=b"TOP SECRET")
    records = [
        {"__key__": "a", "bin": {"$file": "img/a.bin"}},
        {"__key__": "b", "bin": {"$file": f"s3://{bucket}/private/secret.txt"}},
        {"__key__": "c", "bin": {"$file": "../private/secret.txt"}},
        {"__key__": "d", "bin": {"$file": "s3://otherbkt/private/secret.txt"}},
        {"__key__": "e", "bin": {"$file": "/etc/passwd"}},
    ]
    client.put_object(Bucket=bucket, Key="captions/c.jsonl", Body="".join(json.dumps(r) + "\n" for r in records).encode())
    src = f"s3://{bucket}/captions/c.jsonl"
    result = pack(src, str(tmp_path / "o"), storage_options=options, on_error="skip")
    assert result.samples == 1
    assert sorted(s["source"].rsplit(":", 1)[1] for s in result.skipped) == ["2", "3", "4", "5"]
    assert all("outside the source's root" in s["error"] for s in result.skipped)
    with pytest.raises(SourceError, match=r"c\.jsonl:2: .*outside the source's root s3://"):
        pack(src, str(tmp_path / "o2"), storage_options=options)
    trusted = pack(src, str(tmp_path / "o3"), storage_options=options, on_error="skip", allow_outside=[f"s3://{bucket}/private"])
    assert trusted.samples == 3
