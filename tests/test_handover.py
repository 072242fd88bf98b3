"""Read once, hand over (shardstream/handover.py): under a gloo process group of 4 real ranks,
each with a DataLoader worker, the manifest is read from the moto S3 server once per job start,
counted at a proxy in front of the server; rank 0's read error reaches every rank as its type."""

from __future__ import annotations

import datetime
import json
import os

import pytest
from conftest import rank_results, run_ranks, scaled, write_dataset
from faultproxy import FaultProxy


def _rank_main(rank: int, world: int, store: str, source: str, options: dict, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import shardstream

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=scaled(60)))
    result: dict = {}
    try:
        dataset = shardstream.ShardStream(source, batch_size=5, seed=3, shuffle=False, store=shardstream.Store(options=options))
    except shardstream.ManifestError as exc:
        result["error"] = [type(exc).__name__, isinstance(exc, FileNotFoundError), str(exc)]
    else:
        loader = shardstream.make_loader(dataset, num_workers=1)
        result["keys"] = [k for batch in loader for k in batch["__key__"]]
        result["len"] = len(loader)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _manifest_gets(proxy: FaultProxy, prefix: str) -> int:
    return sum(1 for method, path, _ in proxy.log if method == "GET" and path.split("?")[0].endswith(f"{prefix}/index.json"))


@pytest.mark.slow
def test_four_ranks_read_the_manifest_once_and_every_rank_gets_it(s3, tmp_path):
    bucket, options, _ = s3
    write_dataset(f"s3://{bucket}/hand", 80, max_count=10, storage_options=options)
    world, out = 4, str(tmp_path / "result")
    with FaultProxy(options["endpoint_url"]) as proxy:
        run_ranks(_rank_main, world, (world, str(tmp_path / "store"), f"s3://{bucket}/hand", {"endpoint_url": proxy.url}, out))
        gets = _manifest_gets(proxy, f"/{bucket}/hand")
    ranks = rank_results(out, world)
    assert gets == 1  # one GET of index.json for the job, not one per rank (4) nor per worker
    keys = [k for r in ranks for k in r["keys"]]
    assert len(keys) == len(set(keys)) == 80  # every rank planned from the same manifest
    assert len({r["len"] for r in ranks}) == 1


@pytest.mark.slow
def test_a_mix_file_and_its_sources_manifests_are_read_once(s3, tmp_path):
    bucket, options, client = s3
    for name in ("a", "b"):
        write_dataset(f"s3://{bucket}/mix/{name}", 40, max_count=10, storage_options=options)
    mix = {"sources": [{"url": "a", "weight": 0.5, "name": "a"}, {"url": "b", "weight": 0.5, "name": "b"}]}
    client.put_object(Bucket=bucket, Key="mix/mix.json", Body=json.dumps(mix).encode())
    world, out = 3, str(tmp_path / "result")
    with FaultProxy(options["endpoint_url"]) as proxy:
        run_ranks(_rank_main, world, (world, str(tmp_path / "store"), f"s3://{bucket}/mix/mix.json", {"endpoint_url": proxy.url}, out))
        gets = [path.split("?")[0] for method, path, _ in proxy.log if method == "GET" and path.split("?")[0].endswith(".json")]
    ranks = rank_results(out, world)
    assert sorted(gets) == [f"/{bucket}/mix/a/index.json", f"/{bucket}/mix/b/index.json", f"/{bucket}/mix/mix.json"]  # once each, not 3x
    assert all(r["keys"] for r in ranks) and len({r["len"] for r in ranks}) == 1  # one plan of one mix on every rank


@pytest.mark.slow
def test_rank_zeros_manifest_error_is_raised_on_every_rank(s3, tmp_path):
    bucket, options, _ = s3
    world, out = 3, str(tmp_path / "result")
    with FaultProxy(options["endpoint_url"]) as proxy:
        run_ranks(_rank_main, world, (world, str(tmp_path / "store"), f"s3://{bucket}/missing", {"endpoint_url": proxy.url}, out))
        gets = _manifest_gets(proxy, f"/{bucket}/missing")
    errors = [r["error"] for r in rank_results(out, world)]
    assert gets <= 1
    assert all(e[0] == errors[0][0] and e[1] for e in errors), errors  # the same ManifestError, also a FileNotFoundError
    assert all("cannot read the manifest (not found)" in e[2] for e in errors)


def test_ls_states_the_start_at_any_world_size(tmp_path, capsys):
    from shardstream.cli.main import main

    root = tmp_path / "ds"
    write_dataset(str(root), 8192, max_count=1024, size=8)
    assert main(["ls", str(root), "--world", "8192", "--workers", "1", "--rate", "1GB", "--json"]) == 0
    start = json.loads(capsys.readouterr().out)["requests"]["start"]
    size = (root / "index.json").stat().st_size
    # what the 4-rank test above counts at the server, scaled: 1 GET at any world, 4 (one a rank) without the handover
    assert start == {"gets": 1, "bytes": size, "gets_each_rank_reading": 8192, "bytes_each_rank_reading": 8192 * size}
    assert main(["ls", str(root), "--world", "8192", "--workers", "1"]) == 0
    out, err = capsys.readouterr()
    assert "start: 1 GETs" in out and "8,192 GETs" in out
    assert "8,192 GETs of the manifest within seconds, above S3's 5,500 per prefix" in err
