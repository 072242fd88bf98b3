"""The loader's runtimes side by side: thread workers, worker processes and no workers, against
another checkout (``--baseline``: main before the runtime moved to public ground), on the small,
image and large workloads, each run a fresh process, interleaved, medians.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.runtime --baseline /path/to/old/checkout \
        [--repeats 3] [--workdir /dev/shm/bench-runtime] [--only small,image,large]

Workloads (written once to ``--workdir`` by shardstream's ShardWriter):
- small: 20,000 samples of a 1 KiB payload and a JSON label; the user's function decodes both
  (uint8 tensor, ``json.loads``), torch's ``default_collate``, batch 64 (decode=False).
- image: 1,200 JPEGs of 320x240 (random noise over gradients); the default image decode with
  ``Decode(size=224)`` (cover + centre crop) to uint8 CHW, batch 32.
- large: 96 samples of an 8 MiB ``.npy`` float32 array, decoded as stored, batch 4 (32 MiB batches).
Each run: the first pass from its first batch on (samples/s), two more passes (the steady rate:
memory and workers warm), the time from the loader's first ``iter()`` to its first batch, and to
the end of the first pass (what a user waits for: a runtime that is slow to its first batch has
batches ready when it comes, so its rate from there on flatters it). Printed as JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

RUN = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from torch.utils.data import default_collate
import shardstream
from shardstream import ShardStream, World, make_loader, Decode

def small(sample):
    return {"x": torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8), "y": json.loads(sample["json"])["label"]}

if __name__ == "__main__":
    tree, workload, root, workers, kind = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    options = {"small": lambda: dict(batch_size=64, decode=False, transform=small, collate=default_collate),
               "image": lambda: dict(batch_size=32, decode=Decode(size=224)),  # (a checkout before Decode(size=) cannot run it)
               "large": lambda: dict(batch_size=4)}[workload]()
    ds = ShardStream(root, shuffle=False, world=World(0, 1), **options)
    extra = {} if kind == "default" else {"workers": kind}
    loader = make_loader(ds, num_workers=workers, log_interval=None, pin_memory=False, **extra)
    size = lambda batch: len(next(iter(batch.values())) if isinstance(batch, dict) else batch[0])
    t0 = time.perf_counter()
    it = iter(loader)
    first = next(it)
    t1 = time.perf_counter()
    n = sum(size(batch) for batch in it)
    t2 = time.perf_counter()
    m = sum(size(batch) for _ in range(2) for batch in loader)  # two more passes: the steady rate
    t3 = time.perf_counter()
    print(json.dumps({"first_batch_s": t1 - t0, "first_pass_s": t2 - t0, "rate": n / (t2 - t1), "steady": m / (t3 - t2)}))
"""


def make_data(workdir: str) -> dict[str, str]:
    import numpy as np
    from PIL import Image

    sys.path.insert(0, REPO)
    from shardstream import ShardWriter

    roots = {w: os.path.join(workdir, w) for w in ("small", "image", "large")}
    rng = np.random.default_rng(0)
    if not os.path.exists(roots["small"]):
        with ShardWriter(roots["small"], max_count=5000) as w:
            for i in range(20_000):
                w.write_encoded(f"{i:06d}", {"bin": rng.bytes(1024), "json": json.dumps({"label": i % 1000}).encode()})
    if not os.path.exists(roots["image"]):
        with ShardWriter(roots["image"], max_count=300) as w:
            grad = np.linspace(0, 255, 320, dtype=np.float32)[None, :, None]
            for i in range(1200):
                pixels = np.clip(grad + rng.normal(0, 40, (240, 320, 3)), 0, 255).astype(np.uint8)
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
                w.write_encoded(f"{i:06d}", {"jpg": buf.getvalue(), "cls": str(i % 10).encode()})
    if not os.path.exists(roots["large"]):
        with ShardWriter(roots["large"], max_count=16) as w:
            for i in range(96):
                buf = io.BytesIO()
                np.save(buf, np.full((2 << 20,), i, dtype=np.float32))
                w.write_encoded(f"{i:06d}", {"npy": buf.getvalue()})
    return roots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="another checkout of shardstream (its default runtime)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/dev/shm/bench-runtime")
    parser.add_argument("--only", default="small,image,large")
    args = parser.parse_args()
    roots = make_data(args.workdir)
    script = os.path.join(args.workdir, "run.py")  # a file, not ``-c``: 8445c6b cannot send functions defined in ``-c`` to workers
    with open(script, "w") as f:
        f.write(RUN)
    contenders = [(REPO, "threads"), (REPO, "processes")] + ([(args.baseline, "default")] if args.baseline else [])
    results: dict[tuple, list[dict]] = {}
    for round_ in range(args.repeats):
        for workload in args.only.split(","):
            for workers in (0, 2):
                # the order turns every round: a run right after a heavy one ran slower here, whoever it was
                turn = round_ % len(contenders)
                for tree, kind in contenders[turn:] + contenders[:turn]:
                    if workers == 0 and kind == "processes":
                        continue  # (no workers: the same run as threads)
                    out = subprocess.run(
                        [sys.executable, script, tree, workload, roots[workload], str(workers), kind],
                        capture_output=True,
                        text=True,
                        timeout=600,
                        env={**os.environ, "PYTHONPATH": tree},
                    )
                    if out.returncode:
                        print(out.stderr, file=sys.stderr)
                        continue
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    name = "baseline" if tree == args.baseline else kind
                    key = (workload, workers, name)
                    results.setdefault(key, []).append(got)
                    print(json.dumps({"workload": workload, "workers": workers, "runtime": name, **got, "load": os.getloadavg()[0]}), flush=True)
    print("\n| workload | workers | runtime | first pass, samples/s | passes 2-3, samples/s | first batch s | first pass s |")
    print("|---|---|---|---|---|---|---|")
    for (workload, workers, name), runs in sorted(results.items()):
        rate = statistics.median(r["rate"] for r in runs)
        steady = statistics.median(r["steady"] for r in runs)
        first = statistics.median(r["first_batch_s"] for r in runs)
        whole = statistics.median(r.get("first_pass_s", float("nan")) for r in runs)
        print(f"| {workload} | {workers} | {name} | {rate:,.0f} | {steady:,.0f} | {first:.2f} | {whole:.2f} |")


if __name__ == "__main__":
    main()
