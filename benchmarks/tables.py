"""tables: Parquet into torch batches (a tensor per column), rows per second (from bench_tables.py).

The table: ``--rows`` rows of 7 float32 columns and one int64 in ``--files`` files of row groups
of ``--group`` rows, in the workdir (tmpfs: the loaders' CPU, not a disk's). Peers:
``shardstream`` (``ShardStream(Table(files))``, columnar batches, ``--shuffle`` for
``Shuffle(10000)``), ``pyarrow`` (``ParquetFile.iter_batches`` + ``torch.from_numpy`` per
column under torch's ``DataLoader``, files dealt to workers: the floor), ``polars``
(``scan_parquet(...).slice(offset, B).collect()`` per batch, spawned workers), ``datasets``
(``load_dataset("parquet", streaming=True).with_format("torch")`` under torch's ``DataLoader``).
"""

from __future__ import annotations

import os

UNIT = "rows/s"
PEERS = ("shardstream", "pyarrow", "polars", "datasets")
COLUMNS = [f"f{i}" for i in range(7)] + ["label"]


def add_arguments(p) -> None:
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--group", type=int, default=131_072)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--shuffle", action="store_true", help="shardstream with Shuffle(10000)")


def prepare(args, runner, peers: list[str]) -> list[dict]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = os.path.join(args.workdir, f"tables-{args.rows}-{args.files}-{args.group}")
    paths = [os.path.join(root, f"part-{f:03d}.parquet") for f in range(args.files)]
    if not all(os.path.exists(p) for p in paths):
        os.makedirs(root, exist_ok=True)
        per = -(-args.rows // args.files)
        for f, path in enumerate(paths):
            first, n = f * per, max(0, min(per, args.rows - f * per))
            rng = np.random.default_rng(f)
            table = pa.table({**{c: rng.random(n, dtype=np.float32) for c in COLUMNS[:7]}, "label": np.arange(first, first + n, dtype=np.int64)})
            pq.write_table(table, path, row_group_size=args.group)
    base = {"rows": args.rows, "files": args.files, "group": args.group, "batch": args.batch, "shuffle": args.shuffle, "runtime": args.runtime}
    return [{"workers": w, **base, "_files": paths} for w in args.workers]


class _Floor:
    def __init__(self, files, batch):
        self.files, self.batch = files, batch

    def __iter__(self):
        import pyarrow.parquet as pq
        import torch

        info = torch.utils.data.get_worker_info()
        mine = self.files[info.id :: info.num_workers] if info else self.files
        for path in mine:
            for b in pq.ParquetFile(path).iter_batches(batch_size=self.batch, columns=COLUMNS):
                yield {c: torch.from_numpy(b.column(c).to_numpy()) for c in COLUMNS}


class _PolarsSlices:
    def __init__(self, files, batch, total):
        self.files, self.batch, self.total = files, batch, total

    def __iter__(self):
        import polars as pl
        import torch

        info = torch.utils.data.get_worker_info()
        k, n = (info.id, info.num_workers) if info else (0, 1)
        lazy = pl.scan_parquet(self.files).select(COLUMNS)
        for offset in range(k * self.batch, self.total, n * self.batch):
            frame = lazy.slice(offset, self.batch).collect()
            yield {c: torch.from_numpy(frame[c].to_numpy()) for c in COLUMNS}


def measure(config: dict) -> dict:
    import torch

    from benchmarks.harness import timed_pass

    peer, workers, files, batch = config["peer"], config["workers"], config["_files"], config["batch"]

    def make():
        if peer == "shardstream":
            from benchmarks.harness import loader_options
            from shardstream import ShardStream, Shuffle, Table, World, make_loader

            shuffle = Shuffle(10000) if config["shuffle"] else False
            ds = ShardStream(Table(files, columns=COLUMNS), batch_size=batch, shuffle=shuffle, world=World(0, 1))
            return make_loader(ds, num_workers=workers, **loader_options(config))
        if peer == "pyarrow":
            floor = type("Floor", (_Floor, torch.utils.data.IterableDataset), {})(files, batch)
            return torch.utils.data.DataLoader(floor, batch_size=None, num_workers=workers)
        if peer == "polars":
            import polars as pl

            total = pl.scan_parquet(files).select(pl.len()).collect().item()
            slices = __getattr__("_PolarsDataset")(files, batch, total)
            kw = {"multiprocessing_context": "spawn"} if workers else {}  # polars' thread pool does not survive a fork
            return torch.utils.data.DataLoader(slices, batch_size=None, num_workers=workers, **kw)
        if peer == "datasets":
            from datasets import load_dataset

            ds = load_dataset("parquet", data_files=files, streaming=True, split="train", columns=COLUMNS)
            return torch.utils.data.DataLoader(ds.with_format("torch"), batch_size=batch, num_workers=workers)
        raise SystemExit(f"tables: no peer {peer}")

    return timed_pass(make, lambda b: len(b["label"]))


def __getattr__(name: str):
    """``_PolarsDataset``, made on first use (torch imported only then) yet of module scope, so
    spawned workers receive it pickled."""
    if name == "_PolarsDataset":
        import torch.utils.data

        cls = type("_PolarsDataset", (_PolarsSlices, torch.utils.data.IterableDataset), {"__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(name)
