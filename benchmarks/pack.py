"""pack: a directory tree on disk into shards, samples per second (from bench_pack.py).

Inputs (``--kind``): ``small`` (~1 KB ``.bin`` + ``.cls``) or ``images`` (~100 KB JPEG +
``.cls``), ``--samples`` of them, in the workdir. Peers: ``shardstream`` (``pack(src, out,
workers=W)``: ``--workers`` here are pack's workers, 1 and 2 by default), ``webdataset`` (the loop
a webdataset user writes: walk the files, read them, ``wds.ShardWriter.write``; one process).
"""

from __future__ import annotations

import os
import shutil

UNIT = "samples/s"
PEERS = ("shardstream", "webdataset")


def add_arguments(p) -> None:
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--kind", choices=("small", "images"), default="small")
    p.set_defaults(workers=[1, 2])


def prepare(args, runner, peers: list[str]) -> list[dict]:
    import io

    import numpy as np

    src = os.path.join(args.workdir, f"pack-{args.kind}-{args.samples}")
    if not os.path.exists(os.path.join(args.workdir, f"pack-{args.kind}-{args.samples}.built")):
        shutil.rmtree(src, ignore_errors=True)
        rng = np.random.default_rng(0)
        base = [rng.integers(0, 255, (300, 400, 3), dtype=np.uint8) for _ in range(8)] if args.kind == "images" else []
        for i in range(args.samples):
            key = f"{i:08d}"
            d = os.path.join(src, key[:5])
            os.makedirs(d, exist_ok=True)
            if args.kind == "small":
                payload, ext = rng.bytes(int(rng.integers(800, 1200))), "bin"
            else:
                from PIL import Image

                buf = io.BytesIO()
                Image.fromarray(np.roll(base[i % 8], i, axis=1)).save(buf, format="JPEG", quality=90)
                payload, ext = buf.getvalue(), "jpg"
            with open(os.path.join(d, f"{key[5:]}.{ext}"), "wb") as f:
                f.write(payload)
            with open(os.path.join(d, f"{key[5:]}.cls"), "wb") as f:
                f.write(str(i % 1000).encode())
        open(os.path.join(args.workdir, f"pack-{args.kind}-{args.samples}.built"), "w").close()
    out = os.path.join(args.workdir, "pack-out")
    return [{"workers": w, "samples": args.samples, "kind": args.kind, "_src": src, "_out": out} for w in args.workers]


def skip(peer: str, config: dict) -> bool:
    return peer == "webdataset" and config["workers"] != 1


def measure(config: dict) -> dict:
    import time

    from benchmarks.harness import cpu_seconds

    src, out = config["_src"], config["_out"]
    shutil.rmtree(out, ignore_errors=True)
    t, c = time.perf_counter(), cpu_seconds()
    if config["peer"] == "shardstream":
        from shardstream import pack

        result = pack(src, out, workers=config["workers"], overwrite=True)
        items = result.samples if hasattr(result, "samples") else config["samples"]
    else:
        import webdataset as wds

        os.makedirs(out, exist_ok=True)
        groups: dict[str, dict[str, str]] = {}
        for root, _, files in os.walk(src):
            for name in files:
                path = os.path.join(root, name)
                key, ext = os.path.relpath(path, src).split(".", 1)
                groups.setdefault(key, {})[ext] = path
        with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxcount=10_000, maxsize=1e9, verbose=0) as w:
            for key in sorted(groups):
                sample: dict = {"__key__": key}
                for ext, path in groups[key].items():
                    with open(path, "rb") as f:
                        sample[ext] = f.read()
                w.write(sample)
        items = len(groups)
    return {"items": items, "seconds": time.perf_counter() - t, "cpu_seconds": cpu_seconds() - c}
