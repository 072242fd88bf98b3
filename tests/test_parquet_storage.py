"""A Parquet table's reads through the worker's storage machinery: the one read-ahead budget a
worker's sources share (a table's row groups counted block by block, beside tar sources), and
the local cache (a row group's projected runs fetched once, served from disk in later epochs,
CRC-checked on every hit), on real Parquet files, real tar shards and a moto S3 server."""

from __future__ import annotations

import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import make_samples

from shardstream import Cache, Read, ShardStream, ShardWriter, Source, Store, World
from shardstream.format.parquet import FOOTERS, Table

ROWS, GROUP = 4_000, 1_000  # 4 row groups of ~24 KiB of projected columns each


def same(row):
    return row  # a per-sample transform: the per-row path


def write_table(root, files=2) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        ids = np.arange(f * ROWS, (f + 1) * ROWS, dtype=np.int64)
        rng = np.random.default_rng(f)
        table = pa.table({"id": ids, "x": rng.random(ROWS), "y": rng.random(ROWS), "skip": rng.random(ROWS)})
        path = str(root / f"part-{f}.parquet")
        pq.write_table(table, path, row_group_size=GROUP, compression="none")
        paths.append(path)
    return paths


def tars(root, n_sources=3, per_source=40):
    sources = []
    for s in range(n_sources):
        with ShardWriter(str(root / f"tar{s}"), max_count=10) as w:
            for sample in make_samples(per_source, size=4 << 10, seed=s):
                sample["__key__"] = f"{s}-{sample['__key__']}"
                w.write(sample)
        sources.append(Source(str(root / f"tar{s}"), weight=1.0, name=f"tar{s}"))
    return sources


def stream(sources, readahead, block, **kw):
    read = Read(read_size=block, readahead_bytes=readahead)
    return ShardStream(sources, batch_size=20, shuffle=False, world=World(0, 1), seed=1, decode=False, store=Store(read=read), **kw)


def keys(batches):
    return [k for b in batches for k in b["__key__"]]


def test_a_table_and_tar_sources_share_the_workers_one_readahead_budget(tmp_path):
    table = Source(Table(write_table(tmp_path / "t"), columns=["id", "x", "y"]), weight=60.0, name="table")
    sources = [table, *tars(tmp_path)]
    budget, block = 32 << 10, 8 << 10
    plain = keys(stream(sources, 0, block, transform=same))
    ds = stream(sources, budget, block, transform=same)
    ahead = keys(ds)
    assert ahead == plain and len(set(ahead)) == len(ahead)  # every row and sample once, in the planned order
    stats = ds.stats()
    table_rows = sum(1 for k in ahead if ".parquet:" in k)
    assert table_rows > 2 * GROUP, table_rows  # several row groups read, beside the tar shards
    # Everything read went through the read-ahead, the table's row groups included, and all the
    # sources together held at most the one budget plus the block the parser waited on (before,
    # the table read ahead with a budget of its own: its whole row groups on top of the tars').
    assert stats["readahead_fetched"] == stats["bytes_read"] > 4 * budget
    assert 0 < stats["readahead_peak"] <= budget + block


def test_a_columnar_table_reads_ahead_within_the_budget(tmp_path):
    paths = write_table(tmp_path / "t")
    budget, block = 16 << 10, 4 << 10
    ds = stream(Table(paths, columns=["id", "x"]), budget, block)
    assert ds.columnar
    ids = sorted(int(i) for b in ds for i in b["id"])
    assert ids == list(range(2 * ROWS))
    stats = ds.stats()
    assert stats["readahead_fetched"] == stats["bytes_read"] > 4 * budget
    assert 0 < stats["readahead_peak"] <= budget + block


def _cached(cache_dir):
    return sorted(os.path.join(cache_dir, n) for n in os.listdir(cache_dir) if n.endswith(".tar"))


@pytest.mark.parametrize("readahead", [0, 64 << 10])
def test_a_cached_table_is_read_from_disk_in_later_epochs_and_a_flipped_byte_is_caught(s3, tmp_path, caplog, readahead):
    bucket, options, client = s3
    for path in write_table(tmp_path / "t"):
        client.upload_file(path, bucket, f"table/{os.path.basename(path)}")
    FOOTERS.clear()
    cache_dir = str(tmp_path / "cache")
    store = Store(options=options, cache=Cache(cache_dir, 10**8), read=Read(readahead_bytes=readahead))
    ds = ShardStream(Table(f"s3://{bucket}/table/", columns=["id", "x"]), batch_size=100, shuffle=False, world=World(0, 1), store=store)

    def epoch(e):
        ds.set_epoch(e)
        return {int(i): float(x) for b in ds for i, x in zip(b["id"], b["x"])}

    first = epoch(0)
    assert sorted(first) == list(range(2 * ROWS))
    after_fill = ds.stats()
    groups = len(ds.manifest.counts)
    assert after_fill["cache_misses"] == groups and len(_cached(cache_dir)) == groups  # one entry per row group
    assert epoch(1) == first
    second = ds.stats()
    assert second["cache_hits"] - after_fill["cache_hits"] == groups and second["cache_misses"] == groups
    assert second["requests"] == after_fill["requests"] and second["bytes_read"] == after_fill["bytes_read"]  # nothing from S3
    # A bit flipped on disk after the fill: the hit's CRC check drops the copy, it is fetched again, every value as written.
    victim = _cached(cache_dir)[1]
    with open(victim, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x20]))
    with caplog.at_level(logging.WARNING, logger="shardstream.storage.cache"):
        assert epoch(2) == first
    third = ds.stats()
    assert third["cache_corrupt"] - second["cache_corrupt"] == 1 and third["cache_misses"] - second["cache_misses"] == 1
    assert third["requests"] > second["requests"]  # that row group's runs, from S3 again
    assert any("does not match the CRC-32" in r.getMessage() and victim in r.getMessage() for r in caplog.records), caplog.text
