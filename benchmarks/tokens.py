"""tokens: token sequences into torch batches: ``ShardStream(Tokens(root, seq_len))`` against an
in-memory numpy floor (from bench_tokens.py). Tokens per wall second; the records keep CPU too.

The corpus: ``--tokens`` uint16 tokens in documents of 50..4000 tokens (seeded), shards of 1,000
documents, written with ``ShardWriter`` as ``pack_tokens`` writes them (no tokenizer is run).
Peers: ``shardstream`` (``--shuffle`` for ``Shuffle(1000)``), ``floor`` (the documents already
in memory, concatenated once before the clock, cut into the same windows with position ids).
"""

from __future__ import annotations

import io
import os

UNIT = "tokens/s"
PEERS = ("shardstream", "floor")


def add_arguments(p) -> None:
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--shuffle", action="store_true", help="shardstream with Shuffle(1000)")


def documents(tokens: int):
    import numpy as np

    rng = np.random.default_rng(0)
    docs, total = [], 0
    while total < tokens:
        n = int(rng.integers(50, 4000))
        docs.append(rng.integers(0, 50_000, n, dtype=np.uint16))
        total += n
    return docs


def prepare(args, runner, peers: list[str]) -> list[dict]:
    import numpy as np

    from shardstream import ShardWriter

    root = os.path.join(args.workdir, f"tokens-{args.tokens}")
    if not os.path.exists(os.path.join(root, "index.json")):
        info = {"dtype": "uint16", "vocab_size": 50_000, "eos_id": None, "field": "tokens.npy", "tokenizer": "synthetic", "text_field": None}
        with ShardWriter(root, max_count=1000, max_size=1 << 34, check_unique_keys=False, token_info=info, overwrite=True) as writer:
            for k, doc in enumerate(documents(args.tokens)):
                buf = io.BytesIO()
                np.save(buf, doc, allow_pickle=False)
                writer.write_encoded(f"{k:012d}", {"tokens.npy": buf.getvalue()}, tokens=len(doc))
    base = {"tokens": args.tokens, "seq_len": args.seq_len, "batch": args.batch, "shuffle": args.shuffle, "runtime": args.runtime, "_root": root}
    return [{"workers": w, **base} for w in args.workers]


def skip(peer: str, config: dict) -> bool:
    return peer == "floor" and config["workers"] > 0


def measure(config: dict) -> dict:
    import numpy as np
    import torch

    from benchmarks.harness import timed_pass

    seq_len, batch = config["seq_len"], config["batch"]
    if config["peer"] == "floor":
        docs = documents(config["tokens"])
        stream = np.concatenate(docs)
        starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])[:-1]])
        width = seq_len + 1

        def batches():
            for b in range(len(stream) // width // batch):
                a = b * batch * width
                ids = torch.from_numpy(stream[a : a + batch * width].astype(np.int64).reshape(batch, width))
                at = np.arange(a, a + batch * width, dtype=np.int64).reshape(batch, width)
                begins = np.maximum(starts[np.searchsorted(starts, at, side="right") - 1], at[:, :1])
                yield {"input_ids": ids, "position_ids": torch.from_numpy(at - begins)}

        return timed_pass(batches, lambda b: b["input_ids"].numel())

    def make():
        from benchmarks.harness import loader_options
        from shardstream import ShardStream, Shuffle, Tokens, World, make_loader

        shuffle = Shuffle(1000) if config["shuffle"] else False
        ds = ShardStream(Tokens(config["_root"], seq_len=seq_len), batch_size=batch, shuffle=shuffle, world=World(0, 1))
        return make_loader(ds, num_workers=config["workers"], **loader_options(config))

    return timed_pass(make, lambda b: b["input_ids"].numel())
