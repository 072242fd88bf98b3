"""Shuffled documents (docs/tokens.md, "Shuffle documents"): ``Shuffle(documents=True)`` lays every
shard's documents in a new order each epoch before the shard is cut into sequences.

The corpus is test_tokens.py's: every word distinct, so every token id but the EOS id (1) names
one place in one document, and a sequence can be read back as the runs of documents it holds."""

from __future__ import annotations

import json

import pytest
import torch
from test_tokens import corpus_texts, interrupted_and_resumed, train_tokenizer

import shardstream
from shardstream.errors import ConfigError, StateError

EOS = 1
PER_SHARD = 40  # documents per shard (pack_tokens(max_count=40))


@pytest.fixture
def corpus(tmp_path):
    """(root of the packed corpus, each document's token ids with its EOS)."""
    from tokenizers import Tokenizer

    texts = corpus_texts()
    tokenizer = train_tokenizer(texts, str(tmp_path / "tokenizer.json"))
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    dest = str(tmp_path / "tokens")
    shardstream.pack_tokens(str(src), dest, tokenizer=tokenizer, eos=True, max_count=PER_SHARD)
    tok = Tokenizer.from_file(tokenizer)
    return dest, [tok.encode(t).ids + [EOS] for t in texts]


def stream(dest, *, documents=True, buffer=50, epoch=0, world=None, batch_size=4, seed=3, schedule=None):
    ds = shardstream.ShardStream(
        shardstream.Tokens(dest, seq_len=15),
        batch_size=batch_size,
        seed=seed,
        shuffle=shardstream.Shuffle(buffer, documents=documents),
        world=world or shardstream.World(0, 1),
        schedule=schedule,
    )
    ds.set_epoch(epoch)
    return ds


def rows(batches) -> list[tuple[int, ...]]:
    return [tuple(r) for b in batches for r in b["input_ids"].tolist()]


def tokens_of(batches) -> list[int]:
    return [t for r in rows(batches) for t in r if t != EOS]


def runs(batches, docs) -> list[list[int]]:
    """Each row as the documents it holds, in order; asserts that every run between document
    starts (position 0) is one document's tokens, contiguous and in order, from the document's
    first token wherever the run starts after the row's first column."""
    where = {t: (d, k) for d, ids in enumerate(docs) for k, t in enumerate(ids) if t != EOS}
    out = []
    for b in batches:
        for ids, pos in zip(b["input_ids"].tolist(), b["position_ids"].tolist()):
            cuts = [j for j, p in enumerate(pos) if p == 0] + [len(ids)]
            held = []
            for a, z in zip(cuts, cuts[1:]):
                piece = ids[a:z]
                if piece[0] == EOS:  # the row starts at a document's last token (its EOS)
                    assert a == 0 and len(piece) == 1
                    continue
                d, k = where[piece[0]]
                assert a == 0 or k == 0, "a document starts at its first token"
                assert piece == docs[d][k : k + len(piece)], "a document's tokens stay together, in order"
                held.append(d)
            out.append(held)
    return out


def neighbours(held: list[list[int]]) -> set[tuple[int, int]]:
    return {(a, b) for row in held for a, b in zip(row, row[1:])}


def test_documents_change_places_every_epoch_and_each_token_is_used_once(corpus):
    dest, docs = corpus
    contents = {}
    for documents in (False, True):
        for epoch in (0, 1):
            seen, batches, lengths = [], [], []
            for rank in (0, 1):
                ds = stream(dest, documents=documents, epoch=epoch, world=shardstream.World(rank, 2))
                loader = shardstream.make_loader(ds, num_workers=2)
                got = list(loader)
                lengths += [len(got), len(loader)]
                seen += tokens_of(got)
                batches += got
            assert len(set(lengths)) == 1 and lengths[0] > 0  # every rank the same number of batches
            assert len(seen) == len(set(seen))  # no token twice in the epoch, across ranks and workers
            pairs = neighbours(runs(batches, docs))
            if documents:
                assert any(b != a + 1 for a, b in pairs)  # documents side by side that are not in the corpus
                # a document moves within its shard: its neighbour is of its shard, or the next shard's at a boundary
                assert all(b // PER_SHARD in (a // PER_SHARD, a // PER_SHARD + 1) for a, b in pairs)
            else:
                assert all(b == a + 1 for a, b in pairs)
            contents[documents, epoch] = set(rows(batches))
    # Every sequence of an epoch (one rank, batches of 1: none left out). Shuffle(buffer) alone
    # moves the same sequences around; documents=True makes other sequences each epoch.
    plain = [set(rows(stream(dest, documents=False, epoch=e, batch_size=1))) for e in (0, 1)]
    shuffled = [set(rows(stream(dest, epoch=e, batch_size=1))) for e in (0, 1)]
    assert plain[0] == plain[1] and shuffled[0] != shuffled[1] and len(shuffled[0]) == len(shuffled[1]) == len(plain[0])
    assert all(contents[False, e] <= plain[e] and contents[True, e] <= shuffled[e] for e in (0, 1))
    assert not contents[True, 0] <= plain[0]


def test_a_sequence_is_a_function_of_the_plan_on_any_topology(corpus):
    """Resume on the same topology: the same batches bit for bit; on 3 ranks after 2: every
    sequence not yet consumed once, each one of the epoch's sequences (as one rank of batch 1,
    which uses them all, has them)."""
    dest, docs = corpus
    epoch = 1
    every = set(rows(stream(dest, epoch=epoch, batch_size=1, buffer=0)))

    def loader_over(world=None, workers=2):
        ds = stream(dest, epoch=epoch, world=world)
        return shardstream.make_loader(ds, num_workers=workers)

    whole = list(loader_over())
    first, rest = interrupted_and_resumed(loader_over, 7)
    assert len(first) + len(rest) == len(whole)
    for a, b in zip(first + rest, whole):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["position_ids"], b["position_ids"])
    assert set(rows(whole)) <= every

    # 2 ranks -> 3 ranks, mid-epoch
    seen, got_rows, state = [], [], None
    for rank in (0, 1):
        ds = stream(dest, epoch=epoch, world=shardstream.World(rank, 2))
        it = iter(ds)
        consumed = [next(it) for _ in range(5)]
        seen += tokens_of(consumed)
        got_rows += rows(consumed)
        state = ds.state_dict()
    counts = []
    for rank in (0, 1, 2):
        loader = loader_over(shardstream.World(rank, 3), workers=1)
        loader.load_state_dict(state)
        got = list(loader)
        counts.append(len(got))
        seen += tokens_of(got)
        got_rows += rows(got)
        runs(got, docs)
    assert len(set(counts)) == 1 and counts[0] > 0
    assert len(seen) == len(set(seen))  # every token at most once over the interrupted epoch
    assert set(got_rows) <= every  # the same sequences the epoch holds on any topology


def test_a_run_by_steps_shuffles_each_data_epoch_anew(corpus):
    dest, docs = corpus
    one = len(stream(dest))  # batches of one data epoch
    steps = 2 * one + 3
    ds = stream(dest, schedule=shardstream.Schedule(steps=steps))
    batches = list(shardstream.make_loader(ds, num_workers=2))
    assert len(batches) == steps
    epochs = [set(rows(stream(dest, epoch=e, batch_size=1, buffer=0))) for e in (0, 1, 2)]
    for e in (0, 1, 2):
        part = batches[e * one : (e + 1) * one]
        assert set(rows(part)) <= epochs[e]
        mine = tokens_of(part)
        assert len(mine) == len(set(mine))
        runs(part, docs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_a_mix_shuffles_each_sources_documents(tmp_path, corpus):
    dest, docs = corpus

    def mix(documents):
        sources = [
            shardstream.Source(shardstream.Tokens(dest, seq_len=15), weight=0.6, name="a"),
            shardstream.Source(shardstream.Tokens(dest, seq_len=15), weight=0.4, name="b"),
        ]
        shuffle = shardstream.Shuffle(20, documents=documents)
        return shardstream.ShardStream(sources, batch_size=4, seed=5, shuffle=shuffle, world=shardstream.World(0, 1))

    batches = list(shardstream.make_loader(mix(True), num_workers=2))
    pairs = neighbours(runs(batches, docs))
    assert any(b != a + 1 for a, b in pairs)
    for name in ("a", "b"):
        mine = [t for b in batches for n, r in zip(b["__source__"], b["input_ids"].tolist()) if n == name for t in r if t != EOS]
        assert len(mine) == len(set(mine))  # within a source's epoch, no token twice
    plain = list(mix(False))
    assert all(b == a + 1 for a, b in neighbours(runs(plain, docs)))


def test_a_state_names_whether_documents_were_shuffled(corpus):
    dest, _ = corpus
    for saved, now in ((False, True), (True, False)):
        ds = stream(dest, documents=saved)
        it = iter(ds)
        next(it)
        state = ds.state_dict()
        with pytest.raises(StateError, match=rf"Shuffle\(documents={saved}\) but this ShardStream has Shuffle\(documents={now}\)"):
            stream(dest, documents=now).load_state_dict(state)


def test_documents_are_a_token_corpus_s(tmp_path):
    root = tmp_path / "plain"
    with shardstream.ShardWriter(str(root), max_count=10) as w:
        for i in range(20):
            w.write({"__key__": f"{i:04d}", "txt": f"sample {i}"})
    with pytest.raises(ConfigError, match="must be Tokens"):
        shardstream.ShardStream(str(root), batch_size=2, shuffle=shardstream.Shuffle(10, documents=True))
    with pytest.raises(ConfigError, match="True or False"):
        shardstream.Shuffle(10, documents="yes")  # type: ignore[arg-type]
