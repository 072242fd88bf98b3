"""Token corpora written by others (docs/tokens.md): a pre-tokenized Parquet table with a
``list<int>`` column, as Hugging Face datasets write it, and tar shards of ``.npy`` token arrays
written by ``webdataset.TarWriter``. The same documents, packed by shardstream and written the
foreign way in shards of the same documents, stream the same batches, resume exactly, mix with
own corpora; bad columns, arrays and ids are one typed error naming where."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_tokens import corpus_texts, interrupted_and_resumed, train_tokenizer

import shardstream
from shardstream.cli.main import main
from shardstream.errors import ConfigError, ShardFormatError

PER_SHARD = 40  # documents per shard, the same for every way of writing them


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The corpus packed by shardstream, and its documents' token ids as a Parquet table (row groups
    of 40 rows, int32 ids: what a tokenizer's ``map`` writes) and as webdataset tar shards."""
    import webdataset

    tmp = tmp_path_factory.mktemp("foreign")
    texts = corpus_texts()
    tokenizer = train_tokenizer(texts, str(tmp / "tokenizer.json"))
    own = str(tmp / "own")
    shardstream.pack_tokens(iter(texts), own, tokenizer=tokenizer, eos=True, max_count=PER_SHARD)
    ds = shardstream.ShardStream(own, batch_size=1, shuffle=False, collate=lambda s: s[0], world=shardstream.World(0, 1))
    docs = [b["tokens.npy"].numpy() for b in ds]
    (tmp / "table").mkdir()
    half = len(docs) // 2 // PER_SHARD * PER_SHARD  # two files, row groups of 40 documents
    for k, part in enumerate((docs[:half], docs[half:])):
        column = pa.array([d.astype(np.int32).tolist() for d in part], pa.list_(pa.int32()))
        pq.write_table(pa.table({"id": np.arange(len(part)), "input_ids": column}), tmp / "table" / f"train-{k}.parquet", row_group_size=PER_SHARD)
    (tmp / "wds").mkdir()
    for s in range(0, len(docs), PER_SHARD):
        with webdataset.TarWriter(str(tmp / "wds" / f"shard-{s // PER_SHARD:04d}.tar")) as writer:
            for i in range(s, min(s + PER_SHARD, len(docs))):
                writer.write({"__key__": f"doc{i:05d}", "npy": docs[i].astype(np.int64), "txt": "not tokens"})
    shards = str(tmp / "wds" / f"shard-{{0000..{(len(docs) - 1) // PER_SHARD:04d}}}.tar")
    return {"own": own, "table": str(tmp / "table"), "shards": shards, "tmp": tmp, "docs": docs}


def _sources(c):
    return {
        "own": shardstream.Tokens(c["own"], seq_len=15),
        "table": shardstream.Tokens(c["table"], seq_len=15),  # field="input_ids" by default
        "shards": shardstream.Tokens(c["shards"], seq_len=15, field="npy"),
    }


def _equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in ("input_ids", "position_ids"))


def test_foreign_corpora_stream_the_same_batches_as_own(corpora):
    batches = {}
    for name, tokens in _sources(corpora).items():
        ds = shardstream.ShardStream(tokens, batch_size=4, seed=5, shuffle=shardstream.Shuffle(64), world=shardstream.World(0, 2))
        batches[name] = list(shardstream.make_loader(ds, num_workers=2))
        assert int(ds.manifest.token_starts[-1]) == sum(len(d) for d in corpora["docs"])
    assert len(batches["own"]) > 10
    assert _equal(batches["table"], batches["own"]) and _equal(batches["shards"], batches["own"])
    assert batches["own"][0]["input_ids"].dtype == torch.int64
    # in order, the windows are the documents end to end
    ds = shardstream.ShardStream(_sources(corpora)["table"], batch_size=4, shuffle=False, world=shardstream.World(0, 1))
    ids = torch.cat([b["input_ids"] for b in ds]).numpy().reshape(-1)
    stream = np.concatenate(corpora["docs"]).astype(np.int64)
    assert np.array_equal(ids, stream[: len(ids)]) and len(stream) - len(ids) < 4 * 16


@pytest.mark.parametrize("name", ["table", "shards"])
def test_a_foreign_corpus_resumes_exactly(corpora, name):
    def loader():
        ds = shardstream.ShardStream(_sources(corpora)[name], batch_size=4, seed=9, shuffle=shardstream.Shuffle(50), world=shardstream.World(0, 1))
        return shardstream.make_loader(ds, num_workers=2)

    whole = list(loader())
    head, rest = interrupted_and_resumed(loader, 7)
    assert _equal(head + rest, whole)


def test_foreign_and_own_corpora_mix_by_tokens(corpora):
    tokens = _sources(corpora)
    sources = [shardstream.Source(tokens["own"], weight=0.7, name="own"), shardstream.Source(tokens["table"], weight=0.3, name="table")]
    ds = shardstream.ShardStream(sources, batch_size=4, seed=2, world=shardstream.World(0, 1), schedule=shardstream.Schedule(steps=60))
    names, seen = [], {"own": [], "table": []}
    for batch in ds:
        names += batch["__source__"]
        for name, row in zip(batch["__source__"], batch["input_ids"].tolist()):
            seen[name].append(tuple(row))
    assert len(names) == 240 and abs(names.count("own") / len(names) - 0.7) < 0.05
    assert all(len(rows) == len(set(rows)) for rows in seen.values())  # within a pass over each, no sequence twice


def test_bad_foreign_corpora_are_one_typed_error_naming_where(corpora, tmp_path):
    table = corpora["table"]
    with pytest.raises(ConfigError, match=r"column 'id' is int64, not a list of integer token ids"):
        shardstream.ShardStream(shardstream.Tokens(table, seq_len=15, field="id"), batch_size=4)
    with pytest.raises(ConfigError, match=r"no column 'tokens' of token ids; the table has \['id', 'input_ids'\]"):
        shardstream.ShardStream(shardstream.Tokens(table, seq_len=15, field="tokens"), batch_size=4)
    pq.write_table(pa.table({"input_ids": pa.array([["a", "b"]] * 20, pa.list_(pa.string()))}), tmp_path / "words.parquet")
    with pytest.raises(ConfigError, match=r"words.parquet.*list<element: string>, not a list of integer"):
        shardstream.ShardStream(shardstream.Tokens(str(tmp_path / "words.parquet"), seq_len=3), batch_size=2)

    # an id beyond int64 (the batches' dtype) in a uint64 column: the row group it is in
    big = [[1, 2, 3, 4]] * 10 + [[5, 2**63 + 7]]
    pq.write_table(pa.table({"input_ids": pa.array(big, pa.list_(pa.uint64()))}), tmp_path / "big.parquet", row_group_size=4)
    ds = shardstream.ShardStream(
        shardstream.Tokens(str(tmp_path / "big.parquet"), seq_len=3), batch_size=1, shuffle=False, world=shardstream.World(0, 1)
    )
    with pytest.raises(ShardFormatError, match=r"big.parquet row group 2.*token id 9223372036854775815 is beyond int64"):
        list(ds)

    import webdataset

    def shard(name: str, arrays: list[np.ndarray]) -> str:
        with webdataset.TarWriter(str(tmp_path / name)) as writer:
            for i, a in enumerate(arrays):
                writer.write({"__key__": f"d{i}", "npy": a})
        return str(tmp_path / name)

    flat = shard("flat.tar", [np.arange(8), np.ones((2, 4), dtype=np.int64)])
    with pytest.raises(ShardFormatError, match=r"flat.tar.*sample 'd1': npy is int64\[2, 4\], not a 1-D array of integer token ids"):
        shardstream.ShardStream(shardstream.Tokens(flat, seq_len=3, field="npy"), batch_size=1)
    floats = shard("floats.tar", [np.arange(8, dtype=np.float32)])
    with pytest.raises(ShardFormatError, match=r"floats.tar.*sample 'd0': npy is float32\[8\], not a 1-D array of integer"):
        shardstream.ShardStream(shardstream.Tokens(floats, seq_len=3, field="npy"), batch_size=1)
    with pytest.raises(ShardFormatError, match=r"sample 'd0' has no 'input_ids.npy' member of token ids \(it has \['npy'\]"):
        shardstream.ShardStream(shardstream.Tokens(floats, seq_len=3, field="input_ids.npy"), batch_size=1)
    negative = shard("negative.tar", [np.arange(8), np.array([3, -1, 4], dtype=np.int64)])
    ds = shardstream.ShardStream(shardstream.Tokens(negative, seq_len=3, field="npy"), batch_size=1, shuffle=False, world=shardstream.World(0, 1))
    with pytest.raises(ShardFormatError, match=r"negative.tar: sample 'd1': npy: token id -1 is negative"):
        list(ds)
    with pytest.raises(ConfigError, match="field"):
        shardstream.Tokens(negative, seq_len=3, field="")


def test_index_writes_the_token_counts_of_foreign_shards_once(corpora, tmp_path, capsys):
    """``shardstream index SHARDS DEST --tokens FIELD``: the manifest counts their tokens, so a
    stream over DEST starts without reading a shard, and streams what the URLs do."""
    dest = str(tmp_path / "index")
    assert main(["index", corpora["shards"], dest, "--tokens", "npy"]) == 0
    assert "tokens" in capsys.readouterr().out
    m = shardstream.load_manifest(dest)
    assert m.total_tokens == sum(len(d) for d in corpora["docs"]) and m.token_info == {"dtype": "int64", "field": "npy"}
    indexed = shardstream.ShardStream(shardstream.Tokens(dest, seq_len=15), batch_size=4, seed=1, world=shardstream.World(0, 1))
    direct = shardstream.ShardStream(_sources(corpora)["own"], batch_size=4, seed=1, world=shardstream.World(0, 1))
    assert _equal(list(indexed), list(direct))


def test_a_table_without_statistics_or_through_its_index_streams_the_same(corpora, tmp_path):
    """A footer without null counts (``write_statistics=False``): its row groups' tokens are counted
    by reading the column once; a table indexed by ``shardstream index`` streams from its manifest."""
    column = pa.array([d.astype(np.int32).tolist() for d in corpora["docs"]], pa.list_(pa.int32()))
    (tmp_path / "plain").mkdir()
    pq.write_table(pa.table({"input_ids": column}), tmp_path / "plain" / "all.parquet", row_group_size=PER_SHARD, write_statistics=False)
    assert pq.ParquetFile(tmp_path / "plain" / "all.parquet").metadata.row_group(0).column(0).statistics is None
    assert main(["index", str(tmp_path / "plain"), str(tmp_path / "plain")]) == 0

    def batches(tokens):
        ds = shardstream.ShardStream(tokens, batch_size=4, seed=5, shuffle=shardstream.Shuffle(64), world=shardstream.World(0, 1))
        return list(ds)

    own = batches(_sources(corpora)["own"])
    assert _equal(batches(shardstream.Tokens(str(tmp_path / "plain" / "all.parquet"), seq_len=15)), own)
    assert _equal(batches(shardstream.Tokens(str(tmp_path / "plain"), seq_len=15)), own)  # its index.json, a table manifest
