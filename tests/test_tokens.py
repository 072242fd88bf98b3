"""Token corpora (docs/tokens.md): text packed with a tokenizer trained here (no download), then
streamed as fixed-length sequences packed across documents.

Every word of the corpus is distinct, so every token id but the EOS id occurs once in the corpus's
stream: a token seen twice in an epoch is a repeat, whatever sequence it came in."""

from __future__ import annotations

import datetime
import json
import os
import random

import numpy as np
import pytest
import torch
from conftest import rank_results, run_ranks

import shardstream
from shardstream.cli.main import main
from shardstream.errors import ConfigError, ManifestError, SourceError
from shardstream.format.tokens import token_dtype

DOCS = 300
EOS = "<|endoftext|>"


def corpus_texts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts, k = [], 0
    for _ in range(DOCS):
        n = rng.randint(1, 40)
        texts.append(" ".join(f"w{k + j}" for j in range(n)))
        k += n
    return texts


def train_tokenizer(texts: list[str], path: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", EOS]))
    tok.save(path)
    return path


def make_tokenizer():
    """A ``module:function`` tokenizer (the test module is importable: tests/ is on the path)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.environ["TOKENS_TEST_TOKENIZER"])


@pytest.fixture
def corpus(tmp_path):
    texts = corpus_texts()
    tokenizer = train_tokenizer(texts, str(tmp_path / "tokenizer.json"))
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return texts, tokenizer, str(src)


def stream_of(texts: list[str], tokenizer: str, eos: bool = True) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    end = [tok.token_to_id(EOS)] if eos else []
    return np.concatenate([np.array(tok.encode(t).ids + end, dtype=np.int64) for t in texts])


def packed(tmp_path, corpus, **options) -> str:
    _, tokenizer, src = corpus
    dest = str(tmp_path / "tokens")
    shardstream.pack_tokens(src, dest, tokenizer=tokenizer, eos=True, max_count=40, **options)
    return dest


def test_cli_pack_counts_the_corpus_tokens(tmp_path, corpus, capsys):
    texts, tokenizer, src = corpus
    dest = str(tmp_path / "tokens")
    assert main(["pack", src, dest, "--tokenizer", tokenizer, "--text-field", "text", "--eos", "--max-count", "40", "--no-progress"]) == 0
    assert "300 documents" in capsys.readouterr().out
    assert main(["ls", dest]) == 0
    assert f"tokens: {len(stream_of(texts, tokenizer))} (uint16, vocabulary" in capsys.readouterr().out
    m = shardstream.load_manifest(dest)
    stream = stream_of(texts, tokenizer)
    assert m.total_samples == DOCS and m.total_tokens == len(stream) and len(m.paths) == 8
    assert m.token_info["dtype"] == "uint16" and m.token_info["eos_id"] == 1 and m.token_info["vocab_size"] == len(stream) - DOCS + 2
    assert [s.tokens for s in m.shards] == m.tokens.tolist() and sum(m.tokens.tolist()) == len(stream)
    # the samples are plain .npy documents: any WebDataset reader reads them
    ds = shardstream.ShardStream(dest, batch_size=1, shuffle=False, collate=lambda s: s[0], world=shardstream.World(0, 1))
    docs = [b["tokens.npy"].numpy() for b in ds]
    assert all(d.dtype == np.uint16 for d in docs) and np.array_equal(np.concatenate(docs), stream)


def test_pack_is_the_same_for_any_workers_and_source(tmp_path, corpus):
    texts, tokenizer, src = corpus
    one = packed(tmp_path / "one", corpus)
    packed(tmp_path / "two", corpus, workers=2)
    names = sorted(p.name for p in (tmp_path / "one" / "tokens").iterdir() if p.suffix == ".tar")
    assert names and all((tmp_path / "one" / "tokens" / n).read_bytes() == (tmp_path / "two" / "tokens" / n).read_bytes() for n in names)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), tmp_path / "corpus.parquet", row_group_size=64)
    from_parquet = shardstream.pack_tokens(str(tmp_path / "corpus.parquet"), str(tmp_path / "pq"), tokenizer=tokenizer, eos=True, max_count=40)
    os.environ["TOKENS_TEST_TOKENIZER"] = tokenizer
    from_strings = shardstream.pack_tokens(iter(texts), str(tmp_path / "it"), tokenizer="test_tokens:make_tokenizer", eos=EOS, max_count=40)
    assert from_parquet.tokens == from_strings.tokens == shardstream.load_manifest(one).total_tokens
    for other in ("pq", "it"):  # the same documents, the same shards
        assert [(tmp_path / other / n).read_bytes() for n in names] == [(tmp_path / "one" / "tokens" / n).read_bytes() for n in names]


def test_pack_errors_name_the_line(tmp_path, corpus):
    _, tokenizer, src = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1 w2"}\n{"body": "w3"}\n')
    with pytest.raises(SourceError, match=r"bad.jsonl:2.*'text'"):
        shardstream.pack_tokens(str(bad), str(tmp_path / "x"), tokenizer=tokenizer)
    assert not (tmp_path / "x" / "index.json").exists()
    with pytest.raises(ConfigError, match="no end-of-document token"):
        shardstream.pack_tokens(src, str(tmp_path / "y"), tokenizer=tokenizer, eos="<nope>")
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizer.json"):
        shardstream.pack_tokens(src, str(tmp_path / "z"), tokenizer=src)
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"


def test_not_a_token_corpus(tmp_path):
    from conftest import write_dataset

    root = write_dataset(str(tmp_path / "plain"), 20)
    with pytest.raises(ManifestError, match="not a token corpus"):
        shardstream.ShardStream(shardstream.Tokens(root, seq_len=8), batch_size=2, world=shardstream.World(0, 1))
    with pytest.raises(ConfigError, match="seq_len"):
        shardstream.Tokens(root, seq_len=0)


def check_positions(ids: np.ndarray, positions: np.ndarray, eos: int) -> None:
    """Position ids count from 0 at the sequence's start and after every EOS (a document's start)."""
    for row, pos in zip(ids, positions):
        expect = np.zeros(len(row), dtype=np.int64)
        for j in range(1, len(row)):
            expect[j] = 0 if row[j - 1] == eos else expect[j - 1] + 1
        assert np.array_equal(pos, expect)


def test_sequences_are_the_corpus_cut_in_windows(tmp_path, corpus):
    texts, tokenizer, _ = corpus
    dest = packed(tmp_path, corpus)
    stream = stream_of(texts, tokenizer)
    seq_len, batch = 31, 4
    ds = shardstream.ShardStream(shardstream.Tokens(dest, seq_len=seq_len), batch_size=batch, shuffle=False, world=shardstream.World(0, 1))
    batches = list(ds)
    ids = torch.cat([b["input_ids"] for b in batches]).numpy()
    positions = torch.cat([b["position_ids"] for b in batches]).numpy()
    assert batches[0]["input_ids"].dtype == torch.int64 and ids.shape[1] == seq_len + 1
    windows = len(stream) // (seq_len + 1)
    used = windows // batch * batch
    assert len(batches) == len(ds) == windows // batch
    assert np.array_equal(ids.reshape(-1), stream[: used * (seq_len + 1)])  # packed across documents, no padding
    check_positions(ids, positions, eos=1)
    summary = ds.plan(num_workers=1).summary()
    assert f"tokens: {len(stream)} in {windows} sequences of {seq_len + 1}" in summary
    assert f"{(windows - used) * (seq_len + 1)} dropped" in summary and f"{len(stream) - windows * (seq_len + 1)} after the last" in summary


def _tokens_of(batches: list[dict]) -> list[int]:
    return [t for b in batches for t in b["input_ids"].reshape(-1).tolist() if t != 1]


def test_shuffled_epochs_use_each_token_once(tmp_path, corpus):
    dest = packed(tmp_path, corpus)
    orders = []
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            ds = shardstream.ShardStream(shardstream.Tokens(dest, seq_len=15), batch_size=4, seed=3, world=shardstream.World(rank, 2))
            ds.set_epoch(epoch)
            loader = shardstream.make_loader(ds, num_workers=2)
            seen += _tokens_of(list(loader))
        assert len(seen) == len(set(seen))
        orders.append(seen)
    assert orders[0] != orders[1]


def _rank_main(rank: int, world: int, store: str, dest: str, out: str, boundaries: str | None = "positions") -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Embedding(8192, 2))
    ds = shardstream.ShardStream(shardstream.Tokens(dest, seq_len=15, boundaries=boundaries), batch_size=4, seed=1, shuffle=shardstream.Shuffle(64))
    loader = shardstream.make_loader(ds, num_workers=2)
    tokens, batches = [], 0
    for batch in loader:
        model(batch["input_ids"][:, :-1]).sum().backward()  # all-reduce: a rank with fewer batches would hang here
        if boundaries == "offsets":  # every document and every row starts a sequence, the last ends the batch
            cu = batch["cu_seqlens"]
            assert cu[-1] == batch["input_ids"].numel() and set(range(0, cu[-1], 16)) <= set(cu.tolist())
        tokens += [t for t in batch["input_ids"].reshape(-1).tolist() if t != 1]
        batches += 1
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"tokens": tokens, "batches": batches, "len": len(loader), "dropped": ds.plan().dropped}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("boundaries", ["positions", "offsets"])
def test_two_ranks_two_workers_under_ddp(tmp_path, corpus, boundaries):
    texts, tokenizer, _ = corpus
    dest = packed(tmp_path, corpus)
    out = str(tmp_path / "result.json")
    run_ranks(_rank_main, 2, (2, str(tmp_path / "store"), dest, out, boundaries))
    ranks = rank_results(out, 2)
    assert ranks[0]["batches"] == ranks[1]["batches"] == ranks[0]["len"] > 0
    seen = ranks[0]["tokens"] + ranks[1]["tokens"]
    assert len(seen) == len(set(seen))  # every token at most once in the epoch
    stream = stream_of(texts, tokenizer)
    windows = len(stream) // 16
    assert 2 * ranks[0]["batches"] * 4 + ranks[0]["dropped"] == windows and ranks[0]["dropped"] < 2 * 2 * 4


def test_resume_is_exact_and_elastic(tmp_path, corpus):
    dest = packed(tmp_path, corpus)

    def loader_over(world=shardstream.World(0, 1), workers=2):
        ds = shardstream.ShardStream(shardstream.Tokens(dest, seq_len=15), batch_size=4, seed=9, shuffle=shardstream.Shuffle(50), world=world)
        return ds, shardstream.make_loader(ds, num_workers=workers)

    _, loader = loader_over()
    whole = list(loader)
    _, loader = loader_over()
    it = iter(loader)
    first = [next(it) for _ in range(7)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    _, resumed = loader_over()
    resumed.load_state_dict(state)
    it = iter(resumed)
    second = [next(it) for _ in range(4)]  # preempted again, during the resumed pass
    state = json.loads(json.dumps(resumed.state_dict()))
    del it
    _, resumed = loader_over()
    resumed.load_state_dict(state)
    rest = second + list(resumed)
    assert len(first) + len(rest) == len(whole)
    for a, b in zip(first + rest, whole):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["position_ids"], b["position_ids"])

    # 2 ranks -> 3 ranks, mid-epoch: the rest of the epoch, no token twice
    seen, state = [], None
    for rank in (0, 1):
        ds, _ = loader_over(shardstream.World(rank, 2))
        it = iter(ds)
        seen += _tokens_of([next(it) for _ in range(5)])
        state = ds.state_dict()
    counts = []
    for rank in (0, 1, 2):
        ds, loader = loader_over(shardstream.World(rank, 3), workers=1)
        loader.load_state_dict(state)
        got = list(loader)
        counts.append(len(got))
        seen += _tokens_of(got)
    assert len(set(counts)) == 1 and counts[0] > 0
    assert len(seen) == len(set(seen))


def test_a_mix_shares_tokens_by_weight(tmp_path, corpus):
    web, code = packed(tmp_path / "web", corpus), packed(tmp_path / "code", corpus)
    sources = [
        shardstream.Source(shardstream.Tokens(web, seq_len=3), weight=0.7, name="web"),
        shardstream.Source(shardstream.Tokens(code, seq_len=3), weight=0.3, name="code"),
    ]
    ds = shardstream.ShardStream(sources, batch_size=4, seed=2, world=shardstream.World(0, 1), schedule=shardstream.Schedule(steps=200))
    names, seen = [], {"web": [], "code": []}
    for batch in ds:
        names += batch["__source__"]
        for name, row in zip(batch["__source__"], batch["input_ids"].tolist()):
            seen[name] += [t for t in row if t != 1]
    assert len(names) == 800 and abs(names.count("web") / len(names) - 0.7) < 0.03
    assert all(len(ids) == len(set(ids)) for ids in seen.values())  # within a pass over each source, no token twice
    with pytest.raises(ConfigError, match="one seq_len"):
        shardstream.ShardStream([sources[0], shardstream.Source(shardstream.Tokens(code, seq_len=4), weight=0.3)], batch_size=4)


def test_a_corpus_on_s3_packs_and_streams_through_the_storage_layer(tmp_path, corpus, s3):
    texts, tokenizer, src = corpus
    bucket, options, _ = s3
    dest = f"s3://{bucket}/tokens"
    result = shardstream.pack_tokens(src, dest, tokenizer=tokenizer, eos=True, max_count=100, storage_options=options)
    stream = stream_of(texts, tokenizer)
    assert result.tokens == len(stream) and shardstream.load_manifest(dest, options).total_tokens == len(stream)
    ds = shardstream.ShardStream(
        shardstream.Tokens(dest, seq_len=63), batch_size=2, shuffle=False, store=shardstream.Store(options), world=shardstream.World(0, 1)
    )
    ids = torch.cat([b["input_ids"] for b in ds]).numpy().reshape(-1)
    assert np.array_equal(ids, stream[: len(ids)]) and len(stream) - len(ids) < 2 * 64
    assert ds.stats()["bytes_read"] >= result.bytes - 4096  # every shard read once, through the counted reads


def interrupted_and_resumed(make, n):
    """(the first ``n`` batches of the loader ``make()`` gives, the batches of a fresh ``make()``
    after loading the state saved there, as JSON): a run stopped after n batches and resumed."""
    first = make()
    it = iter(first)
    head = [next(it) for _ in range(n)]
    state = json.loads(json.dumps(first.state_dict()))
    del it
    resumed = make()
    resumed.load_state_dict(state)
    return head, list(resumed)
