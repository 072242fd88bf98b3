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
