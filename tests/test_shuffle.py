"""pipeline/shuffle.py (plan/shuffle.py's state machine run over samples): every item exactly once, memory
bounded by the buffer, deterministic by seed."""

from __future__ import annotations

import random

import pytest

from shardstream.pipeline.shuffle import shuffle_samples
from shardstream.plan.shuffle import stream_rng as worker_rng


def chunks_of(n: int, size: int):
    items = list(range(n))
    return [items[i : i + size] for i in range(0, n, size)]


@pytest.mark.parametrize("n,chunk,buffer,initial", [(0, 5, 10, 1), (1, 1, 10, 1), (1000, 7, 100, 10), (1000, 64, 1000, 100), (50, 3, 2, 1)])
def test_every_item_exactly_once(n, chunk, buffer, initial):
    out = [x for c in shuffle_samples(chunks_of(n, chunk), buffer_size=buffer, initial=initial, rng=random.Random(0)) for x in c]
    assert sorted(out) == list(range(n))


def test_order_changes_and_is_reproducible():
    def run(seed, epoch):
        rng = worker_rng(seed, epoch, 0, 0)
        return [x for c in shuffle_samples(chunks_of(500, 10), buffer_size=100, initial=10, rng=rng) for x in c]

    assert run(0, 0) == run(0, 0)
    assert run(0, 0) != list(range(500))
    assert run(0, 0) != run(0, 1) and run(0, 0) != run(1, 0)
    assert worker_rng(0, 0, 0, 1).random() != worker_rng(0, 0, 1, 0).random()  # every (rank, worker) differs


def test_memory_is_bounded_by_the_buffer():
    """Items still held = items fed - items yielded; never more than the buffer plus one input list."""
    buffer, chunk = 64, 16
    fed = 0

    def source():
        nonlocal fed
        for c in chunks_of(5000, chunk):
            fed += len(c)
            yield c

    out = 0
    peak = 0
    for c in shuffle_samples(source(), buffer_size=buffer, initial=8, rng=random.Random(1)):
        peak = max(peak, fed - out)
        out += len(c)
    assert out == 5000 and buffer <= peak <= buffer + chunk


def test_no_buffer_passes_through():
    chunks = chunks_of(30, 4)
    assert list(shuffle_samples(iter(chunks), buffer_size=1, initial=1, rng=random.Random(0))) == chunks


def _push_by_swap_and_pop(items, buffer_size, initial, rng):
    """The shuffle's rule spelled out one item at a time (append, swap with a random slot, pop),
    as the planner's simulation of a worker depends on it."""
    buf, out, grow = [], [], False
    initial = max(1, min(initial, buffer_size))
    for item in items:
        buf.append(item)
        n = len(buf)
        if n < initial:
            continue
        if n < buffer_size:
            grow = not grow
            if grow:
                continue
        i = int(rng.random() * n)
        buf[i], buf[-1] = buf[-1], buf[i]
        out.append(buf.pop())
    rng.shuffle(buf)
    return out + buf


@pytest.mark.parametrize("n,chunk,buffer,initial", [(500, 7, 32, 3), (1000, 100, 50, 50), (300, 1, 10, 1), (64, 64, 64, 6)])
def test_full_buffer_fast_path_is_the_same_shuffle(n, chunk, buffer, initial):
    from shardstream.plan.shuffle import cut_stream

    chunks = [list(range(a, min(n, a + chunk))) for a in range(0, n, chunk)]
    got = [x for c in shuffle_samples(chunks, buffer_size=buffer, initial=initial, rng=random.Random(9)) for x in c]
    assert got == _push_by_swap_and_pop(range(n), buffer, initial, random.Random(9))
    for outputs in (0, 1, n // 3, n - 1):  # the planner's cut (limit >= 0) agrees with the stream
        cut = cut_stream(n, outputs, buffer_size=buffer, initial=initial, rng=random.Random(9))
        assert sorted(got[outputs:]) == sorted(cut.buffered + list(range(cut.taken, n)))
