"""Nothing half-published: an interrupted pack's shards are never taken for a dataset (``ls`` and
``index`` say "run pack again to complete it"), and a pack that fails removes the destination it
made (a local folder, an S3 prefix that held nothing), never one that was there before."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import make_samples

from shardstream import ShardStream, World
from shardstream.cli.main import main
from shardstream.errors import ManifestError, SourceError
from shardstream.tools.index import write_index
from shardstream.write.pack import pack
from shardstream.write.writer import PACK_MARKER, ShardWriter


def _one_line_refusal(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "interrupted pack" in err and "run pack again to complete it" in err, err
    return err


def test_a_killed_pack_is_refused_by_ls_and_index_and_completed_by_pack(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(1500):
        (src / f"{i:05d}.bin").write_bytes(rng.bytes(20_000))
    dest = tmp_path / "dest"
    cmd = [sys.executable, "-m", "shardstream", "pack", str(src), str(dest), "--max-count", "20", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(dest.glob("shard-*.tar"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "pack finished before it could be killed"
    proc.send_signal(signal.SIGKILL)  # nothing of shardstream runs after this: only the marker tells
    proc.communicate(timeout=60)
    assert (dest / PACK_MARKER).exists() and not (dest / "index.json").exists()
    # ls (and show, verify) advised `shardstream index` here; index wrote a manifest of the shards so
    # far, which trained as if it were the dataset.
    for argv in (["ls", str(dest)], ["show", str(dest)], ["verify", str(dest)]):
        assert main(argv) == 1
        assert "shardstream index" not in _one_line_refusal(capsys)
    for argv in (["index", f"{dest}/*.tar", str(dest)], ["index", str(dest), str(dest)], ["index", f"{dest}/*.tar", str(tmp_path / "other")]):
        assert main(argv) == 1, argv
        _one_line_refusal(capsys)
    assert not (dest / "index.json").exists() and not (tmp_path / "other" / "index.json").exists()
    with pytest.raises(ManifestError, match="run pack again to complete it"):
        write_index(str(dest / "shard-000000.tar"), str(tmp_path / "other"))
    # The same pack again completes it (no --overwrite) and leaves no marker.
    assert main(["pack", str(src), str(dest), "--max-count", "20", "--no-progress"]) == 0
    capsys.readouterr()
    assert not (dest / PACK_MARKER).exists()
    ds = ShardStream(str(dest), batch_size=20, shuffle=False, world=World(0, 1))
    assert sum(len(b["__key__"]) for b in ds) == 1500


def test_temporary_files_of_an_older_interrupted_pack_are_refused_too(tmp_path, capsys):
    # A pack that left no marker (written before there was one) still left a shard's temporary file.
    with ShardWriter(str(tmp_path / "d"), max_count=10) as w:
        for s in make_samples(30):
            w.write(s)
    (tmp_path / "d" / "index.json").unlink()
    (tmp_path / "d" / ".shard-000003.tar.partial-0badc0de").write_bytes(b"x" * 100)
    assert main(["index", f"{tmp_path}/d/*.tar", str(tmp_path / "d")]) == 1
    assert ".partial-0badc0de" in _one_line_refusal(capsys)


def _fn(i: int) -> dict:
    if i == 45:
        raise ValueError("broken on purpose")
    return {"__key__": f"k{i:04d}", "txt": f"sample {i}"}


def test_a_failed_pack_removes_the_destination_it_made_and_no_other(tmp_path, capsys):
    src = tmp_path / "d.jsonl"
    lines = [f'{{"__key__": "k{i:03d}", "txt": "sample {i}"}}' for i in range(60)]
    lines[45] = '{"__key__": "bad", "bin": {"$file": "gone.bin"}}'
    src.write_text("\n".join(lines) + "\n")
    # A destination the pack made: gone, folder and all, after 4 of its shards were published.
    assert main(["pack", str(src), str(tmp_path / "new" / "ds"), "--max-count", "10", "--no-progress"]) == 1
    assert "gone.bin" in capsys.readouterr().err
    assert not (tmp_path / "new" / "ds").exists() and (tmp_path / "new").exists()  # its parent was not its own
    with pytest.raises(SourceError):  # the same under shard tasks (an executor): running tasks end first
        with ThreadPoolExecutor(2) as executor:
            pack(_fn, range(100), str(tmp_path / "tasks"), max_count=10, executor=executor)
    assert not (tmp_path / "tasks").exists()
    with pytest.raises(SourceError):  # and with spread prefix folders
        pack(str(src), str(tmp_path / "spread"), max_count=10, prefixes=3)
    assert not (tmp_path / "spread").exists()
    # A folder that was there before stays, with the shards marked unfinished.
    (tmp_path / "mine").mkdir()
    assert main(["pack", str(src), str(tmp_path / "mine"), "--max-count", "10", "--no-progress"]) == 1
    capsys.readouterr()
    assert (tmp_path / "mine" / PACK_MARKER).exists() and (tmp_path / "mine" / "shard-000000.tar").exists()
    assert main(["ls", str(tmp_path / "mine")]) == 1
    _one_line_refusal(capsys)
    # A failure before any shard leaves an existing folder as it was.
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError):
        pack(str(src), str(tmp_path / "empty"), max_count=100)
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_failed_pack_on_s3_removes_its_objects_and_keeps_others(s3, tmp_path):
    bucket, options, client = s3
    src = tmp_path / "d.jsonl"
    lines = [f'{{"__key__": "k{i:03d}", "txt": "sample {i}"}}' for i in range(30)]
    lines[25] = '{"__key__": "bad", "bin": {"$file": "gone.bin"}}'
    src.write_text("\n".join(lines) + "\n")

    def keys(prefix: str) -> list[str]:
        return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))

    with pytest.raises(SourceError):
        pack(str(src), f"s3://{bucket}/new", max_count=10, storage_options=options)
    assert keys("new/") == []
    client.put_object(Bucket=bucket, Key="held/notes.txt", Body=b"someone else's")
    with pytest.raises(SourceError):
        pack(str(src), f"s3://{bucket}/held", max_count=10, storage_options=options, overwrite=True)
    assert keys("held/") == [
        "held/.shardstream-packing",
        "held/notes.txt",
        "held/shard-000000.tar",
        "held/shard-000000.tar.idx",
        "held/shard-000000.tar.members",
        "held/shard-000001.tar",
        "held/shard-000001.tar.idx",
        "held/shard-000001.tar.members",
    ]
    assert main(["index", f"s3://{bucket}/held/*.tar", f"s3://{bucket}/held", "--endpoint-url", options["endpoint_url"]]) == 1
    lines[25] = '{"__key__": "k025", "txt": "fixed"}'
    src.write_text("\n".join(lines) + "\n")
    assert pack(str(src), f"s3://{bucket}/held", max_count=10, storage_options=options, overwrite=True).samples == 30
    assert ".shardstream-packing" not in " ".join(keys("held/"))
