"""The worker -> main process hand-off of large batches, with and without segment reuse, side by
side in one run: 4 MiB float32 ``.npy`` samples from tmpfs (the bench_large dataset), batches of
32 (128 MiB), 2 workers, several passes over one loader.

    OMP_NUM_THREADS=1 python benchmarks/bench_handoff.py [--repeats 5] [--passes 4] [--samples 512]

Contenders: ``make_loader(reuse_shared_memory=True|False)`` x ``persistent_workers=True|False``,
and the same loader with no workers (one process) for scale.
With reuse, a worker writes its batch into a shared segment it used before once the main process
holds no tensor on it; without, every batch gets a fresh segment (torch's own collate does the
same). The main loop touches one float per 4 KiB page of every batch (as a copy to the GPU would
touch them all), then drops it. Reported: GB/s of wall time over all passes, medians of
interleaved repeats, and the ratio of reuse to fresh. Workers new each pass inherit the segments
of the pass before (segments.py), so their later passes reuse segments too.

``--collate torch``: the dataset batches with torch's own ``default_collate`` (``collate=``), which
in a worker stacks into the storage torch asks ``UntypedStorage._new_shared`` for.
``--images``: 224 x 224 x 3 uint8 ``.npy`` samples (147 KiB), batches of 64 (9.2 MiB), in place
of the 4 MiB float32 ones.
``--baseline OTHER_TREE`` (another checkout's ``shardstream/``, e.g. ``git archive main shardstream
benchmarks | tar -x -C /tmp/base``): this tree and that one, persistent workers and new each pass,
segments reused, each run a fresh process of this script importing its tree's shardstream
(``--start-method``, fork by default), interleaved; reported with the CPU seconds per GB of the process and its
workers (getrusage and /proc, read before the loader goes, as bench_small's ``cpu_seconds``).

    OMP_NUM_THREADS=1 python benchmarks/bench_handoff.py --collate torch --baseline /tmp/base [--images]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if "--repo" in sys.argv:  # a fresh process for one run: that tree's shardstream
    sys.path.insert(0, os.path.abspath(sys.argv[sys.argv.index("--repo") + 1]))
else:
    sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

IMAGE = (224, 224, 3)


def run(*args: Any, **kwargs: Any) -> float:
    """``measure``'s GB/s alone (bench_workers.py calls this)."""
    return measure(*args, **kwargs)[0]


def measure(
    root: str,
    reuse: bool,
    persistent: bool,
    passes: int,
    workers: int = 2,
    start_method: str = "fork",
    collate: str = "shardstream",
    batch_size: int = 32,
) -> tuple[float, float]:
    """(GB/s of wall time, CPU seconds per GB of this process and its workers) over ``passes``."""
    from bench_small import cpu_seconds
    from torch.utils.data import default_collate

    from shardstream import ShardStream, World, make_loader

    extra = {"collate": default_collate} if collate == "torch" else {}
    ds = ShardStream(root, batch_size=batch_size, shuffle=False, world=World(0, 1), **extra)
    loader = make_loader(
        ds,
        num_workers=workers,
        pin_memory=False,
        persistent_workers=persistent,
        reuse_shared_memory=reuse,
        log_interval=None,
        start_method=start_method if workers else "auto",
    )
    total = 0
    t, c = time.perf_counter(), cpu_seconds()
    for _ in range(passes):
        for batch in loader:
            x = batch["npy"]
            float(x.view(-1)[:: 4096 // x.element_size()].sum())  # one element per page: every page is touched here
            total += x.nbytes
    wall, cpu = time.perf_counter() - t, cpu_seconds() - c  # (before the loader goes: persistent workers are live)
    return total / wall / 1e9, cpu / (total / 1e9)


def make_images(root: str, n: int) -> None:
    import numpy as np

    from shardstream import ShardWriter

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, IMAGE, dtype=np.uint8)
    with ShardWriter(root, max_count=256, max_size=1 << 40, overwrite=True) as w:
        for i in range(n):
            w.write({"__key__": f"{i:08d}", "npy": base + np.uint8(i % 251), "cls": i % 10})


def one_run(python: str, repo: str, args: list[str]) -> tuple[float, float]:
    """One run in a fresh process of this script over ``repo``'s shardstream."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": repo}
    done = subprocess.run([python, os.path.abspath(__file__), "--repo", repo, *args], capture_output=True, text=True, env=env, cwd=repo)
    if done.returncode != 0:
        raise SystemExit(f"run over {repo} failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if os.path.commonpath([os.path.realpath(got["shardstream"]), os.path.realpath(repo)]) != os.path.realpath(repo):
        raise SystemExit(f"a run over {repo} imported {got['shardstream']}")
    return got["gbps"], got["cpu_per_gb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--workdir", default="/dev/shm/ssbench-large", help="shared with benchmarks/bench_large.py")
    parser.add_argument("--collate", choices=("shardstream", "torch"), default="shardstream", help="the dataset's collate")
    parser.add_argument("--images", action="store_true", help="224 x 224 x 3 uint8 samples, batches of 64")
    parser.add_argument("--start-method", default="fork", choices=("fork", "forkserver", "spawn"), help="how the workers start")
    parser.add_argument("--baseline", help="another tree's shardstream (its parent directory) against this one's")
    parser.add_argument("--repo", help=argparse.SUPPRESS)  # (one run in a fresh process: that tree)
    parser.add_argument("--persistent", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batch_size = 64 if args.images else 32
    root = os.path.join(args.workdir, "images" if args.images else "npy")
    if args.repo is not None:  # one run, reported as JSON
        persistent = bool(args.persistent)
        gbps, cpu = measure(root, True, persistent, args.passes, start_method=args.start_method, collate=args.collate, batch_size=batch_size)
        import shardstream

        print(json.dumps({"gbps": gbps, "cpu_per_gb": cpu, "shardstream": shardstream.__file__}))
        return
    from bench_large import make_dataset  # (it puts this tree first on sys.path: not in a run over another tree)

    if not os.path.exists(os.path.join(root, "index.json")):
        (make_images if args.images else make_dataset)(root, args.samples)
    shape = f"{args.samples} x {'224x224x3 uint8' if args.images else '4 MiB float32'}"
    if args.baseline:
        compare(args, root, shape)
        return
    contenders: dict[tuple[bool, bool], list[float]] = {(reuse, persistent): [] for persistent in (True, False) for reuse in (True, False)}
    alone: list[float] = []  # no workers: the main process reads, decodes and batches itself
    for _ in range(args.repeats):
        for (reuse, persistent), rates in contenders.items():  # interleaved: noise hits all alike
            rates.append(run(root, reuse, persistent, args.passes, collate=args.collate, batch_size=batch_size))
        alone.append(run(root, True, False, args.passes, workers=0, collate=args.collate, batch_size=batch_size))
    print("| workers | segments | GB/s (median) | runs | reuse vs fresh |")
    print("|---|---|---|---|---|")
    for persistent in (True, False):
        fresh = statistics.median(contenders[(False, persistent)])
        for reuse in (True, False):
            rates = contenders[(reuse, persistent)]
            med = statistics.median(rates)
            print(
                f"| {'persistent' if persistent else 'new each pass'} | {'reused' if reuse else 'fresh'} | {med:.2f} | "
                f"{' '.join(f'{r:.2f}' for r in rates)} | {med / fresh:.2f}x |"
            )
    med = statistics.median(alone)
    print(f"| none (num_workers=0) | - | {med:.2f} | {' '.join(f'{r:.2f}' for r in alone)} | - |")
    print(f"({args.passes} passes over {shape} per run, 2 workers, batch {batch_size}, {args.collate}'s collate, medians of {args.repeats})")


def compare(args: argparse.Namespace, root: str, shape: str) -> None:
    trees = {"this": os.path.join(HERE, ".."), "baseline": args.baseline}
    results: dict[tuple[str, bool], list[tuple[float, float]]] = {(t, p): [] for p in (True, False) for t in trees}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for tree, persistent in results:  # interleaved: noise hits all alike
            flags = ["--collate", args.collate, "--passes", str(args.passes), "--workdir", args.workdir, "--start-method", args.start_method]
            flags += ["--persistent", str(int(persistent))]
            results[(tree, persistent)].append(one_run(sys.executable, os.path.abspath(trees[tree]), flags + (["--images"] if args.images else [])))
        loads.append(os.getloadavg()[0])
    print("| workers | tree | GB/s (median) | runs | CPU s/GB (median) | runs |")
    print("|---|---|---|---|---|---|")
    for (tree, persistent), got in results.items():
        rates, cpus = [g for g, _ in got], [c for _, c in got]
        workers = "persistent" if persistent else "new each pass"
        print(
            f"| {workers} | {tree} | {statistics.median(rates):.2f} | {' '.join(f'{r:.2f}' for r in rates)} | "
            f"{statistics.median(cpus):.3f} | {' '.join(f'{c:.3f}' for c in cpus)} |"
        )
    print(
        f"({args.passes} passes over {shape} per run, 2 {args.start_method} workers, segments reused, {args.collate}'s collate, "
        f"medians of {args.repeats}; load average {min(loads):.1f}-{max(loads):.1f})"
    )


if __name__ == "__main__":
    main()
