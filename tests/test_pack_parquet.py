"""Packing Parquet tables (pyarrow-written, real files): columns become fields by type, the shards
read back in shardstream and in plain webdataset, --columns/--key select, the output is
byte-identical for any --workers and under an executor, and a bad table is one clear line."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

import shardstream
from shardstream import World, load_manifest
from shardstream.errors import ConfigError, SourceError
from shardstream.write.pack import pack

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 23


def _image(i: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 6, 3), i * 10 % 256, np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def write_table(path, n: int = N, row_group_size: int = 5, start: int = 0) -> list[dict]:
    """A table with int, float, bool, string, binary-image, list, fixed-size list, struct and HF image
    columns; returns its rows as Python values."""
    rows = []
    for i in range(start, start + n):
        rows.append(
            {
                "id": f"item{i:04d}",
                "label": i % 5,
                "score": i / 4,
                "flag": i % 2 == 0,
                "caption": f"picture number {i}" if i % 7 else None,  # some nulls
                "image": _image(i, "JPEG" if i % 3 else "PNG"),
                "tags": [f"t{j}" for j in range(i % 4)],
                "emb": [float(i), float(i) + 0.5, -1.0],
                "meta": {"w": 6, "h": 8, "src": f"cam{i % 2}"},
                "photo": {"bytes": _image(i, "WEBP"), "path": f"p{i}.webp"},
            }
        )
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("label", pa.int64()),
            ("score", pa.float32()),
            ("flag", pa.bool_()),
            ("caption", pa.string()),
            ("image", pa.binary()),
            ("tags", pa.list_(pa.string())),
            ("emb", pa.list_(pa.float32(), 3)),
            ("meta", pa.struct([("w", pa.int32()), ("h", pa.int32()), ("src", pa.string())])),
            ("photo", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return rows


def shard_paths(root) -> list[str]:
    manifest = load_manifest(str(root))
    return [os.path.join(str(root), s.path) for s in manifest.shards]


def test_columns_become_fields_read_back_by_shardstream_and_webdataset(tmp_path):
    rows = write_table(tmp_path / "t.parquet")
    result = pack(str(tmp_path / "t.parquet"), str(tmp_path / "out"), max_count=10, key="id")
    assert result.samples == N and result.shards == 3
    exts = result.manifest.extensions
    assert exts["label.cls"] == exts["score.json"] == exts["tags.json"] == exts["emb.npy"] == exts["meta.json"] == N
    assert exts["caption.txt"] == sum(1 for r in rows if r["caption"] is not None)  # a null leaves the field out
    assert exts["image.jpg"] + exts["image.png"] == N and exts["photo.webp"] == N
    by_key = {r["id"]: r for r in rows}

    # plain webdataset reads the shards, with its own decoders
    got = {s["__key__"]: s for s in wds.WebDataset(shard_paths(tmp_path / "out"), shardshuffle=False, empty_check=False).decode("rgb8")}
    assert sorted(got) == sorted(by_key)
    for key, s in got.items():
        r = by_key[key]
        assert int(s["label.cls"]) == r["label"]
        assert s["score.json"] == pytest.approx(r["score"]) and s["flag.json"] is r["flag"]
        assert s.get("caption.txt") == r["caption"]
        assert s["tags.json"] == r["tags"] and s["meta.json"] == r["meta"]
        assert s["emb.npy"].dtype == np.float32 and s["emb.npy"].tolist() == r["emb"]
        image = s.get("image.jpg", s.get("image.png"))
        assert image.shape == (8, 6, 3)
        assert s["photo.webp"].shape == (8, 6, 3)
        raw = next(v for k, v in _raw(tmp_path / "out", key).items() if k.startswith("image."))
        assert raw == r["image"]  # image bytes stored as they were, not re-encoded

    # shardstream reads them, decoded by extension
    ds = shardstream.ShardStream(str(tmp_path / "out"), batch_size=1, shuffle=False, world=World(0, 1), mode="pad")
    seen = {}
    for batch in ds:
        seen[batch["__key__"][0]] = batch
    assert sorted(seen) == sorted(by_key)
    b = seen["item0004"]
    assert b["label.cls"].tolist() == [4] and b["emb.npy"].shape == (1, 3) and b["meta.json"] == [by_key["item0004"]["meta"]]
    assert b["photo.webp"].shape == (1, 3, 8, 6)  # CHW image tensor


def _raw(root, key: str) -> dict[str, bytes]:
    for s in wds.WebDataset(shard_paths(root), shardshuffle=False, empty_check=False):
        if s["__key__"] == key:
            return s
    raise KeyError(key)


def test_default_keys_name_file_and_row_across_a_directory(tmp_path):
    (tmp_path / "tables" / "b").mkdir(parents=True)
    write_table(tmp_path / "tables" / "a.parquet", n=7, row_group_size=3)
    write_table(tmp_path / "tables" / "b" / "c.parquet", n=4, row_group_size=3, start=7)
    result = pack(str(tmp_path / "tables"), str(tmp_path / "out"))  # a folder of .parquet files: detected
    assert result.samples == 11
    keys = [s["__key__"] for s in wds.WebDataset(shard_paths(tmp_path / "out"), shardshuffle=False, empty_check=False)]
    assert keys == [f"a/{i:09d}" for i in range(7)] + [f"b/c/{i:09d}" for i in range(4)]


def test_cli_columns_and_key_select(tmp_path):
    write_table(tmp_path / "t.parquet")
    cmd = [sys.executable, "-m", "shardstream", "pack", str(tmp_path / "t.parquet"), str(tmp_path / "out"), "--no-progress"]
    proc = subprocess.run([*cmd, "--columns", "caption,label", "--key", "id"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "packed 23 samples" in proc.stdout
    samples = list(wds.WebDataset(shard_paths(tmp_path / "out"), shardshuffle=False, empty_check=False))
    assert {k for s in samples for k in s if not k.startswith("__")} == {"caption.txt", "label.cls"}
    assert samples[3]["__key__"] == "item0003" and samples[3]["label.cls"] == b"3"


def test_same_bytes_for_any_workers_and_under_an_executor(tmp_path):
    write_table(tmp_path / "t.parquet", n=40, row_group_size=6)
    pack(str(tmp_path / "t.parquet"), str(tmp_path / "one"), max_count=9, workers=1)
    pack(str(tmp_path / "t.parquet"), str(tmp_path / "two"), max_count=9, workers=2)
    pack(str(tmp_path / "t.parquet"), str(tmp_path / "three"), max_count=9, workers=3)
    pack(str(tmp_path / "t.parquet"), str(tmp_path / "default"), max_count=9)
    with ProcessPoolExecutor(2) as executor:
        pack(str(tmp_path / "t.parquet"), str(tmp_path / "tasks"), max_count=9, executor=executor)
    names = sorted(os.listdir(tmp_path / "one"))
    assert len([n for n in names if n.endswith(".tar")]) == 5
    shards = [(s.path, s.samples, s.bytes, s.sha256) for s in load_manifest(str(tmp_path / "one")).shards]
    for other in ("two", "three", "default", "tasks"):
        assert sorted(os.listdir(tmp_path / other)) == names
        for name in names:
            if name != "index.json":  # (the manifest records when it was written)
                assert (tmp_path / "one" / name).read_bytes() == (tmp_path / other / name).read_bytes(), (other, name)
        assert [(s.path, s.samples, s.bytes, s.sha256) for s in load_manifest(str(tmp_path / other)).shards] == shards


def test_a_corrupt_table_is_one_clear_line(tmp_path):
    write_table(tmp_path / "t.parquet")
    data = (tmp_path / "t.parquet").read_bytes()
    (tmp_path / "bad.parquet").write_bytes(data[: len(data) // 2])  # cut short: no footer
    proc = subprocess.run(
        [sys.executable, "-m", "shardstream", "pack", str(tmp_path / "bad.parquet"), str(tmp_path / "out"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.parquet" in lines[0] and "not a readable Parquet file" in lines[0], proc.stderr
    assert not (tmp_path / "out" / "index.json").exists()


def test_bad_selections_are_clear(tmp_path):
    write_table(tmp_path / "t.parquet")
    with pytest.raises(SourceError, match="no column 'nope'"):
        pack(str(tmp_path / "t.parquet"), str(tmp_path / "o1"), columns=["label", "nope"])
    with pytest.raises(SourceError, match="key column 'score'"):
        pack(str(tmp_path / "t.parquet"), str(tmp_path / "o2"), key="score")
    with pytest.raises(ConfigError, match="--shuffle"):
        pack(str(tmp_path / "t.parquet"), str(tmp_path / "o3"), shuffle=True)
    pq.write_table(pa.table({"id": ["a", "a"], "x": [1, 2]}), str(tmp_path / "dup.parquet"))
    with pytest.raises(SourceError, match="duplicate key"):
        pack(str(tmp_path / "dup.parquet"), str(tmp_path / "o4"), key="id")


def test_without_pyarrow_one_line_says_what_to_install(tmp_path, monkeypatch):
    write_table(tmp_path / "t.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'shardstream\[tables\]'"):
        pack(str(tmp_path / "t.parquet"), str(tmp_path / "out"))


def test_manifest_counts_and_meta(tmp_path):
    write_table(tmp_path / "t.parquet")
    pack(str(tmp_path / "t.parquet"), str(tmp_path / "out"), max_count=10, columns=["meta", "label"])
    manifest = load_manifest(str(tmp_path / "out"))
    assert manifest.total_samples == N
    sample = next(iter(wds.WebDataset(shard_paths(tmp_path / "out"), shardshuffle=False, empty_check=False)))
    assert json.loads(sample["meta.json"]) == {"h": 8, "src": "cam0", "w": 6}


def test_tables_on_s3_by_glob(tmp_path, s3):
    bucket, options, client = s3
    rows = write_table(tmp_path / "a.parquet", n=6, row_group_size=4)
    rows += write_table(tmp_path / "b.parquet", n=5, row_group_size=4, start=6)
    for name in ("a.parquet", "b.parquet"):
        client.upload_file(str(tmp_path / name), bucket, f"tables/{name}")
    client.put_object(Bucket=bucket, Key="tables/README.txt", Body=b"not a table")
    result = pack(f"s3://{bucket}/tables/*.parquet", str(tmp_path / "out"), key="id", storage_options=options, workers=2)
    assert result.samples == 11
    keys = [s["__key__"] for s in wds.WebDataset(shard_paths(tmp_path / "out"), shardshuffle=False, empty_check=False)]
    assert keys == [r["id"] for r in rows]


def test_dask_packs_a_table_like_one_process(tmp_path):
    distributed = pytest.importorskip("distributed")
    from shardstream.cli.main import main

    write_table(tmp_path / "t.parquet", n=30, row_group_size=7)
    common = ["--max-count", "8", "--key", "id", "--no-progress"]
    assert main(["pack", str(tmp_path / "t.parquet"), str(tmp_path / "one"), *common]) == 0
    with (
        distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address="127.0.0.1:0", host="127.0.0.1") as cluster,
        distributed.Client(cluster),
    ):
        assert main(["pack", str(tmp_path / "t.parquet"), str(tmp_path / "dask"), "--dask", cluster.scheduler_address, *common]) == 0
    names = sorted(n for n in os.listdir(tmp_path / "one") if n != "index.json")
    assert len(names) == 12  # 4 shards and their offset and member sidecars
    assert sorted(n for n in os.listdir(tmp_path / "dask") if n != "index.json") == names
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "dask" / name).read_bytes()
