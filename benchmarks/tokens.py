"""tokens: token sequences into torch batches: ``ShardStream(Tokens(root, seq_len))`` against
litData's ``TokensLoader``, Grain's concat-then-split packing and an in-memory numpy floor.
Tokens per wall second; the records keep CPU too.

The corpus: ``--tokens`` uint16 tokens in documents of 50..4000 tokens (seeded), shards of 1,000
documents, written with ``ShardWriter`` as ``pack_tokens`` writes them (no tokenizer is run).
Peers, each reading the same documents in the same order from files of its own format:

- ``shardstream`` (``--shuffle`` for ``Shuffle(1000)``, and ``--documents`` for
  ``Shuffle(1000, documents=True)``): ``input_ids`` and, by ``--boundaries``
  (``Tokens(boundaries=...)``), ``position_ids`` (the default), ``document_ids``, ``cu_seqlens``
  and ``max_seqlen``, or nothing (``none``).
- ``litdata``: ``litdata.optimize(..., item_loader=TokensLoader())`` chunks of the documents
  end to end, ``StreamingDataset(item_loader=TokensLoader(block_size=seq_len + 1))`` and
  ``StreamingDataLoader`` (``--shuffle``: ``shuffle=True``). Its blocks are the same windows of
  the same stream; it yields the ids alone (no positions: it does not know where documents start).
- ``grain``: an ArrayRecord file, one record per document's ids, ``MapDataset.source(...)``,
  ``ConcatThenSplitIterDataset`` into windows of ``seq_len + 1`` (ids, positions and segment ids),
  ``.batch()``, and ``mp_prefetch`` over the workers (``--shuffle``: ``.shuffle(seed)``, of
  documents). Its split keeps a document whole in a window where it fits, so its windows are not
  byte for byte the others'.
- ``floor``: the documents already in memory, concatenated once before the clock, cut into the
  same windows with what ``--boundaries`` asks, each token's document found by a search of the
  documents' starts (``none``: the ids alone, a reshaped slice of the stream).
"""

from __future__ import annotations

import io
import os

UNIT = "tokens/s"
PEERS = ("shardstream", "litdata", "grain", "floor")
BOUNDARIES = ("positions", "documents", "offsets", "none")


def add_arguments(p) -> None:
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--shuffle", action="store_true", help="shardstream with Shuffle(1000), litData shuffle=True, Grain .shuffle(seed)")
    p.add_argument("--documents", action="store_true", help="shardstream with Shuffle(1000, documents=True) (with --shuffle)")
    p.add_argument(
        "--boundaries",
        choices=BOUNDARIES,
        default="positions",
        help="what shardstream and the floor yield beside the ids: Tokens(boundaries=...), none for None (default positions)",
    )


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
    if "litdata" in peers:
        runner.call("litdata", "tokens", "make_litdata", {"tokens": args.tokens, "root": root + "-litdata"})
    if "grain" in peers:
        runner.call("grain", "tokens", "make_grain", {"tokens": args.tokens, "root": root + "-grain"})
    base = {"tokens": args.tokens, "seq_len": args.seq_len, "batch": args.batch, "shuffle": args.shuffle, "documents": args.documents}
    base["boundaries"] = args.boundaries
    base.update({"runtime": args.runtime, "_root": root})
    base.update({"_litdata": root + "-litdata", "_grain": os.path.join(root + "-grain", "docs.array_record")})
    return [{"workers": w, **base} for w in args.workers]


def _litdata_docs(tokens: int):
    yield from documents(tokens)  # uint16 arrays, written end to end


def make_litdata(config: dict) -> dict:
    """The corpus as litData's token chunks (in litData's venv); once."""
    if os.path.exists(os.path.join(config["root"], "index.json")):
        return {"made": False}
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    litdata.optimize(
        fn=_litdata_docs,
        inputs=[config["tokens"]],
        output_dir=config["root"],
        chunk_size=2049 * 4096,
        item_loader=TokensLoader(),
        num_workers=1,
        mode="overwrite",
        verbose=False,
    )
    return {"made": True}


def make_grain(config: dict) -> dict:
    """The corpus as one ArrayRecord file, a record per document's uint16 ids (in Grain's venv); once."""
    path = os.path.join(config["root"], "docs.array_record")
    if os.path.exists(path):
        return {"made": False}
    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(config["root"], exist_ok=True)
    writer = ArrayRecordWriter(path + ".tmp", "group_size:1")
    for doc in documents(config["tokens"]):
        writer.write(doc.tobytes())
    writer.close()
    os.replace(path + ".tmp", path)
    return {"made": True}


def _grain_ids(record: bytes) -> dict:
    import numpy as np

    return {"input_ids": np.frombuffer(record, dtype=np.uint16).astype(np.int64)}


def _grain_torch(batch: dict) -> dict:
    import torch

    return {"input_ids": torch.from_numpy(batch["input_ids"]), "position_ids": torch.from_numpy(batch["input_ids_positions"])}


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
        boundaries = config.get("boundaries", "positions")

        def batches():
            for b in range(len(stream) // width // batch):
                a = b * batch * width
                ids = torch.from_numpy(stream[a : a + batch * width].astype(np.int64).reshape(batch, width))
                if boundaries == "none":
                    yield {"input_ids": ids}
                    continue
                at = np.arange(a, a + batch * width, dtype=np.int64).reshape(batch, width)
                doc = np.searchsorted(starts, at, side="right") - 1
                if boundaries == "documents":
                    yield {"input_ids": ids, "document_ids": torch.from_numpy(doc - doc[:, :1])}
                elif boundaries == "offsets":
                    flat = (doc + (np.arange(batch) * len(starts))[:, None]).reshape(-1)  # a row's first token starts a sequence too
                    cu = np.append(np.flatnonzero(np.diff(flat, prepend=-1)), batch * width).astype(np.int32)
                    yield {"input_ids": ids, "cu_seqlens": torch.from_numpy(cu), "max_seqlen": int(np.diff(cu).max())}
                else:
                    begins = np.maximum(starts[doc], at[:, :1])
                    yield {"input_ids": ids, "position_ids": torch.from_numpy(at - begins)}

        return timed_pass(batches, lambda b: b["input_ids"].numel())

    width = seq_len + 1
    if config["peer"] == "litdata":
        import litdata
        from litdata.streaming.item_loader import TokensLoader

        def make_litdata():
            ds = litdata.StreamingDataset(
                input_dir=config["_litdata"], item_loader=TokensLoader(block_size=width), shuffle=config["shuffle"], drop_last=True
            )
            return litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=config["workers"], drop_last=True)

        return timed_pass(make_litdata, lambda b: b.numel())
    if config["peer"] == "grain":
        import grain
        from grain.experimental import ConcatThenSplitIterDataset
        from grain.sources import ArrayRecordDataSource

        def make_grain():
            docs = grain.MapDataset.source(ArrayRecordDataSource([config["_grain"]]))
            if config["shuffle"]:
                docs = docs.shuffle(seed=0)
            docs = docs.map(_grain_ids)
            windows = ConcatThenSplitIterDataset(docs.to_iter_dataset(), length_struct={"input_ids": width})
            batches = windows.batch(batch, drop_remainder=True).map(_grain_torch)
            if config["workers"]:
                batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=config["workers"]))
            return batches

        return timed_pass(make_grain, lambda b: b["input_ids"].numel())

    def make():
        from benchmarks.harness import loader_options
        from shardstream import ShardStream, Shuffle, Tokens, World, make_loader

        shuffle = Shuffle(1000, documents=config.get("documents", False)) if config["shuffle"] else False
        boundaries = config.get("boundaries", "positions")
        tokens = Tokens(config["_root"], seq_len=seq_len, boundaries=None if boundaries == "none" else boundaries)
        ds = ShardStream(tokens, batch_size=batch, shuffle=shuffle, world=World(0, 1))
        return make_loader(ds, num_workers=config["workers"], **loader_options(config))

    return timed_pass(make, lambda b: b["input_ids"].numel())
