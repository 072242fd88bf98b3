"""A curriculum: a mix's weights changed at a checkpoint (docs/tokens.md, docs/mixing.md). A state
saved under weights (0.7, 0.3) loads into a stream of the same sources weighted (0.5, 0.5): the
rest of the run follows the new weights, no sequence of a source is used twice in the data epoch,
and a state saved after the change resumes exactly, again."""

from __future__ import annotations

import json

import pytest
import torch
from test_tokens import corpus_texts, train_tokenizer

import shardstream
from shardstream.errors import StateError


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("curriculum")
    out = []
    for name, seed in (("web", 0), ("code", 1)):
        texts = corpus_texts(seed)
        tokenizer = train_tokenizer(texts, str(tmp / f"{name}.json"))
        shardstream.pack_tokens(iter(texts), str(tmp / name), tokenizer=tokenizer, eos=True, max_count=40)
        out.append(str(tmp / name))
    return out


def _loader(corpora, weights, steps=40):
    web, code = corpora
    sources = [
        shardstream.Source(shardstream.Tokens(web, seq_len=15), weight=weights[0], name="web"),
        shardstream.Source(shardstream.Tokens(code, seq_len=15), weight=weights[1], name="code"),
    ]
    ds = shardstream.ShardStream(sources, batch_size=4, seed=3, world=shardstream.World(0, 1), schedule=shardstream.Schedule(steps=steps))
    return shardstream.make_loader(ds, num_workers=2)


def _take(loader, n=None):
    it = iter(loader)
    got = [next(it) for _ in range(n)] if n is not None else list(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return got, state


def _rows(batches):
    return [(name, tuple(row)) for b in batches for name, row in zip(b["__source__"], b["input_ids"].tolist())]


def test_new_weights_at_a_checkpoint_are_followed_and_no_sequence_repeats(corpora):
    first, state = _take(_loader(corpora, (0.7, 0.3)), 10)  # 40 sequences at 0.7 / 0.3
    assert sum(name == "web" for name, _ in _rows(first)) == 28

    after = _loader(corpora, (0.5, 0.5))
    after.load_state_dict(state)
    summary = after.dataset.resume_plan(2).summary()
    assert "with new asks (web: weight 0.7 -> weight 0.5, code: weight 0.3 -> weight 0.5)" in summary
    rest, saved = _take(after)
    assert len(first) + len(rest) == 40  # the pass is the run's 40 steps, as before the change
    names = [name for name, _ in _rows(rest)]
    assert abs(names.count("web") - 60) <= 1  # 120 sequences at 0.5 / 0.5
    assert all(abs(sum(n == "web" for n in b["__source__"]) - 2) <= 1 for b in rest)  # spread over every batch
    rows = _rows(first + rest)
    assert len(rows) == len(set(rows))  # within the data epoch each source's sequences once
    # the saved state says under which asks its first segment was laid out
    assert saved["segments"][0]["asks"] == ["weight 0.7", "weight 0.3"] and "asks" not in saved["segments"][-1]

    # preempted again after the change: resumed with the new weights, it is exact
    again = _loader(corpora, (0.5, 0.5))
    again.load_state_dict(state)
    head, state2 = _take(again, 12)
    resumed = _loader(corpora, (0.5, 0.5))
    resumed.load_state_dict(state2)
    assert "exactly" in resumed.dataset.resume_plan(2).summary()
    tail, _ = _take(resumed)
    assert len(head) + len(tail) == len(rest)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) and a["__source__"] == b["__source__"] for a, b in zip(head + tail, rest))

    # the next pass is a fresh one under the new weights
    nxt = _loader(corpora, (0.5, 0.5))
    nxt.load_state_dict(saved)
    nxt.set_epoch(1)
    names = [name for name, _ in _rows(_take(nxt)[0])]
    assert len(names) == 160 and abs(names.count("web") - 80) <= 1


def test_a_lone_source_asking_another_share_is_still_refused(corpora):
    web = corpora[0]

    def stream(repeat):
        source = shardstream.Source(shardstream.Tokens(web, seq_len=15), repeat=repeat, name="web")
        return shardstream.ShardStream([source], batch_size=4, world=shardstream.World(0, 1))

    ds = stream(0.5)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    with pytest.raises(StateError, match="another mix|asking"):
        stream(0.75).load_state_dict(state)


def test_new_weights_onto_another_world_size(corpora):
    """Saved on 1 rank under 0.7 / 0.3, resumed on 2 ranks under 0.5 / 0.5: equal batches on both
    ranks, the new shares, and no sequence of a source used twice in the data epoch."""
    first, state = _take(_loader(corpora, (0.7, 0.3)), 10)
    web, code = corpora
    rows, counts = _rows(first), []
    for rank in (0, 1):
        sources = [
            shardstream.Source(shardstream.Tokens(web, seq_len=15), weight=0.5, name="web"),
            shardstream.Source(shardstream.Tokens(code, seq_len=15), weight=0.5, name="code"),
        ]
        ds = shardstream.ShardStream(sources, batch_size=4, seed=3, world=shardstream.World(rank, 2), schedule=shardstream.Schedule(steps=40))
        ds.load_state_dict(state)
        got = list(ds)
        counts.append(len(got))
        rows += _rows(got)
    assert counts == [30, 30]
    assert len(rows) == len(set(rows))
    names = [name for name, _ in rows[40:]]
    assert abs(names.count("web") - 120) <= 2


def _ddp_rank(rank: int, world: int, store: str, corpora: list[str], weights: list[float], take: int, state_in: str, out: str) -> None:
    """One gloo rank of a curriculum: 2 loader workers, a DDP step per batch (a rank with fewer
    batches would hang the all-reduce); ``take`` batches (0: the rest of the pass), then its
    rows and the loader's state to ``out.RANK``."""
    import datetime
    import os

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Embedding(8192, 2))
    web, code = corpora
    sources = [
        shardstream.Source(shardstream.Tokens(web, seq_len=15), weight=weights[0], name="web"),
        shardstream.Source(shardstream.Tokens(code, seq_len=15), weight=weights[1], name="code"),
    ]
    ds = shardstream.ShardStream(sources, batch_size=4, seed=3, schedule=shardstream.Schedule(steps=40))
    loader = shardstream.make_loader(ds, num_workers=2)
    if state_in:
        with open(state_in) as f:
            loader.load_state_dict(json.load(f))
    it = iter(loader)
    got = []
    for batch in it:
        model(batch["input_ids"][:, :-1]).sum().backward()
        got.append(batch)
        if len(got) == take:
            break
    state = loader.state_dict()
    del it
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rows": _rows(got), "state": state, "len": len(loader)}, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_new_weights_at_a_checkpoint_under_ddp(corpora, tmp_path):
    """2 gloo ranks of 2 workers each: 10 steps under 0.7 / 0.3, the checkpoint, the rest of the
    40 steps under 0.5 / 0.5 in a new job: equal batches on both ranks, the new shares, no sequence
    of a source twice in the data epoch, and each rank's rest the batches the plan gives its rank."""
    from conftest import rank_results, run_ranks

    first = str(tmp_path / "first")
    run_ranks(_ddp_rank, 2, (2, str(tmp_path / "store1"), corpora, [0.7, 0.3], 10, "", first))
    before = rank_results(first, 2)
    assert before[0]["state"] == before[1]["state"]  # every rank saves the same state
    state = str(tmp_path / "state.json")
    with open(state, "w") as f:
        json.dump(before[0]["state"], f)
    rest = str(tmp_path / "rest")
    run_ranks(_ddp_rank, 2, (2, str(tmp_path / "store2"), corpora, [0.5, 0.5], 0, state, rest))
    after = rank_results(rest, 2)

    rows = [(r[0], tuple(r[1])) for side in (before, after) for rank in side for r in rank["rows"]]
    assert [len(r["rows"]) for r in before] == [40, 40] and [len(r["rows"]) for r in after] == [120, 120]  # 30 steps of 4 on each rank
    assert len(rows) == len(set(rows))  # within the data epoch each source's sequences once, over both ranks and jobs
    assert abs(sum(r[0] == "web" for rank in before for r in rank["rows"]) - 56) <= 1  # 80 sequences at 0.7
    assert abs(sum(r[0] == "web" for rank in after for r in rank["rows"]) - 120) <= 2  # 240 at 0.5
    for rank in (0, 1):  # the same batches as the plan gives each rank, read in one process
        web, code = corpora
        sources = [
            shardstream.Source(shardstream.Tokens(web, seq_len=15), weight=0.5, name="web"),
            shardstream.Source(shardstream.Tokens(code, seq_len=15), weight=0.5, name="code"),
        ]
        ds = shardstream.ShardStream(sources, batch_size=4, seed=3, world=shardstream.World(rank, 2), schedule=shardstream.Schedule(steps=40))
        loader = shardstream.make_loader(ds, num_workers=2)
        with open(state) as f:
            loader.load_state_dict(json.load(f))
        expected = [[name, list(row)] for name, row in _rows(list(loader))]
        assert after[rank]["rows"] == expected
