"""small: small samples (a 1 KiB ``.bin`` payload and a JSON label) through the user's own
function and torch's ``default_collate``, batch 64, no shuffle, one pass, timed from the
loader's construction (from bench_small.py).

Peers: ``shardstream`` (``decode=False``, the function as ``transform``), ``webdataset``
(``.map(fn).batched(64)`` + ``WebLoader``), ``litdata`` (``StreamingDataset(transform=fn)`` over
chunks ``litdata.optimize`` wrote from the same bytes), ``torch`` (a map-style dataset of the
samples already in memory under torch's ``DataLoader``: the floor with workers). ``--writer
webdataset`` has webdataset's ``TarWriter`` write the shards (in its venv) and ``shardstream
index`` index them in place, as docs/from-webdataset.md says.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

UNIT = "samples/s"
PEERS = ("shardstream", "webdataset", "litdata", "torch")
BATCH = 64


def add_arguments(p) -> None:
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--per-shard", type=int, default=10_000)
    p.add_argument("--writer", choices=("shardstream", "webdataset"), default="shardstream", help="who writes the tar shards")


def samples(n: int):
    """The same bytes in every venv: (key, payload, label JSON)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for i in range(n):
        yield f"{i:08d}", rng.bytes(1024), json.dumps({"label": i % 1000}).encode()


def digest(n: int) -> str:
    h = hashlib.sha256()
    for key, payload, label in samples(n):
        h.update(key.encode() + payload + label)
    return h.hexdigest()[:16]


def fn(sample):
    """The user's function, the same in every loader (litData hands ``bytes`` over as memoryviews)."""
    import torch

    return {"x": torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8), "y": json.loads(bytes(sample["json"]))["label"]}


def make_tars(config: dict) -> str:
    from shardstream import ShardWriter

    with ShardWriter(config["root"], max_count=config["per_shard"], overwrite=True) as w:
        for key, payload, label in samples(config["n"]):
            w.write_encoded(key, {"bin": payload, "json": label})
    return digest(config["n"])


def make_wds_tars(config: dict) -> str:
    import webdataset as wds

    root, per = config["root"], config["per_shard"]
    os.makedirs(root, exist_ok=True)
    writer = None
    for i, (key, payload, label) in enumerate(samples(config["n"])):
        if i % per == 0:
            if writer is not None:
                writer.close()
            writer = wds.TarWriter(os.path.join(root, f"shard-{i // per:06d}.tar"))
        writer.write({"__key__": key, "bin": payload, "json": label})
    if writer is not None:
        writer.close()
    return digest(config["n"])


def _litdata_items(span):
    start, stop = span
    for key, payload, label in samples(stop):
        if int(key) >= start:
            yield {"bin": payload, "json": label}


def make_litdata(config: dict) -> str:
    import litdata

    n, per = config["n"], config["per_shard"]
    spans = [(s, min(s + per, n)) for s in range(0, n, per)]
    litdata.optimize(fn=_litdata_items, inputs=spans, output_dir=config["root"], chunk_bytes="64MB", num_workers=1, mode="overwrite", verbose=False)
    return digest(n)


def prepare(args, runner, peers: list[str]) -> list[dict]:
    data = os.path.join(args.workdir, f"small-{args.writer}-{args.samples}")
    tars, chunks = os.path.join(data, "tars"), os.path.join(data, "litdata")
    stamp = os.path.join(data, "built")
    want = {"root": tars, "n": args.samples, "per_shard": args.per_shard}
    if not os.path.exists(stamp):
        if args.writer == "webdataset":
            got = {"tars": runner.call("webdataset", "small", "make_wds_tars", want)}
            subprocess.run([sys.executable, "-m", "shardstream", "index", tars, tars], check=True, capture_output=True)
        else:
            got = {"tars": make_tars(want)}
        if got["tars"] != digest(args.samples):
            raise SystemExit("the writer wrote other samples than these")
        os.makedirs(data, exist_ok=True)
        open(stamp, "w").close()
    if "litdata" in peers and not os.path.exists(os.path.join(chunks, "index.json")):
        if runner.call("litdata", "small", "make_litdata", {**want, "root": chunks}) != digest(args.samples):
            raise SystemExit("litData's chunks hold other samples than these")
    return [
        {
            "workers": w,
            "batch": args.batch,
            "samples": args.samples,
            "writer": args.writer,
            "runtime": args.runtime,
            "_tars": tars,
            "_litdata": chunks,
        }
        for w in args.workers
    ]


def measure(config: dict) -> dict:
    from torch.utils.data import DataLoader, Dataset, default_collate

    from benchmarks.harness import timed_pass

    peer, workers = config["peer"], config["workers"]
    if peer == "torch":
        memory = [{"bin": payload, "json": label} for _, payload, label in samples(config["samples"])]  # before the clock

        class InMemory(Dataset):
            def __len__(self):
                return len(memory)

            def __getitem__(self, i):
                return fn(memory[i])

    def make():
        if peer == "shardstream":
            from benchmarks.harness import loader_options
            from shardstream import ShardStream, World, make_loader

            ds = ShardStream(
                config["_tars"], batch_size=config["batch"], shuffle=False, decode=False, transform=fn, collate=default_collate, world=World(0, 1)
            )
            return make_loader(ds, num_workers=workers, **loader_options(config))
        if peer == "webdataset":
            import webdataset as wds

            root = config["_tars"]
            urls = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))
            ds = (
                wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.single_node_only, workersplitter=wds.split_by_worker, empty_check=False)
                .map(fn)
                .batched(config["batch"], collation_fn=default_collate, partial=True)
            )
            return wds.WebLoader(ds, batch_size=None, num_workers=workers)
        if peer == "litdata":
            import litdata

            ds = litdata.StreamingDataset(input_dir=config["_litdata"], transform=fn)
            return litdata.StreamingDataLoader(ds, batch_size=config["batch"], num_workers=workers, collate_fn=default_collate)
        if peer == "torch":
            return DataLoader(InMemory(), batch_size=config["batch"], num_workers=workers)
        raise SystemExit(f"small: no peer {peer}")

    return timed_pass(make, lambda b: len(b["y"]))
