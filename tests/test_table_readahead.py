"""A Parquet table's read-ahead over a whole pass, on a moto S3 server with real ranged GETs: the
next window's row groups are requested while the current window is consumed (issue 33, issue 35
item 5), inside the worker's one budget, nothing read twice, and resume exact across windows."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import scaled

import shardstream.format.parquet as parquet_module
import shardstream.pipeline.table as table_module
from shardstream import Read, Schedule, ShardStream, Shuffle, Store, World
from shardstream.format.parquet import FOOTERS, Table

ROWS, GROUP, FILES = 4_000, 1_000, 2  # 8 row groups of 16 KB of projected columns (id, x) each
BATCH = 500
PER_EPOCH = FILES * ROWS // BATCH  # 16 batches a data epoch; a pass of 32 steps is two windows
BUDGET, BLOCK = 24 << 10, 4 << 10  # one and a half row groups' projected bytes


@pytest.fixture
def s3_table(s3, tmp_path):
    bucket, options, client = s3
    root = tmp_path / "t"
    root.mkdir()
    for f in range(FILES):
        rng = np.random.default_rng(f)
        ids = np.arange(f * ROWS, (f + 1) * ROWS, dtype=np.int64)
        table = pa.table({"id": ids, "x": rng.random(ROWS), "y": rng.random(ROWS)})
        path = str(root / f"part-{f}.parquet")
        pq.write_table(table, path, row_group_size=GROUP, compression="none")
        client.upload_file(path, bucket, f"table/{os.path.basename(path)}")
    FOOTERS.clear()
    return f"s3://{bucket}/table/", options


def stream(url, options, readahead, steps=2 * PER_EPOCH, shuffle=False):
    store = Store(options=options, read=Read(read_size=BLOCK, readahead_bytes=readahead))
    ds = ShardStream(
        Table(url, columns=["id", "x"]),
        batch_size=BATCH,
        shuffle=Shuffle(700) if shuffle else False,
        world=World(0, 1),
        seed=3,
        store=store,
        schedule=Schedule(steps=steps),
    )
    assert ds.columnar
    return ds


@pytest.fixture
def requests_log(monkeypatch):
    """Every range the table's reads open (one ranged GET each: a row group's run, through the
    read-ahead or not, or a footer), as (file, start, end), in order."""
    log: list[tuple[str, int, int]] = []
    for module in (table_module, parquet_module):
        real = module.open_range

        def logged(url, start, end, *args, real=real, **kwargs):
            log.append((url, start, end))
            return real(url, start, end, *args, **kwargs)

        monkeypatch.setattr(module, "open_range", logged)
    return log


def wait_for(predicate, seconds=20.0):
    event = threading.Event()
    for _ in range(int(scaled(seconds) / 0.05)):
        if predicate():
            return True
        event.wait(0.05)  # a fetch thread's progress has no event to wait on
    return predicate()


def test_the_next_windows_first_row_group_is_requested_before_this_windows_last_batch(s3_table, requests_log):
    url, options = s3_table
    plain = stream(url, options, 0)
    requests_log.clear()  # the footers, read as the table was indexed
    before = plain.stats()
    reference = [[int(i) for i in b["id"]] for b in plain]
    groups = len(plain.manifest.counts)
    assert len(reference) == 2 * PER_EPOCH and groups == 8
    plain_gets, plain_bytes = plain.stats()["requests"] - before["requests"], plain.stats()["bytes_read"] - before["bytes_read"]
    assert requests_log[:groups] == requests_log[groups:] and len(requests_log) == 2 * groups  # each window reads every row group once
    window_bytes = sum(b - a for _, a, b in requests_log[:groups])
    requests_log.clear()

    ds = stream(url, options, BUDGET)
    requests_log.clear()  # its footers, read as it indexed the table
    base = ds.stats()
    it = iter(ds)
    got = []
    try:
        for _ in range(PER_EPOCH - 1):  # every batch of window 0 but its last, which the consumer has not asked for
            got.append([int(i) for i in next(it)["id"]])
        # The consumer holds window 0's last-but-one batch: window 0's last row group is read and
        # decoded, and window 1's first row group is requested (the same object and range as
        # window 0's first: no shuffle), before window 0's last batch is taken.
        assert wait_for(lambda: len(requests_log) > groups), requests_log
        assert requests_log[groups] == requests_log[0]
        # the counters say it too: a GET past window 0's, and bytes of it arriving
        assert ds.stats()["requests"] - base["requests"] > groups
        assert wait_for(lambda: ds.stats()["bytes_read"] - base["bytes_read"] > window_bytes), (ds.stats(), window_bytes)
        assert ds.stats()["readahead_peak"] <= BUDGET + BLOCK
        got += [[int(i) for i in b["id"]] for b in it]
    finally:
        it.close()
    assert got == reference  # every row once per window, in the planned order
    stats = ds.stats()
    # nothing read twice: the same GETs and bytes as without read-ahead, all through the read-ahead, none dropped
    assert (stats["requests"] - base["requests"], stats["bytes_read"] - base["bytes_read"]) == (plain_gets, plain_bytes)
    assert sorted(requests_log) == sorted(requests_log[:groups] * 2)
    assert stats["readahead_fetched"] == stats["bytes_read"] - base["bytes_read"] and stats["readahead_wasted"] == 0
    assert 0 < stats["readahead_peak"] <= BUDGET + BLOCK  # the worker's one budget plus the block waited on


def ids_of(loader, stop=None):
    got = []
    for batch in loader:
        got.append([int(i) for i in batch["id"]])
        if stop is not None and len(got) == stop:
            break
    return got, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("stop", [PER_EPOCH - 1, PER_EPOCH + 3])
def test_a_shuffled_pass_over_two_windows_resumes_exactly_with_read_ahead(s3_table, stop):
    url, options = s3_table
    reference, _ = ids_of(stream(url, options, 0, shuffle=True))
    assert sorted(i for b in reference for i in b) == sorted(list(range(FILES * ROWS)) * 2)
    ahead, _ = ids_of(stream(url, options, BUDGET, shuffle=True))
    assert ahead == reference  # read-ahead changes when bytes arrive, never which rows come in which batch
    _, state = ids_of(stream(url, options, BUDGET, shuffle=True), stop)
    resumed = stream(url, options, BUDGET, shuffle=True)
    resumed.load_state_dict(state)
    rest, _ = ids_of(resumed)
    assert rest == reference[stop:]
    assert 0 < resumed.stats()["readahead_peak"] <= BUDGET + BLOCK


class Counted:
    """Counters as the storage layer adds them (stats.WorkerCounters' ``add``)."""

    def __init__(self):
        self.values: dict[str, int] = {}

    def add(self, name, value=1):
        self.values[name] = self.values.get(name, 0) + value


def test_a_row_groups_reader_sends_its_runs_requests_at_start_and_says_what_is_left(s3_table):
    """What the read-ahead asks of a row group's reader to send its requests ahead (as for tar
    ranges): ``start()`` sends a GET per projected run before any byte is read, ``remaining()``
    counts down to 0, the bytes are the runs' own, and ``close()`` ends runs never read."""
    from shardstream.pipeline.table import RunsReader, TableSource

    url, options = s3_table
    m = ShardStream(Table(url, columns=["id", "y"]), batch_size=BATCH, world=World(0, 1), store=Store(options=options)).manifest
    counters = Counted()
    source = TableSource(m, storage_options=options, counters=counters)
    runs = source.runs(1)
    assert len(runs) == 2  # id and y, x between them
    size = sum(b - a for a, b in runs)
    whole = b"".join(bytes(parquet_module.read_bytes(m.file_url(int(m.group_file[1])), a, b, options, config=source.config)) for a, b in runs)
    reader = RunsReader(source, int(m.group_file[1]), runs)
    assert reader.remaining() == size
    reader.start()
    assert counters.values.get("requests") == 2  # both runs' GETs sent, nothing read yet
    got = b""
    while chunk := reader(BLOCK):
        got += bytes(chunk)
        assert reader.remaining() == size - len(got)
    assert got == whole and counters.values["requests"] == 2  # no GET sent twice
    reader.close()
    abandoned = RunsReader(source, int(m.group_file[1]), runs)
    abandoned.start()
    assert len(abandoned(BLOCK)) == BLOCK
    abandoned.close()  # its second run, opened and never read, is ended too
    assert not abandoned._opened and abandoned._read is None
