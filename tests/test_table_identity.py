"""A table never loses a row: at open, a table index (``shardstream index``) is checked against
every file's footer (its row groups, its columns and the sha256 of its bytes, at the size the
index recorded), reading the footers alone; a file that changed either way is a ManifestError
naming it and what changed. Indexes written before the footer's sha256 was recorded still load."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardstream.format.parquet as parquet
from shardstream import ShardStream, Store, World
from shardstream.cli.main import main
from shardstream.errors import ManifestError
from shardstream.format.parquet import FOOTERS

PLAIN = {"compression": "none", "use_dictionary": False, "write_statistics": False}  # sizes that depend on the types' widths only


def _file(path, n: int = 50, x=pa.int64(), start: int = 0) -> None:
    table = pa.table({"id": pa.array(np.arange(start, start + n), pa.int64()), "x": pa.array(np.arange(n), x)})
    pq.write_table(table, str(path), row_group_size=n, **PLAIN)


def _indexed(root) -> str:
    root.mkdir()
    _file(root / "a.parquet", start=0)
    _file(root / "b.parquet", start=50)
    assert main(["index", str(root), str(root)]) == 0
    return str(root)


def _ids(url) -> list[int]:
    FOOTERS.clear()  # as a fresh process would
    return [int(i) for b in ShardStream(url, batch_size=10, world=World(0, 1), shuffle=False) for i in b["id"]]


def _edit(root, fn) -> None:
    path = os.path.join(root, "index.json")
    with open(path) as f:
        doc = json.load(f)
    fn(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize("claimed", [40, 60])
def test_an_index_claiming_other_rows_than_the_footer_is_a_manifest_error_either_way(tmp_path, claimed):
    root = _indexed(tmp_path / "t")
    assert _ids(root) == list(range(100))

    def claim(doc):
        doc["files"]["group_rows"][1] = [claimed]
        doc["total_samples"] = 50 + claimed

    _edit(root, claim)
    with pytest.raises(
        ManifestError, match=rf"b\.parquet: its footer says 50 rows in row groups of \[50\], the index says {claimed} in \[{claimed}\]"
    ):
        _ids(root)


def test_a_file_replaced_by_one_of_the_same_size_with_another_dtype_is_a_manifest_error(tmp_path):
    root = _indexed(tmp_path / "t")
    before = os.path.getsize(os.path.join(root, "a.parquet"))
    _file(tmp_path / "t" / "a.parquet", x=pa.float64())  # int64 -> float64, same rows
    assert os.path.getsize(os.path.join(root, "a.parquet")) == before  # the same size: only the footer's bytes tell
    with pytest.raises(
        ManifestError, match=r"a\.parquet: its footer's sha256 is [0-9a-f]{64}, the index recorded [0-9a-f]{64} \(same size, other bytes\)"
    ):
        _ids(root)
    # an index written before the sha256 was recorded: the columns still tell
    _edit(root, lambda doc: doc["files"].pop("footer_sha256"))
    with pytest.raises(ManifestError, match=r"a\.parquet: column 'x' is double in the file, int64 in the index"):
        _ids(root)


def test_an_old_index_without_footer_digests_still_loads_and_a_grown_file_is_named(tmp_path):
    root = _indexed(tmp_path / "t")
    _edit(root, lambda doc: doc["files"].pop("footer_sha256"))
    assert _ids(root) == list(range(100))
    _file(tmp_path / "t" / "b.parquet", n=70, start=50)
    size = os.path.getsize(os.path.join(root, "b.parquet"))
    with pytest.raises(ManifestError, match=rf"b\.parquet: it is {size} bytes, the index says \d+: the file changed since the table was indexed"):
        _ids(root)


def test_the_check_at_open_reads_the_footers_alone(tmp_path, monkeypatch):
    root = tmp_path / "t"
    root.mkdir()
    for i in range(3):
        _file(root / f"{i}.parquet", n=20_000, start=i * 20_000)  # 320 KB each, footers under 1 KB
    assert main(["index", str(root), str(root)]) == 0
    doc = json.loads((root / "index.json").read_text())
    reads: list[tuple[str, int, int]] = []
    real = parquet.read_bytes

    def counted(url, start, end, *args, **kwargs):
        reads.append((url, start, end))
        return real(url, start, end, *args, **kwargs)

    monkeypatch.setattr(parquet, "read_bytes", counted)
    FOOTERS.clear()
    ShardStream(str(root), batch_size=10, world=World(0, 1), shuffle=False)
    sizes, footers = doc["files"]["bytes"], doc["files"]["footer_bytes"]
    assert sorted(reads) == sorted((str(root / p), s - n, s) for p, s, n in zip(doc["files"]["path"], sizes, footers))


def test_an_s3_table_index_is_checked_at_open(s3, tmp_path):
    bucket, options, client = s3
    _file(tmp_path / "a.parquet")
    _file(tmp_path / "b.parquet", x=pa.float64())
    client.upload_file(str(tmp_path / "a.parquet"), bucket, "t/a.parquet")
    url = f"s3://{bucket}/t"
    assert main(["index", url, url, "--endpoint-url", options["endpoint_url"]]) == 0
    FOOTERS.clear()
    assert len(list(ShardStream(url, batch_size=10, world=World(0, 1), store=Store(options=options)))) == 5
    client.upload_file(str(tmp_path / "b.parquet"), bucket, "t/a.parquet")  # replaced: same size, x now float64
    FOOTERS.clear()
    with pytest.raises(ManifestError, match=rf"s3://{bucket}/t/a\.parquet: its footer's sha256 is"):
        ShardStream(url, batch_size=10, world=World(0, 1), store=Store(options=options))
