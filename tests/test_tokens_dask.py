"""Token packing as shard tasks on a real Dask ``distributed.LocalCluster`` (worker processes):
the same shards and manifest, byte for byte, as ``--workers 1``; bad lines named; what it does
not split yet refused."""

from __future__ import annotations

import json
import os

import pytest
from test_tokens import corpus, packed  # noqa: F401  (corpus: a fixture)

import shardstream
from shardstream.cli.main import main
from shardstream.errors import ConfigError, SourceError

distributed = pytest.importorskip("distributed")


@pytest.fixture
def cluster():
    with (
        distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address="127.0.0.1:0", host="127.0.0.1") as c,
        distributed.Client(c, timeout="60s") as client,
    ):
        yield c, client


def files_of(root) -> dict[str, bytes]:
    return {n: (root / n).read_bytes() for n in sorted(os.listdir(root))}


def test_dask_packs_the_same_bytes_as_one_process(tmp_path, corpus, cluster):  # noqa: F811
    texts, tokenizer, src = corpus
    with open(src, "a") as f:  # blank lines are no documents, here as in one process
        f.write("\n   \n")
    lines = open(src).read().splitlines()
    lines.insert(100, "")
    open(src, "w").write("\n".join(lines) + "\n")
    c, _ = cluster
    common = ["--tokenizer", tokenizer, "--text-field", "text", "--eos", "--max-count", "40", "--no-progress"]
    assert main(["pack", src, str(tmp_path / "one"), *common, "--workers", "1"]) == 0
    assert main(["pack", src, str(tmp_path / "dask"), *common, "--dask", c.scheduler_address]) == 0
    one, dask = files_of(tmp_path / "one"), files_of(tmp_path / "dask")
    assert len(one) == 3 * 8 + 1  # 8 shards, their offset and member sidecars, index.json
    manifests = [json.loads(files.pop("index.json")) for files in (one, dask)]
    assert dask == one  # the shards and their sidecars, byte for byte
    for m in manifests:
        del m["created"]  # the time it was written: all else the same, tokens per shard and token_info too
    assert manifests[0] == manifests[1]
    m = shardstream.load_manifest(str(tmp_path / "dask"))
    assert m.total_samples == len(texts) and m.total_tokens == sum(m.tokens.tolist()) > 0


def test_dask_names_the_bad_line_and_refuses_what_it_cannot_split(tmp_path, corpus, cluster):  # noqa: F811
    texts, tokenizer, _ = corpus
    _, client = cluster
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:50]) + '{"body": "x"}\n')
    executor = client.get_executor(pure=False)
    with pytest.raises(SourceError, match=r"bad.jsonl:51: no string field 'text'"):
        shardstream.pack_tokens(str(bad), str(tmp_path / "x"), tokenizer=tokenizer, max_count=20, executor=executor)
    assert not (tmp_path / "x" / "index.json").exists()
    with pytest.raises(ConfigError, match=r"\.jsonl corpus only.*--workers"):
        shardstream.pack_tokens(iter(texts), str(tmp_path / "y"), tokenizer=tokenizer, executor=executor)
