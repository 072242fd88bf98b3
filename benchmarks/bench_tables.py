"""Parquet tables into torch batches: shardstream's columnar path against pyarrow's own reader (the
floor) and the peers, each in a venv of its own, interleaved, medians of CPU-time rates.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tables.py [--rows 10000000] [--files 8]
        [--group 131072] [--batch 256,4096] [--workers 0,2] [--repeats 3] [--where local,s3]
        [--latency 0.03] [--max-seconds 20] [--only floor,shardstream,...] [--steady | --micro]

Contenders (a fresh process each pass, in the venv named by ``--NAME-python``):

- ``floor``: ``pyarrow.parquet.ParquetFile(f).iter_batches(batch_size, columns)``, each column
  ``torch.from_numpy``: no shuffle, no plan, nothing else (workers: files dealt round-robin);
- ``shardstream`` / ``shardstream-shuffled``: ``ShardStream(Table(files, columns=...),
  batch_size, shuffle=False | Shuffle(10000))``, columnar batches, through ``make_loader``;
- ``polars``: a DataModule's way, ``pl.scan_parquet(files).slice(offset, B).collect()`` per batch,
  then ``torch.from_numpy`` per column (workers: batches dealt round-robin; spawned, as polars'
  thread pool does not survive a fork);
- ``litdata``: ``index_parquet_dataset`` once, then ``StreamingDataset(item_loader=ParquetLoader())``
  and ``StreamingDataLoader`` (spawned workers);
- ``datasets``: ``load_dataset("parquet", data_files=..., streaming=True).with_format("torch")``
  under torch's ``DataLoader``.

Peers' venvs (torch 2.13.0 CPU shared from the project's venv through a ``.pth`` file, so no other
torch is installed; each peer's own pyarrow/numpy come first):

    python -m venv /tmp/tb-venv-polars && echo $SITE > /tmp/tb-venv-polars/lib/python3.11/site-packages/zz_torch.pth
    /tmp/tb-venv-polars/bin/pip install polars==2.1.0     # and litdata==0.2.76, datasets==5.2.0 alike

The table: ``--rows`` rows of 7 float32 columns and one int64 in ``--files`` files of row groups of
``--group`` rows, in /dev/shm (warm page cache: the figures are the loaders' CPU, not a disk's).
``--where s3`` serves the same files from a real S3-compatible server (``--server``, default s3rver:
``benchmarks/s3server.py``; moto copies a whole object for every ranged GET) behind
``latency_proxy.py`` (``--latency`` seconds before each request). Every pass reads 8 columns, or 2 for the projected read check.

Rates are rows per CPU second (this process and its workers): the machine these run on is shared
and loaded, where wall time measures the neighbours. A pass stops after ``--max-seconds`` of wall
time (a slow peer's rate is then over the rows it delivered). The report prints one line per
contender and setting with the median, the ratio to the floor, and for shardstream its
``stats()`` bytes against the projected columns' chunk bytes (from the footers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch.utils.data

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
COLUMNS = [f"f{i}" for i in range(7)] + ["label"]
SHUFFLE = 10_000
PASS_START_S = 300.0  # seconds a pass may take beyond --max-seconds to start (imports, workers, footers) on a loaded machine
CONTENDERS = ("floor", "shardstream", "shardstream-shuffled", "polars", "litdata", "datasets")


def cpu_seconds() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# -- the table ------------------------------------------------------------------------------------


def make_table(root: str, rows: int, files: int, group: int) -> list[str]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(root, exist_ok=True)
    paths, per = [], -(-rows // files)
    for f in range(files):
        first, n = f * per, min(per, rows - f * per)
        rng = np.random.default_rng(f)
        table = pa.table({**{c: rng.random(n, dtype=np.float32) for c in COLUMNS[:7]}, "label": np.arange(first, first + n, dtype=np.int64)})
        path = os.path.join(root, f"part-{f:03d}.parquet")
        pq.write_table(table, path, row_group_size=group)
        paths.append(path)
    return paths


def projected_bytes(paths: list[str], columns: list[str]) -> int:
    """The projected columns' chunk bytes, from the footers: what a projected read must not exceed
    (plus each footer once)."""
    import pyarrow.parquet as pq

    total = 0
    for path in paths:
        meta = pq.ParquetFile(path).metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for c in range(group.num_columns):
                chunk = group.column(c)
                if chunk.path_in_schema in columns:
                    total += chunk.total_compressed_size
    return total


# -- one pass, in the contender's venv ------------------------------------------------------------


def storage(args) -> dict:
    return {"endpoint_url": args.endpoint} if args.endpoint else {}


def urls(args) -> list[str]:
    return json.loads(args.urls)


def floor_batches(args, columns):
    import pyarrow.parquet as pq
    import torch

    class Floor(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            mine = urls(args)[info.id :: info.num_workers] if info else urls(args)
            fs = None
            if args.endpoint:
                import s3fs

                fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": args.endpoint})
            for url in mine:
                with fs.open(url, "rb", block_size=8 << 20) if fs else open(url, "rb") as f:
                    for batch in pq.ParquetFile(f).iter_batches(batch_size=args.batch, columns=columns):
                        yield {c: torch.from_numpy(batch.column(c).to_numpy()) for c in columns}

    return torch.utils.data.DataLoader(Floor(), batch_size=None, num_workers=args.workers)


def shardstream_batches(args, columns, shuffled: bool):
    sys.path.insert(0, REPO)
    from shardstream import ShardStream, Shuffle, Store, Table, World, make_loader

    store = Store(options=storage(args)) if args.endpoint else Store()
    ds = ShardStream(
        Table(urls(args), columns=columns),
        batch_size=args.batch,
        shuffle=Shuffle(SHUFFLE) if shuffled else False,
        world=World(0, 1),
        store=store,
    )
    assert ds.columnar
    if args.workers == 0:
        return ds, ds
    return make_loader(ds, num_workers=args.workers, pin_memory=False, log_interval=None), ds


class PolarsSlices(torch.utils.data.IterableDataset):
    """polars' batches, ``lazy.slice(offset, B).collect()``, dealt round-robin to the workers (a
    class of module scope: spawned workers receive it pickled)."""

    def __init__(self, files: list[str], options: dict | None, columns: list[str], batch: int, total: int):
        super().__init__()
        self.files, self.options, self.columns, self.batch, self.total = files, options, columns, batch, total

    def __iter__(self):
        import polars as pl

        info = torch.utils.data.get_worker_info()
        k, n = (info.id, info.num_workers) if info else (0, 1)
        lazy = pl.scan_parquet(self.files, storage_options=self.options).select(self.columns)
        for offset in range(k * self.batch, self.total, n * self.batch):
            frame = lazy.slice(offset, self.batch).collect()
            yield {c: torch.from_numpy(frame[c].to_numpy()) for c in self.columns}


def polars_batches(args, columns):
    import polars as pl

    options = {"aws_endpoint_url": args.endpoint, "aws_allow_http": "true", "aws_region": "us-east-1"} if args.endpoint else None
    files = urls(args)
    total = pl.scan_parquet(files, storage_options=options).select(pl.len()).collect().item()
    slices = PolarsSlices(files, options, columns, args.batch, total)
    if not args.workers:
        return torch.utils.data.DataLoader(slices, batch_size=None)
    # Spawned workers: this process has run polars' thread pool (the count above), which a forked
    # child inherits without its threads; its collect() then hangs (a 2-worker pass under fork was
    # killed by hand after 7 minutes). A worker that sends nothing for the pass's time and a start's
    # fails the pass (DataLoader's timeout) instead of waiting for good.
    return torch.utils.data.DataLoader(
        slices, batch_size=None, num_workers=args.workers, multiprocessing_context="spawn", timeout=args.max_seconds + PASS_START_S
    )


def litdata_batches(args, columns):
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.item_loader import ParquetLoader

    ds = StreamingDataset(args.litdata_dir, item_loader=ParquetLoader(), shuffle=False)
    kw = {"multiprocessing_context": "spawn"} if args.workers else {}
    return StreamingDataLoader(ds, batch_size=args.batch, num_workers=args.workers, **kw)


def datasets_batches(args, columns):
    import torch
    from datasets import load_dataset

    kw = {"storage_options": {"client_kwargs": {"endpoint_url": args.endpoint}}} if args.endpoint else {}
    ds = load_dataset("parquet", data_files=urls(args), streaming=True, split="train", columns=columns, **kw)
    return torch.utils.data.DataLoader(ds.with_format("torch"), batch_size=args.batch, num_workers=args.workers)


def one_pass(args) -> dict:
    import torch.utils.data  # noqa: F401  (imports before the clock, for every contender alike)

    columns = COLUMNS[: args.columns]
    name = args.name
    t, c = time.perf_counter(), cpu_seconds()
    ds = None
    if name == "floor":
        loader = floor_batches(args, columns)
    elif name.startswith("shardstream"):
        loader, ds = shardstream_batches(args, columns, name.endswith("shuffled"))
    elif name == "polars":
        loader = polars_batches(args, columns)
    elif name == "litdata":
        loader = litdata_batches(args, columns)
    elif name == "datasets":
        loader = datasets_batches(args, columns)
    else:
        raise SystemExit(f"no contender {name}")
    rows, first, deadline = 0, None, t + args.max_seconds
    key = columns[0]
    it = iter(loader)
    for batch in it:
        if first is None:
            first = time.perf_counter() - t
        rows += len(batch[key])
        if time.perf_counter() > deadline:
            break
    del it  # workers stop (and are reaped, their CPU counted) before the clock stops
    wall, cpu = time.perf_counter() - t, cpu_seconds() - c
    out = {"rows": rows, "wall": wall, "cpu": cpu, "first": first or 0.0}
    if ds is not None and args.workers == 0:
        stats = ds.stats()
        out["bytes_read"], out["requests"] = stats.get("bytes_read", 0), stats.get("requests", 0)
    return out


def steady(args) -> None:
    """``--steady``: whole passes over the local table in this one process (start-up excluded),
    interleaved: the floor, shardstream unshuffled and shuffled, rows per CPU second of the
    process. The per-row cost without the 6 s cap, which on a loaded machine cuts the slower
    passes short and leaves their start-up (imports, footers) as most of their CPU."""
    import warnings

    import numpy as np
    import pyarrow.parquet as pq
    import torch

    sys.path.insert(0, REPO)
    from shardstream import ShardStream, Shuffle, Table, World

    warnings.simplefilter("ignore")  # torch's read-only warning in the floor
    files, columns, batch = urls(args), COLUMNS[: args.columns], int(args.batch)

    def floor() -> int:
        n = 0
        for path in files:
            with open(path, "rb") as f:
                for b in pq.ParquetFile(f).iter_batches(batch_size=batch, columns=columns):
                    n += len({c: torch.from_numpy(b.column(c).to_numpy()) for c in columns}[columns[0]])
        return n

    def shardstream(shuffled: bool) -> int:
        ds = ShardStream(Table(files, columns=columns), batch_size=batch, shuffle=Shuffle(SHUFFLE) if shuffled else False, world=World(0, 1))
        return sum(len(b[columns[0]]) for b in ds)

    passes = {"floor": floor, "shardstream": lambda: shardstream(False), "shardstream-shuffled": lambda: shardstream(True)}
    rates: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, one in passes.items():
            c = time.process_time()
            rows = one()
            rates.setdefault(name, []).append(rows / (time.process_time() - c) / 1e6)
    for name, r in rates.items():
        ratio = float(np.median(r) / np.median(rates["floor"]))
        print(f"steady batch {batch} {name:22} {np.median(r):6.2f} M rows/CPU-s  x floor {ratio:.2f}  runs {', '.join(f'{x:.2f}' for x in r)}")


def micro(args) -> None:
    """``--micro``: the shuffled path's own stages in ns of CPU a row (process time, medians of
    ``--repeats``): ``BufferShuffler.push_array`` on a full ``Shuffle(10000)`` buffer at 131,072
    rows a call (a row group: what the pipeline does) and at 4,096 and 1,000 (small row groups),
    then a pass's ``Blocks.gather`` and ``columnar_batch`` of batches of ``--batch`` over the
    first file's row groups as the pipeline meets them (read, added, their refs shuffled, each
    row group freed once gathered; the packing of a row group counted in the gather)."""
    import random

    import numpy as np
    import pyarrow.parquet as pq
    import torch  # noqa: F401  (imported before the clock: columnar_batch's first call would)

    sys.path.insert(0, REPO)
    from shardstream.pipeline.table import BLOCK_BITS, Blocks, columnar_batch
    from shardstream.plan.shuffle import BufferShuffler

    batch = int(args.batch)
    for per in (131_072, 4096, 1000):
        runs = []
        for _ in range(args.repeats):
            shuffler = BufferShuffler(SHUFFLE, SHUFFLE // 10, random.Random(1))
            shuffler.push_array(np.arange(2 * SHUFFLE, dtype=np.int64))
            chunk = np.arange(per, dtype=np.int64) + (5 << BLOCK_BITS)
            calls = max(8, 1_048_576 // per)
            c = time.process_time()
            for _ in range(calls):
                shuffler.push_array(chunk)
            runs.append((time.process_time() - c) / (calls * per) * 1e9)
        print(f"micro shuffle push_array {per:7} rows a call: {np.median(runs):6.1f} ns/row  runs {', '.join(f'{x:.1f}' for x in runs)}")
    file = pq.ParquetFile(urls(args)[0])
    tables = [file.read_row_group(g) for g in range(file.num_row_groups)]
    gather, collate = [], []
    for _ in range(args.repeats):
        blocks, shuffler = Blocks(), BufferShuffler(SHUFFLE, SHUFFLE // 10, random.Random(2))
        pending, rows, tg, tc = np.empty(0, dtype=np.int64), 0, 0.0, 0.0
        for table in tables:
            b = blocks.add(table, table.num_rows)
            pending = np.concatenate([pending, shuffler.push_array(np.arange(b << BLOCK_BITS, (b << BLOCK_BITS) + table.num_rows, dtype=np.int64))])
            start = 0
            while len(pending) - start >= batch:
                c = time.process_time()
                got = blocks.gather(pending[start : start + batch])
                c2 = time.process_time()
                columnar_batch(got, {})
                tg, tc, rows, start = tg + c2 - c, tc + time.process_time() - c2, rows + batch, start + batch
            pending = pending[start:]
        gather.append(tg / rows * 1e9)
        collate.append(tc / rows * 1e9)
    for name, runs in (("gather", gather), ("columnar_batch", collate)):
        print(f"micro {name} batch {batch}: {np.median(runs):6.1f} ns/row  runs {', '.join(f'{x:.1f}' for x in runs)}")


def version(name: str) -> str:
    import importlib.metadata as md

    if name.startswith("shardstream"):
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    package = {"floor": "pyarrow", "polars": "polars", "litdata": "litdata", "datasets": "datasets"}[name]
    return f"{package} {md.version(package)}, pyarrow {md.version('pyarrow')}, torch {md.version('torch')}"


# -- the driver ------------------------------------------------------------------------------------


def run(python: str, *args: str, env: dict | None = None, timeout: float = 900) -> str:
    done = subprocess.run([python, os.path.abspath(__file__), *args], capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{python} {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--group", type=int, default=131_072)
    parser.add_argument("--batch", default="256,4096")
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--where", default="local")
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--server", default="s3rver", help="the S3 server for --where s3 (benchmarks/s3server.py: s3rver, seaweedfs, moto)")
    parser.add_argument("--max-seconds", type=float, default=20.0)
    parser.add_argument("--only", default=",".join(CONTENDERS))
    parser.add_argument("--data", default="/dev/shm/bench-tables")
    for peer in ("polars", "litdata", "datasets"):
        parser.add_argument(f"--{peer}-python", default=f"/tmp/tb-venv-{peer}/bin/python")
    # internal: one pass (or an index) in the venv the driver chose
    parser.add_argument("--pass", dest="name")
    parser.add_argument("--index-litdata")
    parser.add_argument("--urls")
    parser.add_argument("--endpoint")
    parser.add_argument("--columns", type=int, default=8)
    parser.add_argument("--litdata-dir")
    parser.add_argument("--version")
    parser.add_argument("--steady", action="store_true", help="whole passes in this process, local only (see steady())")
    parser.add_argument("--micro", action="store_true", help="the shuffle's and the gather's ns a row, local only (see micro())")
    args = parser.parse_args()
    if args.version:
        print(version(args.version))
        return
    if args.index_litdata:
        from litdata import index_parquet_dataset

        index_parquet_dataset(args.index_litdata)
        print("indexed")
        return
    if args.name:
        args.batch, args.workers = int(args.batch), int(args.workers)
        print(json.dumps(one_pass(args)))
        return

    rows_tag = f"{args.rows}-{args.files}-{args.group}"
    root = os.path.join(args.data, rows_tag)
    if not os.path.exists(os.path.join(root, "done")):
        make_table(root, args.rows, args.files, args.group)
        open(os.path.join(root, "done"), "w").close()
    paths = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".parquet"))
    if args.micro:
        args.urls = json.dumps(paths)
        print(f"# micro: {args.rows} rows x 8 columns, groups {args.group}; load {os.getloadavg()[0]:.1f}")
        for batch in args.batch.split(","):
            args.batch = batch
            micro(args)
        return
    if args.steady:
        args.urls = json.dumps(paths)
        threads = os.environ.get("OMP_NUM_THREADS", "(unset)")
        print(f"# {args.rows} rows x 8 columns in {len(paths)} files, groups {args.group}; OMP_NUM_THREADS={threads}, load {os.getloadavg()[0]:.1f}")
        for batch in args.batch.split(","):
            args.batch = batch
            steady(args)
        return
    names = [n for n in args.only.split(",") if n]
    pythons = {n: getattr(args, f"{n}_python", sys.executable) for n in names}
    if "litdata" in names:  # litdata's index.json in a copy of its own (a folder with index.json is a shardstream manifest)
        lit = os.path.join(args.data, rows_tag + "-litdata")
        if not os.path.exists(os.path.join(lit, "index.json")):
            os.makedirs(lit, exist_ok=True)
            for p in paths:
                target = os.path.join(lit, os.path.basename(p))
                if not os.path.exists(target):
                    os.link(p, target)
            run(pythons["litdata"], "--index-litdata", lit)
    print(f"# {args.rows} rows x 8 columns in {len(paths)} files, row groups of {args.group}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for n in names:
        print(f"# {n}: {run(pythons[n], '--version', n)}")
    projected = {8: projected_bytes(paths, COLUMNS), 2: projected_bytes(paths, COLUMNS[:2])}

    servers = []
    try:
        places: list[tuple[str, list[str], str | None]] = []
        for where in args.where.split(","):
            if where == "local":
                places.append(("local", paths, None))
            elif where == "s3":
                sys.path.insert(0, HERE)
                from latency_proxy import start_proxy  # type: ignore[import-not-found]
                from s3server import s3_server  # type: ignore[import-not-found]

                running = s3_server(args.server, bucket="bench")  # credentials into os.environ: every pass inherits them
                server = running.__enter__()
                servers.append(lambda running=running: running.__exit__(None, None, None))
                print(f"# S3: {server.version()}, {args.latency * 1000:.0f} ms before each request (latency_proxy.py)", flush=True)
                client = server.client()
                for p in paths:
                    client.upload_file(p, "bench", f"t/{os.path.basename(p)}")
                proxy = start_proxy(server.endpoint, args.latency)
                url, _ = proxy.__enter__()
                servers.append(lambda proxy=proxy: proxy.__exit__(None, None, None))
                places.append(("s3", [f"s3://bench/t/{os.path.basename(p)}" for p in paths], url))
        results: dict[tuple, list[dict]] = {}
        for where, files, endpoint in places:
            for batch in args.batch.split(","):
                for workers in args.workers.split(","):
                    for _ in range(args.repeats):
                        for n in names:  # interleaved: each repeat runs every contender once
                            if where == "s3" and n == "litdata":
                                continue  # (litdata's S3 Parquet needs its own index upload: left out)
                            extra = ["--litdata-dir", os.path.join(args.data, rows_tag + "-litdata")] if n == "litdata" else []
                            extra += ["--endpoint", endpoint] if endpoint else []
                            try:
                                flags = ["--urls", json.dumps(files), "--batch", batch, "--workers", workers, "--max-seconds", str(args.max_seconds)]
                                got = json.loads(run(pythons[n], "--pass", n, *flags, *extra, timeout=args.max_seconds + PASS_START_S))
                            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                                print(f"# {n} {where} batch {batch} workers {workers}: {str(exc).strip().splitlines()[-1]}", flush=True)
                                continue
                            results.setdefault((where, int(batch), int(workers), n), []).append(got)
                # the projected read: 2 of 8 columns, shardstream alone, bytes against the chunks'
                if "shardstream" in names:  # (once per batch size: it ran only when the last --workers value was the first)
                    extra = ["--endpoint", endpoint] if endpoint else []
                    flags = ["--urls", json.dumps(files), "--batch", batch, "--workers", "0", "--columns", "2", "--max-seconds", "600"]
                    got = json.loads(run(sys.executable, "--pass", "shardstream", *flags, *extra))
                    print(
                        f"# projected read ({where}, batch {batch}): 2 of 8 columns, bytes_read {got['bytes_read']:,} "
                        f"for {projected[2]:,} chunk bytes (+{got['bytes_read'] - projected[2]:,} footers; "
                        f"all 8 columns: {projected[8]:,}), {got['requests']} requests",
                        flush=True,
                    )
        head = f"{'where':6} {'batch':>5} {'workers':>7} {'contender':22} {'M rows/CPU-s':>12} {'x floor':>7} {'M rows/s wall':>13}"
        print(f"{head} {'rows':>10}  runs (M rows/CPU-s)")
        for (where, batch, workers, n), runs in sorted(results.items()):
            rate = statistics.median(r["rows"] / r["cpu"] for r in runs) / 1e6
            wall = statistics.median(r["rows"] / r["wall"] for r in runs) / 1e6
            floor = results.get((where, batch, workers, "floor"))
            ratio = rate / (statistics.median(r["rows"] / r["cpu"] for r in floor) / 1e6) if floor else float("nan")
            each = ", ".join(f"{r['rows'] / r['cpu'] / 1e6:.2f}" for r in runs)
            rows = statistics.median(r["rows"] for r in runs)
            print(f"{where:6} {batch:5d} {workers:7d} {n:22} {rate:12.2f} {ratio:7.2f} {wall:13.2f} {rows:10.0f}  {each}")
    finally:
        for close in reversed(servers):
            close()


if __name__ == "__main__":
    main()
