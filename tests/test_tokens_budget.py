"""A run counted in tokens (docs/tokens.md, "A run counted in tokens"): ``Schedule(tokens=T)``
makes a pass the most whole steps whose sequences hold at most T trained tokens (seq_len a
sequence), over all ranks, across data epochs and resumes."""

from __future__ import annotations

import json

import pytest
from test_tokens_documents import EOS, corpus, rows  # noqa: F401  (corpus: the fixture)

import shardstream
from shardstream.errors import ConfigError, StateError

SEQ_LEN, BATCH = 15, 4
BUDGET = 20_000  # tokens: ~3.5 data epochs of the corpus on 2 ranks


def stream(dest, world, budget=BUDGET, batch_size=BATCH, documents=False):
    return shardstream.ShardStream(
        shardstream.Tokens(dest, seq_len=SEQ_LEN),
        batch_size=batch_size,
        seed=4,
        shuffle=shardstream.Shuffle(30, documents=documents),
        world=world,
        schedule=shardstream.Schedule(tokens=budget),
    )


def test_a_budget_in_tokens_is_that_many_sequences_per_rank_across_epochs(corpus):  # noqa: F811
    dest, _ = corpus
    one_epoch = len(shardstream.ShardStream(shardstream.Tokens(dest, seq_len=SEQ_LEN), batch_size=BATCH, world=shardstream.World(0, 2)))
    steps = BUDGET // (2 * BATCH * SEQ_LEN)
    assert steps > 3 * one_epoch  # the budget crosses data epochs
    trained = 0
    for rank in (0, 1):
        ds = stream(dest, shardstream.World(rank, 2), documents=True)
        loader = shardstream.make_loader(ds, num_workers=2)
        got = rows(list(loader))
        assert len(loader) == steps and len(got) == steps * BATCH  # every rank: exactly its share of the budget
        trained += len(got) * SEQ_LEN
    assert BUDGET - 2 * BATCH * SEQ_LEN < trained <= BUDGET
    # 2e9 written as a float is the integer it names
    assert shardstream.Schedule(tokens=2e9).tokens == 2_000_000_000


def test_a_budget_resumes_exactly_and_elastically(corpus):  # noqa: F811
    dest, _ = corpus
    steps = BUDGET // (2 * BATCH * SEQ_LEN)
    loader = shardstream.make_loader(stream(dest, shardstream.World(0, 2)), num_workers=2)
    whole = rows(list(loader))
    loader = shardstream.make_loader(stream(dest, shardstream.World(0, 2)), num_workers=2)
    it = iter(loader)
    first = rows([next(it) for _ in range(steps // 2)])
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["run"] == {"tokens": BUDGET}
    del it
    loader = shardstream.make_loader(stream(dest, shardstream.World(0, 2)), num_workers=2)
    loader.load_state_dict(state)
    assert first + rows(list(loader)) == whole  # the same sequences, in order

    # 2 ranks of batch 4 -> 3 ranks of batch 2 after k steps: the rest of the budget, in steps of the new topology
    k = 40
    for rank in (0, 1):
        ds = stream(dest, shardstream.World(rank, 2))
        it = iter(ds)
        for _ in range(k):
            next(it)
        state = ds.state_dict()
    left = (steps - k) * 2 * BATCH  # sequences of the budget not yet trained on
    after = []
    for rank in (0, 1, 2):
        loader = shardstream.make_loader(stream(dest, shardstream.World(rank, 3), batch_size=2), num_workers=1)
        loader.load_state_dict(state)
        after.append(len(rows(list(loader))))
    assert after == [left // (3 * 2) * 2] * 3
    assert BUDGET - 3 * 2 * SEQ_LEN < (k * 2 * BATCH + sum(after)) * SEQ_LEN <= BUDGET


def test_a_budget_names_itself(tmp_path, corpus):  # noqa: F811
    dest, _ = corpus
    with pytest.raises(ConfigError, match="give steps or tokens, not both"):
        shardstream.Schedule(steps=10, tokens=1000)
    with pytest.raises(ConfigError, match="positive integer"):
        shardstream.Schedule(tokens=0)
    with pytest.raises(ConfigError, match=r"less than one step of batch_size x world_size x seq_len = 120 tokens"):
        stream(dest, shardstream.World(0, 2), budget=100)
    root = tmp_path / "plain"
    with shardstream.ShardWriter(str(root), max_count=10) as w:
        for i in range(20):
            w.write({"__key__": f"{i:04d}", "txt": f"sample {i}"})
    with pytest.raises(ConfigError, match="must be Tokens"):
        shardstream.ShardStream(str(root), batch_size=2, schedule=shardstream.Schedule(tokens=100))
    ds = stream(dest, shardstream.World(0, 1))
    it = iter(ds)
    next(it)
    with pytest.raises(StateError, match=r"by tokens \(tokens=20000 per loader epoch\).*by tokens \(tokens=30000"):
        stream(dest, shardstream.World(0, 1), budget=30_000).load_state_dict(ds.state_dict())
