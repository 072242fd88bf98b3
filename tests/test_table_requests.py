"""A mix with a Parquet table in it: ``plan()`` (and ``shardstream ls``) estimate the table's GETs
as well as the tar dataset's, and a real pass on a moto S3 server, every GET logged by a proxy,
makes exactly those: per (process, row group) one per run of adjacent projected columns, per
(process, file) one footer, beside the tar dataset's shard and sidecar GETs."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_dataset
from faultproxy import FaultProxy

from shardstream import ShardStream, Source, Store, World, make_loader
from shardstream.format.members import MEMBER_CACHE
from shardstream.format.offsets import OFFSET_CACHE
from shardstream.format.parquet import FOOTERS, Table
from shardstream.plan.requests import count_mix_requests

ROWS, GROUP = 300, 100  # per file: 3 row groups


def upload_table(tmp_path, client, bucket, files=2) -> dict[str, int]:
    """Parquet files under s3://bucket/table/; returns each object's key and size."""
    sizes = {}
    for f in range(files):
        rng = np.random.default_rng(f)
        table = pa.table({"id": np.arange(f * ROWS, (f + 1) * ROWS, dtype=np.int64), "x": rng.random(ROWS), "y": rng.random(ROWS)})
        path = str(tmp_path / f"part-{f}.parquet")
        pq.write_table(table, path, row_group_size=GROUP, compression="none")
        client.upload_file(path, bucket, f"table/part-{f}.parquet")
        sizes[f"table/part-{f}.parquet"] = os.path.getsize(path)
    return sizes


def gets_by_kind(proxy: FaultProxy, bucket: str, sizes: dict[str, int]) -> Counter:
    """The proxy's GETs: a table's row-group runs, its footers (a range through the file's last
    byte), and the tar dataset's shards and sidecars."""
    kinds: Counter = Counter()
    for method, path, rng in proxy.log:
        if method != "GET" or f"/{bucket}/" not in path:
            continue
        key = path.split(f"/{bucket}/", 1)[1].split("?")[0]
        if key.endswith(".parquet"):
            end = int(rng.split("-")[1]) if rng and "-" in rng else None
            kinds["footers" if end == sizes[key] - 1 else "runs"] += 1
        elif key.endswith(".tar"):
            kinds["shards"] += 1
        elif key.endswith((".tar.idx", ".tar.members")):  # (a range inside a packed shard reads its member sidecar)
            kinds["sidecars"] += 1
    return kinds


@pytest.mark.parametrize("world,workers", [(2, 0), (1, 2)])
def test_a_mix_with_a_table_makes_the_gets_its_plan_estimates(s3, tmp_path, world, workers):
    bucket, options, client = s3
    sizes = upload_table(tmp_path, client, bucket)
    web = write_dataset(f"s3://{bucket}/web", 80, max_count=20, size=1500, storage_options=options)
    with FaultProxy(options["endpoint_url"]) as proxy:
        store = Store(options={"endpoint_url": proxy.url})
        sources = [Source(Table(f"s3://{bucket}/table/", columns=["id", "x"]), weight=5, name="table"), Source(web, weight=1, name="web")]

        def stream(rank):
            return ShardStream(sources, batch_size=10, seed=5, world=World(rank, world), store=store, decode=False)

        first = stream(0)
        plan = first.plan(num_workers=max(1, workers))
        count = count_mix_requests(plan, first.sources.manifests)
        rows, got = 0, Counter()
        for rank in range(world):
            ds = stream(rank)
            FOOTERS.clear()  # every rank is a process of its own: it reads the footers it needs in its pass
            OFFSET_CACHE.clear()
            MEMBER_CACHE.clear()
            proxy.log.clear()  # (the stream's start: the manifests, the table's footers as it was indexed)
            batches = list(make_loader(ds, num_workers=workers, workers="processes", pin_memory=False, log_interval=None) if workers else ds)
            assert len(batches) == len(ds)
            rows += sum(1 for b in batches for s in b["__source__"] if s == "table")
            got += gets_by_kind(proxy, bucket, sizes)
    table, tar = dict(count.parts)["table"], dict(count.parts)["web"]
    assert rows > 2 * GROUP  # the table's rows were read, several row groups of them
    assert (table.ranges, table.sidecars, table.side) == (got["runs"], got["footers"], "footers"), (table, got)
    assert (tar.ranges, tar.sidecars) == (got["shards"], got["sidecars"]), (tar, got)
    assert count.gets == sum(got.values())
    summary = plan.summary()
    assert f"requests: {count.gets:,} GETs per epoch" in summary and "footers and sidecars" in summary, summary
    assert f"by source: table {table.gets:,} GETs" in summary, summary


def test_ls_estimates_a_table_in_a_mix_file(s3, tmp_path, capsys):
    from shardstream.cli.main import main

    bucket, options, client = s3
    upload_table(tmp_path, client, bucket)
    web = write_dataset(f"s3://{bucket}/web", 40, max_count=10, size=500, storage_options=options)
    mix = tmp_path / "mix.json"
    sources = [{"url": f"s3://{bucket}/table/", "weight": 5, "name": "table"}, {"url": web, "weight": 1, "name": "web"}]
    mix.write_text(json.dumps({"sources": sources}))
    capsys.readouterr()
    assert main(["ls", str(mix), "--world", "2", "--workers", "2", "--json", "--endpoint-url", options["endpoint_url"]]) == 0
    listed = json.loads(capsys.readouterr().out)["requests"]
    table = listed["by_source"]["table"]["gets_per_epoch"]
    assert 0 < table < listed["gets_per_epoch"]
    ds = ShardStream(str(mix), batch_size=1, world=World(0, 2), store=Store(options=options))
    count = count_mix_requests(ds.plan(num_workers=2), ds.sources.manifests)
    assert dict(count.parts)["table"].gets == table and count.gets == listed["gets_per_epoch"]  # the stream's own count
