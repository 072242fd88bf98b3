"""large: large samples (``--mb`` MiB float32 ``.npy``, default 4) from tmpfs into batches of one
float32 tensor, ``Shuffle(64)``, GB of payload per second (from bench_large.py).

Peers: ``shardstream`` (its ``.npy`` decoder over the member's buffer, its default collate),
``webdataset`` (``np.load`` per sample, ``batched`` then ``torch.from_numpy``), ``floor`` (the
same shard files read with ``readinto`` into one reused buffer: the memory's speed; no workers).
"""

from __future__ import annotations

import io
import os

UNIT = "MB/s"
PEERS = ("shardstream", "webdataset", "floor")


def add_arguments(p) -> None:
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--mb", type=float, default=4.0, help="MiB per sample")
    p.add_argument("--batch", type=int, default=32)


def prepare(args, runner, peers: list[str]) -> list[dict]:
    import numpy as np

    from shardstream import ShardWriter

    floats = int(args.mb * (1 << 20)) // 4
    root = os.path.join(args.workdir, f"large-{args.samples}-{floats}")
    if not os.path.exists(os.path.join(root, "index.json")):
        base = np.random.default_rng(0).standard_normal(floats, dtype=np.float32)
        with ShardWriter(root, max_count=64, max_size=1 << 40, overwrite=True) as w:
            for i in range(args.samples):
                buf = io.BytesIO()
                np.save(buf, base + np.float32(i))
                w.write_encoded(f"{i:08d}", {"npy": buf.getvalue(), "cls": str(i % 10).encode()})
    return [{"workers": w, "samples": args.samples, "mb": args.mb, "batch": args.batch, "runtime": args.runtime, "_root": root} for w in args.workers]


def skip(peer: str, config: dict) -> bool:
    return peer == "floor" and config["workers"] > 0


def measure(config: dict) -> dict:
    import numpy as np

    from benchmarks.harness import timed_pass

    peer, workers, root = config["peer"], config["workers"], config["_root"]
    tars = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))
    if peer == "floor":
        buf = bytearray(8 << 20)
        view = memoryview(buf)

        def read_all():
            for path in tars:
                with open(path, "rb", buffering=0) as f:
                    while n := f.readinto(view):
                        yield n

        result = timed_pass(read_all, lambda n: n)
        result["rate"] = result["items"] / result["seconds"] / 1e6
        return result

    def make():
        if peer == "shardstream":
            from benchmarks.harness import loader_options
            from shardstream import ShardStream, Shuffle, World, make_loader

            ds = ShardStream(root, batch_size=config["batch"], shuffle=Shuffle(64), world=World(0, 1))
            return make_loader(ds, num_workers=workers, **loader_options(config))
        if peer == "webdataset":
            import torch
            import webdataset as wds

            def decode(s):
                return {"npy": np.load(io.BytesIO(s["npy"]), allow_pickle=False), "cls": int(s["cls"])}

            ds = (
                wds.WebDataset(tars, shardshuffle=100, nodesplitter=wds.single_node_only, workersplitter=wds.split_by_worker, empty_check=False)
                .shuffle(64)
                .map(decode)
                .batched(config["batch"], partial=True)
                .map(lambda b: {"npy": torch.from_numpy(b["npy"]), "cls": torch.as_tensor(b["cls"])})
            )
            return wds.WebLoader(ds, batch_size=None, num_workers=workers)
        raise SystemExit(f"large: no peer {peer}")

    result = timed_pass(make, lambda b: b["npy"].numel() * 4)
    result["rate"] = result["items"] / result["seconds"] / 1e6
    return result
