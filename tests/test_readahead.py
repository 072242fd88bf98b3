"""The read-ahead thread: order, bounded memory, abandoned ranges, errors handed over in place."""

from __future__ import annotations

import io
import threading

import pytest

from shardstream.storage.readahead import Prefetcher


def opener(data: bytes, fail_after: int | None = None, log=None):
    def open_():
        stream = io.BytesIO(data)

        def read(n):
            if fail_after is not None and stream.tell() >= fail_after:
                raise OSError("connection reset")
            chunk = stream.read(n)
            if log is not None:
                log.append(len(chunk))
            return chunk

        return read, lambda: None

    return open_


def drain(read, n=7):
    out = b""
    while chunk := read(n):
        out += chunk
    return out


def test_ranges_come_back_whole_and_in_order():
    datas = [bytes([i]) * (100 + 37 * i) for i in range(5)]
    p = Prefetcher([opener(d) for d in datas], block_size=16, max_bytes=64)
    try:
        assert [drain(p.reader(i)) for i in range(5)] == datas
    finally:
        p.close()


def test_memory_stays_bounded_while_the_consumer_is_slow():
    log: list[int] = []
    p = Prefetcher([opener(b"x" * 10_000, log=log)], block_size=100, max_bytes=1_000)
    try:
        threading.Event().wait(0.2)  # the fetcher runs ahead as far as it may
        assert sum(log) <= 1_000 + 100  # at most the bound plus the block in hand
        assert drain(p.reader(0)) == b"x" * 10_000
    finally:
        p.close()


def test_abandoned_range_is_skipped_and_errors_arrive_with_their_range():
    p = Prefetcher([opener(b"a" * 500), opener(b"b" * 300, fail_after=100), opener(b"c" * 50)], block_size=50, max_bytes=10_000)
    try:
        assert p.reader(0)(50) == b"a" * 50  # read a little of range 0, then move on
        read1 = p.reader(1)
        assert read1(50) + read1(50) == b"b" * 100
        with pytest.raises(OSError, match="connection reset"):
            drain(read1)
        assert drain(p.reader(2)) == b"c" * 50
    finally:
        p.close()


def test_several_threads_fetch_ranges_at_once_and_hand_them_over_in_order():
    # The first four opens meet at a barrier: it lets them through only if all four are in flight
    # at once (one round trip for the four, not one after another); opened one by one, the first
    # waits in vain and the barrier breaks, failing its range.
    together = threading.Barrier(4, timeout=30)
    opened = []

    def gated_opener(index: int, data: bytes):
        def open_():
            opened.append(index)
            if index < 4:
                together.wait()
            return io.BytesIO(data).read, lambda: None

        return open_

    datas = [bytes([i]) * (10 + i) for i in range(8)]
    p = Prefetcher([gated_opener(i, d) for i, d in enumerate(datas)], block_size=4, max_bytes=1 << 20, threads=4)
    try:
        assert [drain(p.reader(i)) for i in range(8)] == datas
    finally:
        p.close()
    assert not together.broken and sorted(opened) == list(range(8))


def test_with_threads_memory_stays_bounded_and_the_front_range_never_stalls():
    log: list[int] = []
    big = [b"x" * 5_000, b"y" * 5_000, b"z" * 5_000]
    p = Prefetcher([opener(d, log=log) for d in big], block_size=100, max_bytes=1_000, threads=3)
    try:
        threading.Event().wait(0.2)  # every thread runs ahead as far as it may
        assert sum(log) <= 1_000 + 3 * 100
        assert [drain(p.reader(i)) for i in range(3)] == big
    finally:
        p.close()


def test_with_threads_an_abandoned_range_stops_and_errors_stay_with_their_range():
    p = Prefetcher([opener(b"a" * 500), opener(b"b" * 300, fail_after=100), opener(b"c" * 50)], block_size=50, max_bytes=10_000, threads=3)
    try:
        assert p.reader(0)(50) == b"a" * 50
        with pytest.raises(OSError, match="reset"):
            drain(p.reader(1))
        assert drain(p.reader(2)) == b"c" * 50
    finally:
        p.close()


# -- one budget for a worker's sources, read-ahead across windows (issue 35 items 5-6) -----------


def test_prefetchers_sharing_a_budget_hold_at_most_it_and_never_stall_each_other():
    from shardstream.storage.readahead import Budget

    budget = Budget(1_000)
    datas = [[bytes([s * 16 + r]) * (700 + 50 * r) for r in range(3)] for s in range(10)]
    ps = [Prefetcher([opener(d) for d in ranges], block_size=100, max_bytes=None, budget=budget) for ranges in datas]
    try:
        readers = [[p.reader(r) for r in range(3)] for p in ps]
        got: list[list[bytes]] = [[b"", b"", b""] for _ in ps]
        for r in range(3):  # the sources' ranges taken in turn, a block at a time, like a mix
            while True:
                blocks = [readers[s][r](100) for s in range(len(ps))]
                if not any(blocks):
                    break
                for s, block in enumerate(blocks):
                    got[s][r] += bytes(block)
        assert got == datas
        assert budget.peak <= 1_000 + 100  # all ten together: the budget plus the block waited on
        assert budget.fetched == sum(len(d) for ranges in datas for d in ranges) and budget.held == 0
    finally:
        for p in ps:
            p.close()


def test_close_gives_the_held_blocks_back_to_the_budget_and_stops_its_threads():
    from conftest import scaled

    from shardstream.storage.readahead import Budget

    budget = Budget(10_000)
    p = Prefetcher([opener(b"z" * 5_000), opener(b"y" * 5_000)], block_size=500, max_bytes=None, budget=budget, threads=2)
    assert p.reader(0)(500) == b"z" * 500
    p.close()
    deadline = threading.Event()
    for _ in range(int(scaled(10) / 0.05)):
        if not p.threads_alive():
            break
        deadline.wait(0.05)  # the fetch threads end once their read returns: nothing to wait on but them
    assert p.threads_alive() == 0
    assert budget.held == 0 and budget.wasted == budget.fetched - 500


def _mix(tmp_path, n_sources=10, per_source=40, size=8 << 10):
    from conftest import make_samples

    from shardstream import ShardWriter, Source

    sources = []
    for s in range(n_sources):
        root = tmp_path / f"src{s}"
        with ShardWriter(str(root), max_count=10) as w:
            for sample in make_samples(per_source, size=size, seed=s):
                sample["__key__"] = f"{s}-{sample['__key__']}"
                w.write(sample)
        sources.append(Source(str(root), weight=1.0, name=f"s{s}"))
    return sources


def _stream(sources, readahead, read_size=16 << 10, steps=None):
    from shardstream import Read, Schedule, ShardStream, Store
    from shardstream.plan.topology import World

    return ShardStream(
        sources,
        batch_size=10,
        shuffle=False,
        world=World(0, 1),
        seed=1,
        decode=False,
        store=Store(read=Read(read_size=read_size, readahead_bytes=readahead)),
        schedule=Schedule(steps=steps),
    )


def test_a_mix_of_ten_sources_holds_one_budget_and_yields_every_sample_once_in_order(tmp_path):
    sources = _mix(tmp_path)
    budget, block = 64 << 10, 16 << 10
    plain = [key for batch in _stream(sources, 0) for key in batch["__key__"]]
    ds = _stream(sources, budget, read_size=block)
    batches = list(ds)
    ahead = [key for batch in batches for key in batch["__key__"]]
    assert ahead == plain and len(set(ahead)) == len(ahead) == 400  # every sample once, in the planned order
    stats = ds.stats()
    # Ten sources of ~160 KiB each streamed through one 64 KiB budget: it held at most the budget
    # plus the block the parser waited on (per source it would have been ten budgets).
    payload = sum(len(data) for batch in batches for data in batch["bin"])
    assert stats["readahead_fetched"] >= payload > 2 * budget
    assert 0 < stats["readahead_peak"] <= budget + block


def test_read_ahead_opens_the_next_windows_first_range_before_the_current_window_ends(tmp_path, monkeypatch):
    from conftest import scaled, write_dataset

    import shardstream.pipeline.read as read_module
    from shardstream import Read, Schedule, ShardStream, Store
    from shardstream.plan.topology import World

    url = write_dataset(tmp_path / "d", 120, max_count=20, size=2000)  # 6 shards, 12 batches a data epoch
    opened: list[tuple[str, int]] = []
    real_open = read_module.open_range

    def logged(url, start, end, *args, **kwargs):
        opened.append((url, start))
        return real_open(url, start, end, *args, **kwargs)

    monkeypatch.setattr(read_module, "open_range", logged)
    ds = ShardStream(
        url,
        batch_size=10,
        shuffle=False,
        world=World(0, 1),
        decode=False,
        store=Store(read=Read(readahead_bytes=64 << 20)),
        schedule=Schedule(steps=24),  # two data epochs: a pass of two windows
    )
    it = iter(ds)
    try:
        first = next(it)  # the first batch of window 0; the consumer stops here
        wait = threading.Event()
        for _ in range(int(scaled(20) / 0.05)):
            if len(opened) > 6:
                break
            wait.wait(0.05)  # the fetch thread's progress has no event to wait on
        # window 0's six shards, then window 1's first range (shard 0 again), opened while the
        # consumer still holds window 0's first batch
        assert len(opened) > 6 and opened[6] == opened[0]
        rest = [key for batch in it for key in batch["__key__"]]
        keys = list(first["__key__"]) + rest
        assert keys == [f"s{i:06d}" for i in range(120)] * 2
    finally:
        it.close()


def test_a_pass_abandoned_mid_window_leaves_no_fetch_thread(tmp_path):
    from conftest import scaled

    sources = _mix(tmp_path, n_sources=3, per_source=60)
    ds = _stream(sources, 32 << 10, read_size=8 << 10, steps=30)  # two windows, stopped in the first
    it = iter(ds)
    for _ in range(2):
        next(it)
    it.close()
    wait = threading.Event()
    for _ in range(int(scaled(10) / 0.05)):
        if not any(t.name == "shardstream-readahead" for t in threading.enumerate()):
            break
        wait.wait(0.05)  # the threads end once a read in progress returns: nothing to wait on but them
    assert not [t for t in threading.enumerate() if t.name == "shardstream-readahead"]
    again = [key for batch in _stream(sources, 32 << 10, read_size=8 << 10, steps=30) for key in batch["__key__"]]
    assert len(again) == 300


def test_on_s3_two_workers_each_hold_one_budget_for_ten_sources(s3):
    """The remote path (one GET per range, requests sent ahead) through moto and real DataLoader
    workers: each worker's ten sources share its one budget."""
    from conftest import make_samples

    from shardstream import Read, ShardStream, ShardWriter, Source, Store, make_loader
    from shardstream.plan.topology import World

    bucket, options, _ = s3
    sources = []
    for s in range(10):
        with ShardWriter(f"s3://{bucket}/src{s}", max_count=10, storage_options=options) as w:
            for sample in make_samples(30, size=6 << 10, seed=s):
                sample["__key__"] = f"{s}-{sample['__key__']}"
                w.write(sample)
        sources.append(Source(f"s3://{bucket}/src{s}", weight=1.0, name=f"s{s}"))
    budget, block = 32 << 10, 8 << 10

    def make(readahead):
        read = Read(read_size=block, readahead_bytes=readahead)
        return ShardStream(sources, batch_size=10, shuffle=False, world=World(0, 1), seed=2, decode=False, store=Store(options=options, read=read))

    ds = make(budget)
    batches = list(make_loader(ds, num_workers=2, pin_memory=False))
    got = sorted(key for batch in batches for key in batch["__key__"])
    plain = make(0)
    assert got == sorted(key for batch in plain for key in batch["__key__"]) and len(got) == len(set(got)) == 300
    stats = ds.stats()
    payload = sum(len(data) for batch in batches for data in batch["bin"])
    assert stats["readahead_fetched"] >= payload > 4 * budget  # every sample came through the read-ahead
    assert 0 < stats["readahead_peak"] <= 2 * (budget + block)  # two workers, each its budget plus one block
