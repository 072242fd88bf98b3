"""The columnar table path's own guarantees: the array shuffle of row refs draws what the
per-row loop draws (so per-row and columnar batches, and a resume, agree), pad mode's
``__valid__`` on columnar batches, and no read-only warning from torch reaching the user."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardstream import ShardStream, Shuffle, World, make_loader
from shardstream.plan.shuffle import BufferShuffler, draw_uniform

ROWS = (300, 260, 240)


def same(row):
    return row  # a per-sample transform: the per-row path (module level: workers may pickle it)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    root = tmp_path_factory.mktemp("columnar")
    first = 0
    for f, n in enumerate(ROWS):
        ids = np.arange(first, first + n, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": (ids * 0.5).astype(np.float32)}), str(root / f"part-{f}.parquet"), row_group_size=64)
        first += n
    return str(root)


def test_draw_uniform_is_the_python_generators_stream():
    a, b = random.Random("shardstream:1:2:3:4"), random.Random("shardstream:1:2:3:4")
    a.random()
    b.random()
    drawn = draw_uniform(b, 1000)
    assert drawn.tolist() == [a.random() for _ in range(1000)]
    assert b.getstate() == a.getstate()  # advanced past them: the next draws agree too
    assert b.random() == a.random() and b.getrandbits(40) == a.getrandbits(40)


@pytest.mark.parametrize("size", [2, 3, 17, 500])
def test_push_array_matches_the_loop(size):
    rng = random.Random(size)
    for trial in range(40):
        initial = rng.randint(1, size)
        seed = rng.random()
        loop, arrays = BufferShuffler(size, initial, random.Random(seed)), BufferShuffler(size, initial, random.Random(seed))
        start = 0
        for n in [rng.randint(1, 3 * size + 5) for _ in range(rng.randint(1, 6))]:
            chunk = np.arange(start, start + n, dtype=np.int64)
            start += n
            out: list[int] = []
            loop.push(chunk.tolist(), out)
            assert arrays.push_array(chunk).tolist() == out, (size, initial, trial)
            assert np.asarray(arrays.buffer).tolist() == list(loop.buffer)  # the same buffer, slot by slot
            assert arrays.rng.getstate() == loop.rng.getstate()
        assert arrays.drain() == loop.drain()


def run(loader, stop=None):
    got = []
    for batch in loader:
        got.append(([int(i) for i in batch["id"]], batch["__valid__"].tolist() if "__valid__" in batch else None))
        if stop is not None and len(got) == stop:
            break
    return got, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("workers", [0, 2])
def test_pad_mode_columnar_batches_carry_the_per_row_valid_mask(table, workers):
    def batches(rank, transform):
        ds = ShardStream(table, batch_size=48, world=World(rank, 3), mode="pad", seed=3, shuffle=Shuffle(100), transform=transform)
        assert ds.columnar == (transform is None)
        return run(make_loader(ds, num_workers=workers, pin_memory=False, log_interval=None))[0]

    repeats = 0
    for rank in range(3):
        columnar, per_row = batches(rank, None), batches(rank, same)
        assert columnar == per_row  # the same rows in the same order, the same mask
        for ids, valid in columnar:
            assert valid is not None and len(valid) == len(ids) == 48
            repeats += valid.count(False)
    assert repeats == 3 * 48 * len(batches(0, None)) - sum(ROWS)  # the plan's repeats, each marked once


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_with_a_full_array_shuffle_and_pad_mode(table, workers):
    def fresh():
        ds = ShardStream(table, batch_size=16, world=World(1, 3), mode="pad", seed=9, shuffle=Shuffle(120))
        loader = make_loader(ds, num_workers=workers, pin_memory=False, log_interval=None)
        loader.set_epoch(2)
        return loader

    reference, _ = run(fresh())
    for stop in (3, len(reference) // 2, len(reference) - 1):
        _, state = run(fresh(), stop)
        resumed = fresh()
        resumed.load_state_dict(state)
        assert run(resumed)[0] == reference[stop:], f"stopped after {stop}"


def test_drop_mode_columnar_batches_have_no_valid(table):
    batch = next(iter(ShardStream(table, batch_size=16, world=World(0, 1))))
    assert "__valid__" not in batch and batch["x"].dtype == torch.float32


def test_no_read_only_warning_reaches_the_user(table):
    """torch warns once per process: a fresh process, every warning recorded, nothing filtered."""
    script = f"""
import warnings
warnings.simplefilter("always")
from shardstream import ShardStream, Table, World
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for shuffled in (False, True):
        for batch in ShardStream(Table({table!r}, columns=["id", "x"]), batch_size=64, world=World(0, 1), shuffle=shuffled):
            assert batch["x"].dtype.is_floating_point
    warnings.warn("a user's own warning still shows", UserWarning)
print(repr([str(w.message)[:60] for w in seen]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == repr(["a user's own warning still shows"]), out.stdout + out.stderr


def test_gather_across_row_groups_matches_arrow(tmp_path):
    """Blocks.gather against Arrow's own take over the same rows: shuffled batches across row groups
    (packed records), consecutive runs across them (slices joined), a column with nulls in one row
    group only (numbers in the others), strings, mixed widths, after packing as before."""
    from shardstream.pipeline.table import BLOCK_BITS, Blocks

    n, groups = 50, 4
    ids = np.arange(n * groups, dtype=np.int64)
    maybe = pa.array([None if i == 77 else float(i) for i in ids], type=pa.float64())  # a null in row group 1 only
    table = pa.table(
        {"id": ids, "small": (ids % 100).astype(np.int8), "x": (ids * 0.5).astype(np.float32), "maybe": maybe, "name": [f"r{i}" for i in ids]}
    )
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, row_group_size=n)
    file = pq.ParquetFile(path)
    blocks = Blocks()
    for g in range(groups):
        assert blocks.add(file.read_row_group(g), 100 * n) == g  # (more refs to come than gathered here: none freed)
    whole = pa.concat_tables([file.read_row_group(g) for g in range(groups)]).combine_chunks()
    rng = np.random.default_rng(5)

    def check(rows):
        refs = (rows // n << BLOCK_BITS) | (rows % n)
        got = blocks.gather(refs).to_arrow()
        assert got.equals(whole.take(pa.array(rows))), rows

    for _ in range(3):
        check(rng.choice(n * groups, 40, replace=False))  # scattered over every row group
        check(np.sort(rng.choice(np.arange(n, 2 * n), 20, replace=False)))  # one row group, not consecutive
    check(np.arange(n - 5, n + 7))  # consecutive across a row group's end (slices joined)
    check(np.arange(2 * n + 3, 2 * n + 9))  # consecutive in a packed row group
    check(np.concatenate([np.arange(3 * n + 10, 3 * n + 13), np.arange(n + 1, n + 4)]))  # two runs, blocks out of order


def test_gather_of_a_main_block_and_stragglers_matches_arrow(tmp_path):
    """A shuffled batch is mostly one row group's rows with a few from older ones (what the buffer
    still holds): Blocks.gather takes every position from the main row group and puts the others'
    rows over theirs. Against Arrow's take: a short main row group (the others' row numbers past
    its end), stragglers first, last and in between, every column kind of the test above."""
    from shardstream.pipeline.table import BLOCK_BITS, Blocks

    n, short = 40, 9
    ids = np.arange(3 * n + short, dtype=np.int64)
    maybe = pa.array([None if i == 5 else float(i) for i in ids], type=pa.float64())  # a null in row group 0 only
    table = pa.table({"id": ids, "x": (ids * 0.5).astype(np.float32), "maybe": maybe, "name": [f"r{i}" for i in ids]})
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, row_group_size=n)
    file = pq.ParquetFile(path)
    sizes = [file.metadata.row_group(g).num_rows for g in range(file.num_row_groups)]
    assert sizes == [n, n, n, short]
    blocks = Blocks()
    for g in range(len(sizes)):
        blocks.add(file.read_row_group(g), 100 * n)
    whole = pa.concat_tables([file.read_row_group(g) for g in range(len(sizes))]).combine_chunks()
    starts = np.cumsum([0, *sizes])
    rng = np.random.default_rng(11)
    for main in (3, 1):
        for _ in range(4):
            rows = rng.choice(np.arange(starts[main], starts[main + 1]), min(sizes[main], 30), replace=False)
            stragglers = rng.choice(np.arange(0, starts[main]), 3, replace=False)
            rows = np.insert(rows, [0, len(rows) // 2, len(rows)], stragglers)  # first, in between, last
            block = np.searchsorted(starts, rows, side="right") - 1
            refs = (block << BLOCK_BITS) | (rows - starts[block])
            got = blocks.gather(refs).to_arrow()
            assert got.equals(whole.take(pa.array(rows))), rows


def frame_to_dict(frame):
    return {"id": torch.tensor(frame["id"].to_numpy())}  # drops __valid__: the stream adds it back


def frame_sees_valid(frame):
    assert frame.column_names[-1] == "__valid__" and frame.schema.field("__valid__").type == pa.bool_()
    return {"id": torch.tensor(frame["id"].to_numpy()), "seen": frame["__valid__"].to_pylist()}


def frame_to_tuple(frame):
    return (torch.tensor(frame["id"].to_numpy()), frame["__valid__"].to_pylist() if "__valid__" in frame.column_names else None)


@pytest.mark.parametrize("workers", [0, 2])
def test_batched_in_pad_mode_gets_the_valid_mask(table, workers):
    from shardstream import Batched

    def batches(rank, transform):
        ds = ShardStream(table, batch_size=48, world=World(rank, 3), mode="pad", seed=3, shuffle=Shuffle(100), transform=transform)
        return list(make_loader(ds, num_workers=workers, pin_memory=False, log_interval=None))

    repeats = 0
    for rank in range(3):
        columnar = run_batches(batches(rank, None))
        added = batches(rank, Batched(frame_to_dict))
        assert [([int(i) for i in b["id"]], b["__valid__"].tolist()) for b in added] == columnar  # the mask added after fn
        seen = batches(rank, Batched(frame_sees_valid))
        assert [([int(i) for i in b["id"]], b["seen"]) for b in seen] == columnar  # fn saw the same mask as a column
        assert all(b["__valid__"].tolist() == b["seen"] for b in seen)
        tuples = batches(rank, Batched(frame_to_tuple))
        assert [([int(i) for i in ids], valid) for ids, valid in tuples] == columnar  # a tuple: what fn put there
        repeats += sum(valid.count(False) for _, valid in columnar)
    assert repeats == 3 * 48 * len(columnar) - sum(ROWS)


def test_batched_in_drop_mode_has_no_valid(table):
    from shardstream import Batched

    ids, valid = next(iter(ShardStream(table, batch_size=16, world=World(0, 1), transform=Batched(frame_to_tuple))))
    assert valid is None and len(ids) == 16
    assert "__valid__" not in next(iter(ShardStream(table, batch_size=16, world=World(0, 1), transform=Batched(frame_to_dict))))


def run_batches(batches):
    return [([int(i) for i in b["id"]], b["__valid__"].tolist()) for b in batches]
