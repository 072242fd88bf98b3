"""Parquet tables as sources (format/parquet.py, pipeline/table.py), with real Parquet files
written by pyarrow: every row once per epoch across ranks and real DataLoader workers, per-row
samples and columnar batches, only the projected columns' bytes read (local disk and a moto S3
server), exact and elastic resume, a mix with a tar dataset, struct and Hugging Face image
columns, a written table manifest, and bad files as one typed error."""

from __future__ import annotations

import io
import json
import os
import sys
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import write_dataset
from PIL import Image

from shardstream import Batched, ShardStream, Shuffle, Source, Store, World, make_loader
from shardstream.errors import ConfigError, ManifestError, ShardFormatError
from shardstream.format.parquet import FOOTERS, Table, TableManifest, index_table

ROWS = (300, 260, 240)  # rows per file; 800 in all
GROUP = 64  # rows per row group


def same(row):
    return row  # a per-sample transform: the per-row path (module level: workers may be started by pickling)


def key_and_source(row):
    return {"__key__": row["__key__"], "__source__": row["__source__"]}  # what a tar sample and a row share


def table_of(first: int, n: int) -> pa.Table:
    ids = np.arange(first, first + n, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "x": (ids * 0.5).astype(np.float32),
            "wide": np.random.default_rng(first).random(n),  # a column no projected read should touch
            "s": [f"row {i}" for i in ids],
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 4).astype(np.float32)), 4),
            "st": pa.array([{"a": int(i % 7), "b": f"b{i}"} for i in ids]),
            "flag": ids % 3 == 0,
        }
    )


def write_table(root, rows=ROWS, group=GROUP) -> str:
    root.mkdir(parents=True, exist_ok=True)
    first = 0
    for f, n in enumerate(rows):
        pq.write_table(table_of(first, n), str(root / f"part-{f:02d}.parquet"), row_group_size=group)
        first += n
    return str(root)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return write_table(tmp_path_factory.mktemp("tables") / "t")


def ids_of(batches) -> list[int]:
    return [int(i) for b in batches for i in b["id"]]


def test_manifest_from_footers(table):
    m = index_table(table)
    assert isinstance(m, TableManifest)
    assert m.files == ["part-00.parquet", "part-01.parquet", "part-02.parquet"]
    expected = [pq.ParquetFile(f"{table}/{f}").metadata for f in m.files]
    assert m.group_rows == [[md.row_group(i).num_rows for i in range(md.num_row_groups)] for md in expected]
    assert m.total_samples == sum(ROWS) and len(m.counts) == sum(md.num_row_groups for md in expected)
    assert [n for n, _ in m.columns] == ["id", "x", "wide", "s", "emb", "st", "flag"]


@pytest.mark.parametrize("columnar", [True, False])
def test_every_row_once_across_ranks_and_workers(table, columnar):
    seen: list[int] = []
    lengths = set()
    for rank in range(2):
        ds = ShardStream(table, batch_size=16, world=World(rank, 2), seed=1, shuffle=Shuffle(100), transform=None if columnar else same)
        assert ds.columnar is columnar
        batches = list(make_loader(ds, num_workers=2, pin_memory=False, log_interval=None))
        assert len(batches) == len(ds)
        lengths.add(len(batches))
        seen += ids_of(batches)
    plan = ds.plan()
    assert len(lengths) == 1  # equal batches per rank
    assert len(seen) == len(set(seen)) == sum(ROWS) - plan.dropped
    assert set(seen) <= set(range(sum(ROWS)))


def test_columnar_batches_match_pyarrow(table):
    ds = ShardStream(table, batch_size=50, world=World(0, 1), shuffle=False, mode="pad")
    batches = list(ds)
    expected = pq.read_table(table)  # the files in name order: the manifest's order, unshuffled
    got = {name: [] for name in expected.column_names}
    for b in batches:
        for name in got:
            got[name].append(b[name])
    n = expected.num_rows
    assert torch.cat(got["id"])[:n].tolist() == expected["id"].to_pylist()
    assert batches[0]["id"].dtype == torch.int64 and batches[0]["x"].dtype == torch.float32 and batches[0]["wide"].dtype == torch.float64
    assert torch.equal(torch.cat(got["x"])[:n], torch.from_numpy(expected["x"].to_numpy()))
    assert torch.equal(torch.cat(got["wide"])[:n], torch.from_numpy(expected["wide"].to_numpy()))
    emb = torch.cat(got["emb"])[:n]
    assert emb.shape == (n, 4) and emb.dtype == torch.float32
    assert emb.tolist() == [[float(i)] * 4 for i in expected["id"].to_pylist()]
    assert [s for part in got["s"] for s in part][:n] == expected["s"].to_pylist()
    assert [s for part in got["st"] for s in part][:n] == expected["st"].to_pylist()  # a struct: dicts, as Arrow gives them
    assert torch.cat(got["flag"])[:n].tolist() == expected["flag"].to_pylist() and batches[0]["flag"].dtype == torch.bool


def test_from_urls_takes_parquet_files(table):
    ds = ShardStream.from_urls(f"{table}/part-0[01].parquet", batch_size=20, world=World(0, 1), shuffle=False)
    assert isinstance(ds.manifest, TableManifest) and len(ds.manifest.files) == 2
    assert sorted(ids_of(ds)) == list(range(560))


def test_per_row_samples(table):
    ds = ShardStream(Table(table, columns=["id", "s", "st"]), batch_size=8, world=World(0, 1), shuffle=False, transform=same)
    batch = next(iter(ds))
    assert batch["__key__"][:2] == ["part-00.parquet:0", "part-00.parquet:1"]
    assert batch["__url__"][0].endswith("part-00.parquet")
    assert batch["s"][:2] == ["row 0", "row 1"] and batch["st"][1] == {"a": 1, "b": "b1"}
    assert set(batch) == {"__key__", "__url__", "id", "s", "st"}


def projected_bytes(root: str, columns: list[str], file: str | None = None, group: int | None = None) -> int:
    """What the projected columns' chunks take in the files (or one row group), by pyarrow's own footer."""
    total = 0
    for f in [file] if file is not None else sorted(os.listdir(root)):
        md = pq.ParquetFile(f"{root}/{f}").metadata
        for g in [group] if group is not None else range(md.num_row_groups):
            for c in range(md.num_columns):
                chunk = md.row_group(g).column(c)
                if chunk.path_in_schema.split(".")[0] in columns:
                    total += chunk.total_compressed_size
    return total


@pytest.mark.parametrize("columnar", [True, False])
def test_projected_read_moves_only_projected_bytes(table, columnar):
    columns = ["id", "x"]
    ds = ShardStream(Table(table, columns=columns), batch_size=16, world=World(0, 1), transform=None if columnar else same)
    batches = list(ds)
    assert set(batches[0]) == ({"id", "x"} if columnar else {"id", "x", "__key__", "__url__"})
    assert len(set(ids_of(batches))) == sum(ROWS)  # 800 rows = 50 batches: none dropped
    stats = ds.stats()
    # footers were read (and kept) when the table was indexed: the pass reads column chunks only
    assert stats["bytes_read"] == projected_bytes(table, columns)
    assert stats["bytes_read"] < projected_bytes(table, ["id", "x", "wide", "s", "emb", "st", "flag"]) / 3
    assert stats["ranges_opened"] == len(ds.manifest.counts)  # id and x are adjacent: one read per row group


def test_s3_table_prefix(s3, tmp_path):
    bucket, options, client = s3
    root = write_table(tmp_path / "t")
    for f in sorted(os.listdir(root)):
        client.upload_file(f"{root}/{f}", bucket, f"table/{f}")
    url = f"s3://{bucket}/table/"
    FOOTERS.clear()  # footers read again from S3
    ds = ShardStream(Table(url, columns=["id", "x"]), batch_size=16, world=World(0, 1), store=Store(options=options))
    assert isinstance(ds.manifest, TableManifest) and ds.manifest.base_url == f"s3://{bucket}/table"
    m, plan = ds.manifest, ds.pass_plan(num_workers=2)
    summary = ds.plan().summary()
    assert f"{sum(ROWS)} samples" in summary and "sidecar" not in summary  # no tar sidecars for a table: footers
    batches = list(make_loader(ds, num_workers=2, workers="processes", pin_memory=False, log_interval=None))
    assert sorted(ids_of(batches)) == list(range(sum(ROWS)))
    assert torch.equal(batches[0]["x"], batches[0]["id"].float() * 0.5)
    # Each worker process reads the projected chunks of the row groups its ranges fall in (a row group
    # split between two workers is read by both), and the footers of their files once.
    chunks = {g: projected_bytes(root, ["id", "x"], file=m.files[int(m.group_file[g])], group=int(m.group_index[g])) for g in range(len(m.counts))}
    expected = requests = 0
    for w in range(2):
        groups = {r.shard for window in plan.worker(0, w).windows for s in window.sources for r in (*s.back, *s.ranges)}
        files = {int(m.group_file[g]) for g in groups}
        expected += sum(chunks[g] for g in groups) + sum(int(m.footer_sizes[f]) for f in files)
        requests += len(groups) + len(files)
    assert ds.stats()["bytes_read"] == expected
    assert ds.stats()["requests"] == requests  # one GET per row group (id and x are adjacent) and per footer
    # the plan's estimate is those GETs: per (worker, row group) one per projected run, per (worker, file) a footer
    estimate = ds.plan(num_workers=2).summary()
    assert f"requests: {requests:,} GETs per epoch" in estimate and "footers" in estimate, estimate
    apart = ShardStream(Table(url, columns=["id", "s"]), batch_size=16, world=World(0, 1), store=Store(options=options))  # x, wide between
    groups = len(apart.manifest.counts)
    line = apart.plan(num_workers=1).summary()
    assert f"requests: {2 * groups + 3:,} GETs per epoch ({2 * groups} ranges" in line and "at most 3 footers" in line, line
    # a plain prefix URL is a table too (no index.json there)
    plain = ShardStream(url, batch_size=16, world=World(0, 1), store=Store(options=options))
    assert isinstance(plain.manifest, TableManifest) and plain.manifest.projection is None


def run(loader, stop=None):
    got = []
    for batch in loader:
        got.append([int(i) for i in batch["id"]])
        if stop is not None and len(got) == stop:
            return got, json.loads(json.dumps(loader.state_dict()))
    return got, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("columnar,workers", [(True, 0), (True, 2), (False, 2)])
def test_exact_resume_mid_epoch(table, columnar, workers):
    def fresh():
        ds = ShardStream(table, batch_size=12, world=World(0, 1), seed=4, shuffle=Shuffle(50), transform=None if columnar else same)
        loader = make_loader(ds, num_workers=workers, pin_memory=False, log_interval=None)
        loader.set_epoch(1)
        return loader

    reference, _ = run(fresh())
    for stop in (5, len(reference) - 3):
        _, state = run(fresh(), stop)
        resumed = fresh()
        resumed.load_state_dict(state)
        rest, _ = run(resumed)
        assert rest == reference[stop:], f"stopped after {stop}"


def test_elastic_resume_every_row_once(table):
    def stream(rank, world):
        return ShardStream(table, batch_size=8, world=World(rank, world), seed=2, shuffle=Shuffle(40))

    first = make_loader(stream(0, 2), num_workers=2, pin_memory=False, log_interval=None)
    seen, state = run(first, stop=10)
    consumed = [i for b in seen for i in b]
    others = [make_loader(stream(1, 2), num_workers=2, pin_memory=False, log_interval=None)]
    for loader in others:  # rank 1 received the same number of batches
        got = []
        for batch in loader:
            got.append([int(i) for i in batch["id"]])
            if len(got) == 10:
                break
        consumed += [i for b in got for i in b]
    rest = []
    for rank in range(3):  # three ranks now, one worker each
        loader = make_loader(stream(rank, 3), num_workers=1, pin_memory=False, log_interval=None)
        loader.load_state_dict(state)
        rest += [i for b in run(loader)[0] for i in b]
    everything = consumed + rest
    assert len(everything) == len(set(everything))  # no row twice
    assert sum(ROWS) - len(everything) < 3 * 8  # drop mode: less than one batch per rank left out


def test_mix_with_tar_dataset(table, tmp_path):
    tar = write_dataset(tmp_path / "tar", n=90, max_count=20)
    sources = [Source(Table(table, columns=["id", "s"]), weight=0.5, name="table"), Source(tar, weight=0.5, name="tar")]
    ds = ShardStream(sources, batch_size=10, world=World(0, 1), seed=3, shuffle=Shuffle(30), decode=False, transform=key_and_source)
    assert not ds.columnar
    batches = list(make_loader(ds, num_workers=2, pin_memory=False, log_interval=None))
    tags = Counter(t for b in batches for t in b["__source__"])
    plan = ds.plan()
    assert dict(tags) == {s.name: s.used for s in plan.shares()}
    table_keys = [k for b in batches for k, t in zip(b["__key__"], b["__source__"]) if t == "table"]
    assert len(table_keys) == len(set(table_keys)) and all(".parquet:" in k for k in table_keys)


def test_batched_transform_gets_arrow_tables(table):
    def transform(batch):
        assert isinstance(batch, pa.Table) and batch.num_rows == 20
        return {"y": torch.from_numpy(batch["x"].to_numpy()) * 2, "n": batch.num_rows}

    ds = ShardStream(Table(table, columns=["x"]), batch_size=20, world=World(0, 1), transform=Batched(transform))
    out = list(ds)
    assert len(out) == sum(ROWS) // 20 and out[0]["n"] == 20
    with pytest.raises(ConfigError, match=r"Batched\(fn\) takes whole columnar batches"):
        ShardStream(Table(table), batch_size=20, world=World(0, 1), transform=Batched(transform), decode={"x": float})


def test_hf_image_column(tmp_path):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (6, 5, 3), dtype=np.uint8) for _ in range(12)]
    encoded = []
    for arr in images:
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        encoded.append({"bytes": buf.getvalue(), "path": None})
    root = tmp_path / "hf"
    root.mkdir()
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # as datasets.Image() writes it
    table = pa.table({"image": pa.array(encoded, type=image), "label": list(range(12))})
    pq.write_table(table, str(root / "train-00000-of-00001.parquet"), row_group_size=5)
    for transform in (None, same):
        ds = ShardStream(str(root), batch_size=4, world=World(0, 1), shuffle=False, transform=transform)
        batches = list(ds)
        got = torch.cat([b["image"] for b in batches])
        assert got.shape == (12, 3, 6, 5) and got.dtype == torch.uint8
        assert [torch.equal(got[i], torch.from_numpy(images[i]).permute(2, 0, 1)) for i in range(12)] == [True] * 12
    raw = ShardStream(str(root), batch_size=4, world=World(0, 1), shuffle=False, decode=False)
    assert next(iter(raw))["image"][0]["bytes"] == encoded[0]["bytes"]


def test_written_table_manifest(table, tmp_path, capsys):
    from shardstream.cli.main import main

    copy = write_table(tmp_path / "t")
    assert main(["index", copy, copy]) == 0
    assert "indexed a Parquet table: 3 files, 14 row groups, 800 rows" in capsys.readouterr().out
    for tool in ("show", "verify"):  # tar tools say what a table is, not that its bytes are a corrupt tar
        assert main([tool, copy]) != 0
        assert "is a Parquet table: shardstream " + tool + " works on tar datasets" in capsys.readouterr().err
    doc = json.loads((tmp_path / "t" / "index.json").read_text())
    assert doc["kind"] == "parquet" and doc["files"]["path"][0] == "part-00.parquet"
    FOOTERS.clear()
    ds = ShardStream(Table(copy, columns=["id"]), batch_size=16, world=World(0, 1))
    assert isinstance(ds.manifest, TableManifest) and ds.manifest.projection == ("id",)
    assert sorted(ids_of(ds)) == list(range(sum(ROWS)))
    # a file rewritten with other row counts since it was indexed: a typed error naming it, at open
    pq.write_table(table_of(0, 300), str(tmp_path / "t" / "part-00.parquet"), row_group_size=100)
    FOOTERS.clear()
    with pytest.raises(ManifestError, match="part-00.parquet.*changed since the table was indexed"):
        ShardStream(copy, batch_size=16, world=World(0, 1), shuffle=False)


def test_corrupt_and_truncated_footers(tmp_path):
    root = write_table(tmp_path / "t", rows=(100,))
    path = tmp_path / "t" / "part-00.parquet"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(ShardFormatError, match=r"part-00\.parquet at byte \d+: not a Parquet file"):
        ShardStream(root, batch_size=4)
    path.write_bytes(data[:-8] + (10**6).to_bytes(4, "little") + b"PAR1")
    with pytest.raises(ShardFormatError, match="footer says it is 1000000 bytes"):
        ShardStream(root, batch_size=4)
    path.write_bytes(data[:-200] + b"\x07" * 192 + data[-8:])
    with pytest.raises(ShardFormatError, match="cannot parse the Parquet footer"):
        ShardStream(root, batch_size=4)


def test_bad_inputs(table, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="no column 'nope'"):
        ShardStream(Table(table, columns=["id", "nope"]), batch_size=4)
    with pytest.raises(ConfigError, match="no Parquet files"):
        ShardStream(str(tmp_path / "*.parquet"), batch_size=4)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ManifestError, match="not found"):
        ShardStream(str(empty), batch_size=4)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"pip install 'shardstream\[tables\]'"):
        ShardStream(table, batch_size=4)


def test_hugging_face_parquet_through_hffilesystem(tmp_path, monkeypatch):
    from test_http import QUICK, RangeServer

    write_table(tmp_path / "data")
    server = RangeServer(str(tmp_path))
    server.hub = True
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token or cache of the user's
    options = {"endpoint": server.url, "token": "hf_test_token"}
    try:
        for url in ("hf://datasets/org/name/data/*.parquet", "hf://datasets/org/name/data"):
            FOOTERS.clear()
            ds = ShardStream(Table(url, columns=["id"]), batch_size=16, world=World(0, 1), store=Store(options=options, config=QUICK))
            assert ds.manifest.files == ["part-00.parquet", "part-01.parquet", "part-02.parquet"]
            assert sorted(ids_of(ds)) == list(range(sum(ROWS)))
        reads = server.gets(".parquet")
        assert reads and all(rng and status == 206 for _, _, rng, status in reads)  # footers and chunks: ranged reads only
        assert server.tokens == {"Bearer hf_test_token"}
    finally:
        server.stop()


def test_text_columns_named_like_decoders_stay_text(tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    pq.write_table(pa.table({"txt": ["a", "b"], "json": ['{"k": 1}', "[2]"], "cls": [3, 4]}), str(root / "t.parquet"))
    batch = next(iter(ShardStream(str(root), batch_size=2, world=World(0, 1), shuffle=False, transform=same)))
    assert batch["txt"] == ["a", "b"] and batch["cls"].tolist() == [3, 4]


def test_steps_and_pad_mode(table):
    from shardstream import Schedule

    ds = ShardStream(table, batch_size=48, world=World(0, 2), mode="pad", schedule=Schedule(steps=6))
    first, second = [ids_of(ds) for _ in range(2)]
    assert len(first) == len(second) == 6 * 48  # every pass is 6 batches, crossing data epochs
    padded = ShardStream(table, batch_size=48, world=World(1, 2), mode="pad")
    rows = ids_of(ShardStream(table, batch_size=48, world=World(0, 2), mode="pad")) + ids_of(padded)
    assert set(rows) == set(range(sum(ROWS))) and len(rows) % 96 == 0  # every row at least once


@pytest.mark.parametrize("columnar", [True, False])
def test_a_broken_file_is_skipped_under_on_error_skip(tmp_path, columnar):
    root = write_table(tmp_path / "t")
    manifest = index_table(root)  # indexed while whole
    path = tmp_path / "t" / "part-01.parquet"
    path.write_bytes(path.read_bytes()[:-100])  # then cut short
    FOOTERS.clear()
    ds = ShardStream(manifest, batch_size=16, world=World(0, 1), on_error="skip", transform=None if columnar else same)
    batches = list(ds)
    assert len(batches) == len(ds)  # the planned batches, refilled from rows that were read
    rows = ids_of(batches)
    assert not set(rows) & set(range(300, 560))  # none of part-01's rows
    assert ds.stats()["samples_skipped"] == 260
    with pytest.raises(ShardFormatError, match="part-01.parquet"):
        list(ShardStream(manifest, batch_size=16, world=World(0, 1), transform=None if columnar else same))


def test_columnar_mix_of_two_tables_and_its_resume(table, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    pq.write_table(table_of(10_000, 200), str(other / "o.parquet"), row_group_size=50)

    def fresh():
        columns = ["id", "x"]
        sources = [Source(Table(table, columns=columns), weight=0.7, name="a"), Source(Table(str(other), columns=columns), weight=0.3, name="b")]
        loader = make_loader(ShardStream(sources, batch_size=10, world=World(0, 1), seed=1, shuffle=Shuffle(40)), num_workers=0, log_interval=None)
        loader.set_epoch(2)
        return loader

    loader = fresh()
    assert loader.dataset.columnar
    batches = list(loader)
    tags = [t for b in batches for t in b["__source__"]]
    ids = ids_of(batches)
    assert all((i >= 10_000) == (t == "b") for i, t in zip(ids, tags))  # __source__ says where each row came from
    assert dict(Counter(tags)) == {s.name: s.used for s in loader.dataset.plan().shares()}
    reference = [[int(i) for i in b["id"]] for b in batches]
    _, state = run(fresh(), stop=9)
    resumed = fresh()
    resumed.load_state_dict(state)
    assert run(resumed)[0] == reference[9:]


def test_a_state_names_the_table(table, tmp_path):
    from shardstream.errors import StateError

    ds = ShardStream(table, batch_size=16, world=World(0, 1))
    state = ds.state_dict()
    other = write_table(tmp_path / "t", rows=(300, 260, 241))  # one row more
    with pytest.raises(StateError):
        ShardStream(other, batch_size=16, world=World(0, 1)).load_state_dict(state)


def test_columnar_and_per_row_batches_hold_the_same_rows_in_the_same_order(table):
    def batches(transform):
        ds = ShardStream(table, batch_size=24, world=World(1, 2), seed=8, shuffle=Shuffle(70), transform=transform)
        return [[int(i) for i in b["id"]] for b in ds]

    assert batches(None) == batches(same)  # one plan, one shuffle: only the batch's shape differs


def test_a_footer_larger_than_the_first_tail_read(tmp_path):
    from shardstream.format.parquet import TAIL_READ

    root = write_table(tmp_path / "t", rows=(1200,), group=2)  # 600 row groups: a footer of a few hundred KiB
    FOOTERS.clear()
    m = index_table(root)
    assert m.footer_sizes[0] > TAIL_READ and len(m.counts) == 600
    FOOTERS.clear()  # read again while streaming: the footer's own size from the manifest, one read
    assert sorted(ids_of(ShardStream(m, batch_size=100, world=World(0, 1)))) == list(range(1200))
