"""``Tokens(boundaries=...)``: what a batch says of where its documents start (position ids,
document ids, cu_seqlens, or nothing), checked against the corpus's documents tokenized here,
with real packed shards, real worker threads and processes, and a resume across settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_tokens import corpus, interrupted_and_resumed, packed  # noqa: F401  (corpus: a fixture)

import shardstream
from shardstream.errors import ConfigError

SEQ_LEN = 15
W = SEQ_LEN + 1
KEYS = {"positions": {"position_ids"}, "documents": {"document_ids"}, "offsets": {"cu_seqlens", "max_seqlen"}, None: set()}


def documents_of(texts: list[str], tokenizer: str) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    end = tok.token_to_id("<|endoftext|>")
    return [np.array(tok.encode(t).ids + [end], dtype=np.int64) for t in texts]


def expected(docs: list[np.ndarray]) -> dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]:
    """Each window of the corpus's stream (its ids) -> (its position ids, its document ids), by
    searching every token's document among the documents' starts."""
    stream = np.concatenate(docs)
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])[:-1]])
    out = {}
    for j in range(len(stream) // W):
        at = np.arange(j * W, (j + 1) * W)
        doc = np.searchsorted(starts, at, side="right") - 1
        positions = at - np.maximum(starts[doc], j * W)
        out[tuple(stream[at].tolist())] = (positions, doc - doc[0])
    return out


def check_batch(batch: dict, boundaries, windows: dict) -> None:
    assert set(batch) == {"input_ids"} | KEYS[boundaries]
    ids = batch["input_ids"]
    assert ids.dtype == torch.int64 and ids.shape[1] == W
    truth = [windows[tuple(row)] for row in ids.tolist()]  # a KeyError: a row that is no window of the corpus
    if boundaries == "positions":
        assert batch["position_ids"].dtype == torch.int64
        assert np.array_equal(batch["position_ids"].numpy(), np.stack([p for p, _ in truth]))
    elif boundaries == "documents":
        assert batch["document_ids"].dtype == torch.int64
        assert np.array_equal(batch["document_ids"].numpy(), np.stack([d for _, d in truth]))
    elif boundaries == "offsets":
        # the batch flattened to B * W: a sequence starts at every document's start and every row's
        flat = np.concatenate([d + 1000 * r for r, (_, d) in enumerate(truth)])
        starts = np.flatnonzero(np.diff(flat, prepend=-1))
        cu = batch["cu_seqlens"]
        assert cu.dtype == torch.int32 and np.array_equal(cu.numpy(), np.append(starts, len(flat)))
        assert batch["max_seqlen"] == int(np.diff(cu.numpy()).max())


@pytest.mark.parametrize("boundaries", ["positions", "documents", "offsets", None])
@pytest.mark.parametrize("workers", [0, "threads", "processes"])
def test_each_setting_against_the_corpus(tmp_path, corpus, boundaries, workers):  # noqa: F811
    texts, tokenizer, _ = corpus
    dest = packed(tmp_path, corpus)
    windows = expected(documents_of(texts, tokenizer))
    ds = shardstream.ShardStream(
        shardstream.Tokens(dest, seq_len=SEQ_LEN, boundaries=boundaries),
        batch_size=4,
        seed=5,
        shuffle=shardstream.Shuffle(50),
        world=shardstream.World(0, 1),
    )
    loader = shardstream.make_loader(ds, num_workers=0 if workers == 0 else 2, **({} if workers == 0 else {"workers": workers}))
    batches = list(loader)
    assert len(batches) == len(ds) > 0
    for batch in batches:
        check_batch(batch, boundaries, windows)
    rows = [tuple(r) for b in batches for r in b["input_ids"].tolist()]
    assert len(rows) == len(set(rows))  # each sequence once in the epoch


def test_a_state_of_one_setting_resumes_another_exactly(tmp_path, corpus):  # noqa: F811
    """The setting is no part of the plan: the same sequences come in the same order, so a state
    written with position ids resumes a run of ids alone (and cu_seqlens), batch for batch."""
    dest = packed(tmp_path, corpus)
    calls = iter(["positions", None])

    def make(boundaries=None):
        ds = shardstream.ShardStream(
            shardstream.Tokens(dest, seq_len=SEQ_LEN, boundaries=boundaries if boundaries is not None else next(calls)),
            batch_size=4,
            seed=9,
            shuffle=shardstream.Shuffle(50),
            world=shardstream.World(0, 1),
        )
        return shardstream.make_loader(ds, num_workers=2, workers="processes")

    whole = list(make("offsets"))
    head, rest = interrupted_and_resumed(make, 7)
    assert len(head) + len(rest) == len(whole)
    assert all(set(b) == {"input_ids", "position_ids"} for b in head) and all(set(b) == {"input_ids"} for b in rest)
    for a, b in zip(head + rest, whole):
        assert torch.equal(a["input_ids"], b["input_ids"])


def test_bad_settings_are_one_clear_error(tmp_path, corpus):  # noqa: F811
    dest = packed(tmp_path, corpus)
    with pytest.raises(ConfigError, match=r"boundaries=.*'positions', 'documents', 'offsets', None.*'segments'"):
        shardstream.Tokens(dest, seq_len=SEQ_LEN, boundaries="segments")
    sources = [
        shardstream.Source(shardstream.Tokens(dest, seq_len=SEQ_LEN), weight=0.5, name="a"),
        shardstream.Source(shardstream.Tokens(dest, seq_len=SEQ_LEN, boundaries=None), weight=0.5, name="b"),
    ]
    with pytest.raises(ConfigError, match="one boundaries="):
        shardstream.ShardStream(sources, batch_size=4)
    json.dumps(shardstream.ShardStream(shardstream.Tokens(dest, seq_len=SEQ_LEN, boundaries=None), batch_size=4).state_dict())


def test_a_documents_ids_are_read_without_parsing_its_header_the_slow_way():
    """``token_vector`` reads what ``np.save`` writes for 1-D integer arrays, and leaves every
    other ``.npy`` (2-D, floats, format 2.0) to ``load_npy``."""
    import io

    from shardstream.pipeline.tokens import token_vector

    def npy(array, version=None):
        buf = io.BytesIO()
        if version is None:
            np.save(buf, array)
        else:
            np.lib.format.write_array(buf, array, version=version)
        return buf.getvalue()

    for array in (np.arange(5, dtype=np.uint16), np.arange(70_000, dtype=np.uint32), np.zeros(0, np.int64), np.arange(3, dtype=">i4")):
        got = token_vector(npy(array))
        assert got is not None and got.dtype == array.dtype and np.array_equal(got, array)
    for other in (npy(np.zeros((2, 2), np.uint16)), npy(np.zeros(3, np.float32)), npy(np.arange(3, dtype=np.uint16), version=(2, 0))):
        assert token_vector(other) is None
    with pytest.raises(ValueError, match="EOF"):
        token_vector(npy(np.arange(10, dtype=np.uint16))[:-4])
