"""Small samples through the user's own pipeline: shardstream against the newest litData and
webdataset, each in a venv of its own, and against the floor, interleaved, medians.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_small.py [--repeats 5] [--samples 200000] [--workers 0,2]
        [--litdata-python /tmp/venv-litdata/bin/python] [--webdataset-python /tmp/venv-wds/bin/python]
        [--baseline OTHER_CHECKOUT] [--keep] [--only floor,shardstream,litdata,webdataset] [--omp-unset]
        [--start-method fork|forkserver|spawn]

``--start-method``: how shardstream's (and the baseline's) workers start, through
``SHARDSTREAM_START_METHOD`` (so a baseline's own copy of this script needs no flag for it); by
default make_loader's (forkserver). litData's workers fork, whatever is asked.
``--baseline``: another checkout of shardstream (main before a change, say) runs as one more
contender in this venv; ``--keep`` keeps the data in ``--workdir`` for the next run.
``--writer shardstream,webdataset``: who writes the tar shards (default shardstream's
``ShardWriter``); ``webdataset`` writes them with webdataset's ``TarWriter`` (in the webdataset
venv: a pax header with a float mtime before every member) and indexes them in place with
``shardstream index``, as docs/from-webdataset.md says. With several writers, shardstream (and
the baseline) run once per writer's shards, interleaved; webdataset reads the first writer's.

Peers' venvs (so that this project's pins do not hold them back; torch==2.13.0 is the CPU wheel):

    python3 -m venv /tmp/venv-litdata && /tmp/venv-litdata/bin/pip install torch==2.13.0 litdata
    python3 -m venv /tmp/venv-wds && /tmp/venv-wds/bin/pip install torch==2.13.0 webdataset

(or, with no second torch at all: ``pip install --no-deps litdata==0.2.76 obstore tifffile`` into the
venv and a ``.pth`` file naming this project's site-packages, from which it takes torch and numpy)

Samples: a 1 KiB ``.bin`` payload and a JSON label (``{"label": i % 1000}``), written once to
tmpfs (``--workdir``): tar shards of 10,000 samples (shardstream and webdataset read the same
files) and litData's chunks (``litdata.optimize``, 64 MB), made from the same bytes (each
builder, in its own venv, prints a digest of the samples it generated; they must agree). Every loader runs the same user
function (payload -> uint8 tensor, label -> int through ``json.loads``) and torch's
``default_collate``, batch 64, no shuffle: shardstream with ``decode=False`` (the function
decodes), litData's ``StreamingDataset(transform=fn)`` + ``StreamingDataLoader``, webdataset's
``.map(fn).batched(64, collation_fn=default_collate)`` + ``WebLoader``. The floor: the same
function and collate over the same samples already in memory (a list of dicts), in one process.

Every run is a fresh process of its loader's venv, one pass over all samples, timed from the
dataset's construction: samples/s over the whole pass, CPU per sample (the process and its
workers, whether the process waited for them or not, and a forkserver's server and its workers:
read from /proc before the loader goes), and the time to the first batch. Contenders are
interleaved within each repeat; the table gives medians.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")  # the shardstream under test (--repo)
OMP_UNSET = False
START_METHOD: str | None = None  # --start-method: SHARDSTREAM_START_METHOD for the shardstream passes
BATCH = 64
SHARD_SAMPLES = 10_000


def samples(n: int):
    """The benchmark's samples, the same bytes in every venv: (key, payload, label JSON)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for i in range(n):
        yield f"{i:08d}", rng.bytes(1024), json.dumps({"label": i % 1000}).encode()


def digest(n: int) -> str:
    h = hashlib.sha256()
    for key, payload, label in samples(n):
        h.update(key.encode())
        h.update(payload)
        h.update(label)
    return h.hexdigest()[:16]


def fn(sample):
    """The user's function: the same in every loader. (litData hands ``bytes`` fields over as
    memoryviews, which ``json.loads`` refuses: ``bytes()`` of them; of a ``bytes`` it is the same object.)"""
    import torch

    return {"x": torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8), "y": json.loads(bytes(sample["json"]))["label"]}


# -- builders (each run in the venv that reads the format) ---------------------------------------


def make_tars(root: str, n: int) -> None:
    sys.path.insert(0, REPO)
    from shardstream import ShardWriter

    with ShardWriter(root, max_count=SHARD_SAMPLES, overwrite=True) as w:
        for key, payload, label in samples(n):
            w.write_encoded(key, {"bin": payload, "json": label})


def make_wds_tars(root: str, n: int) -> None:
    """The same samples written by webdataset's TarWriter, shards of SHARD_SAMPLES."""
    import webdataset as wds

    os.makedirs(root, exist_ok=True)
    writer = None
    for i, (key, payload, label) in enumerate(samples(n)):
        if i % SHARD_SAMPLES == 0:
            if writer is not None:
                writer.close()
            writer = wds.TarWriter(os.path.join(root, f"shard-{i // SHARD_SAMPLES:06d}.tar"))
        writer.write({"__key__": key, "bin": payload, "json": label})
    if writer is not None:
        writer.close()


def _litdata_items(span: tuple[int, int]):
    start, stop = span
    for key, payload, label in samples(stop):
        if int(key) >= start:
            yield {"bin": payload, "json": label}


def make_litdata(out: str, n: int) -> None:
    import litdata

    spans = [(start, min(start + SHARD_SAMPLES, n)) for start in range(0, n, SHARD_SAMPLES)]
    litdata.optimize(fn=_litdata_items, inputs=spans, output_dir=out, chunk_bytes="64MB", num_workers=1, mode="overwrite", verbose=False)


# -- one pass of one loader (run in a fresh process) -------------------------------------------


def shardstream_batches(root: str, workers: int):
    sys.path.insert(0, REPO)
    from torch.utils.data import default_collate

    from shardstream import ShardStream, World, make_loader

    ds = ShardStream(root, batch_size=BATCH, shuffle=False, decode=False, transform=fn, collate=default_collate, world=World(0, 1))
    return make_loader(ds, num_workers=workers, pin_memory=False, log_interval=None)


def litdata_batches(root: str, workers: int):
    import litdata
    from torch.utils.data import default_collate

    ds = litdata.StreamingDataset(input_dir=root, transform=fn)
    return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=default_collate)


def webdataset_batches(root: str, workers: int):
    import webdataset as wds
    from torch.utils.data import default_collate

    urls = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))
    ds = (
        wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.single_node_only, workersplitter=wds.split_by_worker, empty_check=False)
        .map(fn)
        .batched(BATCH, collation_fn=default_collate, partial=False)
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=workers)


def floor_batches(n: int):
    from torch.utils.data import default_collate

    in_memory = [{"bin": payload, "json": label} for _, payload, label in samples(n)]
    return (default_collate([fn(s) for s in in_memory[i : i + BATCH]]) for i in range(0, len(in_memory) - BATCH + 1, BATCH))


def cpu_seconds() -> float:
    """CPU seconds of this process and every process under it: the children it waited for
    (getrusage), and from /proc the ones still running (persistent DataLoader workers, which are
    not waited for until the loader goes) and theirs (a forkserver's workers are the server's
    children, not this process's), with the children each of those waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + sum(_proc_cpu(pid) for pid in _descendants(os.getpid()))


def _proc_stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _proc_cpu(pid: int) -> float:
    """utime + stime + cutime + cstime of a live process, seconds (0 if it is gone)."""
    try:
        fields = _proc_stat(pid)
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _descendants(root: int) -> list[int]:
    """The live processes under ``root`` (Linux /proc; none elsewhere)."""
    parents: dict[int, list[int]] = {}
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for pid in entries:
        try:
            parents.setdefault(int(_proc_stat(pid)[1]), []).append(pid)
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def one_pass(name: str, data: str, workers: int, n: int) -> dict[str, float]:
    if name == "floor":
        loader = floor_batches(n)  # built before the clock starts: the samples are in memory
    # Imports before the clock starts, for every loader alike: the clock is the loader's.
    import torch.utils.data  # noqa: F401

    if name == "shardstream":
        sys.path.insert(0, REPO)
        import shardstream.loader  # noqa: F401
    elif name == "litdata":
        import litdata  # noqa: F401
    elif name == "webdataset":
        import webdataset  # noqa: F401

    t, c = time.perf_counter(), cpu_seconds()
    if name == "shardstream":
        loader = shardstream_batches(os.path.join(data, "tars"), workers)
    elif name == "litdata":
        loader = litdata_batches(os.path.join(data, "litdata"), workers)
    elif name == "webdataset":
        loader = webdataset_batches(os.path.join(data, "tars"), workers)
    got = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t
        got += len(batch["y"])
    wall, cpu = time.perf_counter() - t, cpu_seconds() - c
    return {"samples": got, "wall": wall, "cpu": cpu, "first": first or 0.0}


def version(name: str) -> str:
    if name == "litdata":
        import litdata

        return litdata.__version__
    if name == "webdataset":
        import webdataset

        return webdataset.__version__
    if name == "shardstream":
        sys.path.insert(0, REPO)
        import shardstream

        return getattr(shardstream, "__version__", "")
    return ""


# -- the driver ------------------------------------------------------------------------------------


def run(python: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if OMP_UNSET:  # --omp-unset: torch's own default thread count (one per core)
        env.pop("OMP_NUM_THREADS")
    if START_METHOD is not None:
        env["SHARDSTREAM_START_METHOD"] = START_METHOD  # (read by shardstream's make_loader only)
    # Another checkout (--repo) runs in that checkout, from its own copy of this script where it has
    # one: a forkserver's server (Python 3.11) ignores the sys.path it is handed and preloads
    # shardstream from its working directory, so, run from here, a baseline's workers would use
    # this checkout's shardstream, not the baseline's (shardstream's own start of the server hands
    # it the path since private.start_forkserver; a baseline from before that needs this).
    repo = os.path.abspath(args[args.index("--repo") + 1]) if "--repo" in args else None
    script = os.path.abspath(__file__)
    if repo is not None:
        env["PYTHONPATH"] = repo
        own = os.path.join(repo, "benchmarks", os.path.basename(script))
        script = own if os.path.exists(own) else script
    done = subprocess.run([python, script, *args], capture_output=True, text=True, env=env, cwd=repo)
    if done.returncode != 0:
        raise SystemExit(f"{python} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def build(data: str, n: int, pythons: dict[str, str], writer: str = "shardstream") -> None:
    stamp = os.path.join(data, f"built-{n}")
    if os.path.exists(stamp):
        return
    shutil.rmtree(data, ignore_errors=True)
    os.makedirs(data)
    if writer == "webdataset":
        digests = {"tars": run(pythons["webdataset"], "--make", "wdstars", "--data", data, "--samples", str(n))}
        tars = os.path.join(data, "tars")
        env = {**os.environ, "PYTHONPATH": os.path.abspath(REPO)}
        subprocess.run([pythons["shardstream"], "-m", "shardstream", "index", tars, tars], check=True, capture_output=True, env=env)
    else:
        digests = {"tars": run(pythons["shardstream"], "--make", "tars", "--data", data, "--samples", str(n))}
    if "litdata" in pythons:
        digests["litdata"] = run(pythons["litdata"], "--make", "litdata", "--data", data, "--samples", str(n))
    if len(set(digests.values())) != 1:
        raise SystemExit(f"the builders wrote different samples: {digests}")
    open(stamp, "w").close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--workdir", default="/dev/shm/ssbench-small")
    parser.add_argument("--keep", action="store_true", help="keep the data in --workdir for the next run")
    parser.add_argument("--litdata-python", default="/tmp/venv-litdata/bin/python")
    parser.add_argument("--webdataset-python", default="/tmp/venv-wds/bin/python")
    parser.add_argument("--only", default="floor,shardstream,litdata,webdataset")
    parser.add_argument(
        "--omp-unset", action="store_true", help="run every pass without OMP_NUM_THREADS (else it is 1 unless set: idle torch threads cost CPU)"
    )
    parser.add_argument(
        "--start-method", choices=("fork", "forkserver", "spawn"), help="how shardstream's workers start (default: make_loader's, forkserver)"
    )
    parser.add_argument("--writer", default="shardstream", help="who writes the tar shards: shardstream, webdataset, or both (comma-separated)")
    parser.add_argument(
        "--baseline", help="another checkout of shardstream (say, main before a change), run as one more contender, 'baseline', in this venv"
    )
    # internal: one builder or one pass, in the venv the driver chose
    parser.add_argument("--make", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--version", help=argparse.SUPPRESS)
    parser.add_argument("--repo", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.omp_unset:
        global OMP_UNSET
        OMP_UNSET = True
    if args.start_method:
        global START_METHOD
        START_METHOD = args.start_method
    if args.repo:
        global REPO
        REPO = args.repo

    if args.make:
        maker = {"tars": make_tars, "wdstars": make_wds_tars, "litdata": make_litdata}[args.make]
        maker(os.path.join(args.data, "tars" if args.make == "wdstars" else args.make), args.samples)
        print(digest(args.samples))
        return
    if args.version:
        print(version(args.version))
        return
    if args.run:
        print(json.dumps(one_pass("shardstream" if args.run == "baseline" else args.run, args.data, int(args.workers), args.samples)))
        return

    names = args.only.split(",")
    pythons = {"floor": sys.executable, "shardstream": sys.executable}
    for name, python in (("litdata", args.litdata_python), ("webdataset", args.webdataset_python)):
        if name in names:
            if not os.path.exists(python):
                raise SystemExit(f"{python} not found: make the venv as the docstring says, or leave {name} out with --only")
            pythons[name] = python
    names = [name for name in names if name in pythons]
    repos = {}
    if args.baseline:
        names.insert(names.index("shardstream") + 1 if "shardstream" in names else len(names), "baseline")
        pythons["baseline"] = sys.executable
        repos["baseline"] = ["--repo", os.path.abspath(args.baseline)]
    versions = {name: run(pythons[name], "--version", "shardstream" if name == "baseline" else name, *repos.get(name, [])) for name in names}
    writers = args.writer.split(",")
    if "webdataset" in writers and "webdataset" not in pythons:
        if not os.path.exists(args.webdataset_python):
            raise SystemExit(f"{args.webdataset_python} not found: --writer webdataset writes with webdataset's TarWriter in that venv")
        pythons["webdataset"] = args.webdataset_python
    for i, writer in enumerate(writers):
        builders = ("shardstream", "webdataset") + (("litdata",) if i == 0 else ())
        build(
            os.path.join(args.workdir, writer),
            args.samples,
            {k: v for k, v in pythons.items() if k in builders and k in names + ["shardstream", "webdataset"]},
            writer,
        )
    # Contenders: shardstream (and the baseline) once per writer's shards, the others on the first writer's.
    contenders = [(name, w) for name in names for w in (writers if name in ("shardstream", "baseline") else writers[:1])]
    try:
        rows = []
        for workers in [int(w) for w in args.workers.split(",")]:
            results: dict[tuple[str, str], list[dict[str, float]]] = {c: [] for c in contenders if not (c[0] == "floor" and workers)}
            for _ in range(args.repeats):
                for name, writer in results:  # interleaved
                    result = json.loads(
                        run(
                            pythons[name],
                            "--run",
                            name,
                            "--data",
                            os.path.join(args.workdir, writer),
                            "--workers",
                            str(workers),
                            "--samples",
                            str(args.samples),
                            *repos.get(name, []),
                        )
                    )
                    if not args.samples - max(1, workers) * BATCH < result["samples"] <= args.samples:  # (partial batches dropped or not)
                        raise SystemExit(f"{name} delivered {result['samples']} samples")
                    results[name, writer].append(result)
            for (name, writer), runs in results.items():
                rows.append(
                    (
                        workers,
                        name,
                        writer,
                        statistics.median(r["samples"] / r["wall"] for r in runs),
                        statistics.median(r["cpu"] / r["samples"] * 1e6 for r in runs),
                        statistics.median(r["first"] for r in runs),
                        [r["samples"] / r["wall"] for r in runs],
                    )
                )
        floor = next(rate for w, name, _, rate, *_ in rows if name == "floor") if "floor" in names else None
        print("| num_workers | loader | samples/s | shardstream / it | of floor | CPU us/sample | first batch s | all runs (samples/s) |")
        print("|---|---|---|---|---|---|---|---|")
        for workers, name, writer, rate, cpu, first, each in rows:
            # shardstream on the same writer's shards, else on the first writer's
            ours = next((r for w, n, wr, r, *_ in rows if w == workers and n == "shardstream" and wr == writer), None)
            ours = ours or next((r for w, n, wr, r, *_ in rows if w == workers and n == "shardstream"), None)
            label = f"{name} {versions[name]}".strip() if name != "floor" else "floor (in-memory list)"
            if name == "baseline":
                label = f"shardstream {versions[name]} (--baseline)"
            if name in ("shardstream", "baseline") and writers != ["shardstream"]:
                label += f", {writer}-written shards"
            vs = f"{ours / rate:.2f}x" if ours else ""
            of_floor = f"{rate / floor:.2f}" if floor else ""
            print(
                f"| {workers} | {label} | {rate:,.0f} | {vs} | {of_floor} | {cpu:.1f} | {first:.3f} | "
                f"{', '.join(f'{x:,.0f}' for x in sorted(each))} |"
            )
        print(
            f"(medians of {args.repeats} interleaved passes, each a fresh process, over {args.samples:,} samples of 1 KiB + "
            f"a JSON label, batch {BATCH}; floor: the same function + collate over the samples in memory, one process"
            + (f"; shardstream's workers started by {START_METHOD}" if START_METHOD else "")
            + "; CPU: the process and every process under it, a forkserver's server and workers included)"
        )
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
