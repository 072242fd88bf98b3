"""pipeline/shuffle.py (plan/shuffle.py's state machine run over samples): every item exactly once, memory
bounded by the buffer, deterministic by seed."""

from __future__ import annotations

import random

import numpy as np
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


def _full_step_by_loop(buf, items, slots, last):
    """``_full_step``'s rule one item at a time: slot ``last`` hands the item itself out, any other
    hands out what it holds and keeps the item."""
    buf, out = list(buf), []
    for item, slot in zip(items, slots):
        if slot == last:
            out.append(item)
        else:
            out.append(buf[slot])
            buf[slot] = item
    return buf, out


@pytest.mark.parametrize("size", [1, 2, 3, 17, 1000, 65535, 65536, 65537, 70000])
def test_full_step_is_the_loop(size):
    """The sorted resolution of a full buffer's draws (``plan.shuffle._full_step``) against the
    plain loop, on random refs and draws: small buffers (collisions everywhere), buffers past the
    16-bit slots (the two-pass radix order), calls across its blocks, runs of slot ``last``."""
    from shardstream.plan import shuffle as plan_shuffle

    rng = np.random.default_rng(size)
    last = size - 1
    for n in (0, 1, 2, 7, 300, plan_shuffle.STEP_BLOCK + 5):
        buf = rng.integers(0, 1 << 62, size - 1)
        items = rng.integers(0, 1 << 62, n)
        slots = rng.integers(0, size, n)
        if n >= 7:
            slots[:3] = last  # slot ``last`` first, in a row, and at the end
            slots[-1] = last
            slots[4] = slots[5] = min(last, 1) if last else 0  # a slot drawn twice in a row
        for dtype in (np.int64, plan_shuffle._slot_dtype(last)):
            got_buf = buf.copy()
            out = plan_shuffle._full_step(got_buf, items, slots.astype(dtype), last)
            want_buf, want = _full_step_by_loop(buf.tolist(), items.tolist(), slots.tolist(), last)
            assert out.tolist() == want, (size, n, dtype)
            assert got_buf.tolist() == want_buf, (size, n, dtype)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4095, 4096, 5000])
def test_draw_uniform_both_ways_is_the_python_stream(count):
    """Small draws (getrandbits' words) and large ones (numpy's MT19937, a new one or one reused
    across calls) give ``random()``'s values and leave the generator where ``random()`` would."""
    from shardstream.plan.shuffle import draw_uniform

    bits = np.random.MT19937(5)
    for reuse in (None, bits, bits):
        a, b = random.Random(f"draw{count}"), random.Random(f"draw{count}")
        a.random(), b.random()
        want = [a.random() for _ in range(count)]
        assert draw_uniform(b, count, bits=reuse).tolist() == want
        assert b.getstate() == a.getstate()
        assert b.random() == a.random()


@pytest.mark.parametrize("size", [1, 2, 300, 65536, 65537])
def test_push_array_is_push_across_draw_and_block_sizes(size):
    """``push_array`` against ``push`` (the loop) with calls small and large: below and above
    ``DRAW_NUMPY`` (the two ways to draw), across ``STEP_BLOCK``, and buffers past 16-bit slots;
    the same outputs, buffer and RNG state after every call, and the same drain."""
    from shardstream.plan.shuffle import DRAW_NUMPY, STEP_BLOCK, BufferShuffler

    seed = f"push{size}"
    loop, arrays = BufferShuffler(size, max(1, size // 10), random.Random(seed)), BufferShuffler(size, max(1, size // 10), random.Random(seed))
    start = 0
    for n in (size + 3, 1, DRAW_NUMPY - 1, DRAW_NUMPY, 3, STEP_BLOCK + 7, 2 * STEP_BLOCK):
        chunk = np.arange(start, start + n, dtype=np.int64) + (3 << 32)
        start += n
        out: list[int] = []
        loop.push(chunk.tolist(), out)
        assert arrays.push_array(chunk).tolist() == out, (size, n)
        assert np.asarray(arrays.buffer).tolist() == list(loop.buffer)
        assert arrays.rng.getstate() == loop.rng.getstate()
    assert arrays.drain() == loop.drain()
