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
