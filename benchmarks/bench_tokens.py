"""Token sequences into torch batches: ``ShardStream(Tokens(root, seq_len))`` against an in-memory
numpy floor, in one run, medians of CPU-time rates (tokens per CPU second of this process and its
workers: the machine these run on is shared, where wall time measures the neighbours).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tokens.py [--tokens 20000000] [--seq-len 2048]
        [--batch 8] [--workers 0,2] [--repeats 3]

Contenders:

- ``floor``: every document's array already in memory, concatenated once (not timed), then
  windows of ``seq_len + 1`` tokens cut in order as int64 with their position ids (a
  ``searchsorted`` over the documents' starts), ``torch.from_numpy`` per batch: no shards, no
  plan, no shuffle, no workers;
- ``shardstream`` / ``shardstream-shuffled``: ``ShardStream(Tokens(root, seq_len), batch_size,
  shuffle=False | Shuffle(1000))`` through ``make_loader(num_workers=W)``: the shards read from
  /dev/shm (a warm page cache), parsed, planned and cut into the same batches;
- ``parquet``: the same documents as a Parquet table written by pyarrow (a ``list<uint16>``
  ``input_ids`` column, row groups of 1,000 rows: what a tokenizer's ``datasets.map`` writes),
  ``ShardStream(Tokens(table, seq_len))``, no shuffle.

The corpus: ``--tokens`` uint16 tokens in documents of 50..4000 tokens (seeded), in shards of
1,000 documents, written with ``ShardWriter`` as ``pack_tokens`` writes them (no tokenizer is run:
packing is not what is measured).
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import shutil
import statistics
import tempfile

import numpy as np
import torch

import shardstream
from shardstream.write.writer import ShardWriter


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def write_corpus(root: str, tokens: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < tokens:
        n = int(rng.integers(50, 4000))
        docs.append(rng.integers(0, 50_000, n, dtype=np.uint16))
        total += n
    info = {"dtype": "uint16", "vocab_size": 50_000, "eos_id": None, "field": "tokens.npy", "tokenizer": "synthetic", "text_field": None}
    with ShardWriter(root, max_count=1000, max_size=1 << 34, check_unique_keys=False, token_info=info) as writer:
        for k, doc in enumerate(docs):
            buf = io.BytesIO()
            np.save(buf, doc, allow_pickle=False)
            writer.write_encoded(f"{k:012d}", {"tokens.npy": buf.getvalue()}, tokens=len(doc))
    return docs


def floor(docs: list[np.ndarray], seq_len: int, batch: int) -> tuple[int, float]:
    stream = np.concatenate(docs)
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])[:-1]])
    width = seq_len + 1
    n = len(stream) // width // batch
    began = cpu_seconds()
    got = 0
    for b in range(n):
        a = b * batch * width
        ids = torch.from_numpy(stream[a : a + batch * width].astype(np.int64).reshape(batch, width))
        at = np.arange(a, a + batch * width, dtype=np.int64).reshape(batch, width)
        begins = np.maximum(starts[np.searchsorted(starts, at, side="right") - 1], at[:, :1])
        positions = torch.from_numpy(at - begins)
        got += ids.numel()
        assert positions.shape == ids.shape
    return got, cpu_seconds() - began


def write_table(path: str, docs: list[np.ndarray]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(docs)))
    pq.write_table(pa.table({"input_ids": column}), path, row_group_size=1000)


def stream(root: str, seq_len: int, batch: int, workers: int, shuffled: bool) -> tuple[int, float]:
    shuffle = shardstream.Shuffle(1000) if shuffled else False
    ds = shardstream.ShardStream(shardstream.Tokens(root, seq_len=seq_len), batch_size=batch, shuffle=shuffle, world=shardstream.World(0, 1))
    loader = shardstream.make_loader(ds, num_workers=workers, pin_memory=False)
    began = cpu_seconds()
    got = 0
    for b in loader:
        got += b["input_ids"].numel()
    return got, cpu_seconds() - began


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", default="0,2")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="bench-tokens-", dir=base)
    try:
        docs = write_corpus(os.path.join(root, "corpus"), args.tokens)
        write_table(os.path.join(root, "table.parquet"), docs)
        runs: dict[str, list[float]] = {}
        for _ in range(args.repeats):  # interleaved: each repeat runs every contender once
            got, cpu = floor(docs, args.seq_len, args.batch)
            runs.setdefault("floor", []).append(got / cpu)
            for w in (int(x) for x in args.workers.split(",")):
                for shuffled in (False, True):
                    got, cpu = stream(os.path.join(root, "corpus"), args.seq_len, args.batch, w, shuffled)
                    runs.setdefault(f"shardstream{'-shuffled' if shuffled else ''} workers={w}", []).append(got / cpu)
                got, cpu = stream(os.path.join(root, "table.parquet"), args.seq_len, args.batch, w, False)
                runs.setdefault(f"parquet workers={w}", []).append(got / cpu)
        best = statistics.median(runs["floor"])
        print(f"{args.tokens} tokens, seq_len {args.seq_len}, batch {args.batch}: tokens per CPU second (median of {args.repeats})")
        for name, rates in runs.items():
            rate = statistics.median(rates)
            print(f"  {name:34s} {rate / 1e6:8.1f} M/s  {rate / best:5.2f} x floor")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
