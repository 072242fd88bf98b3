"""Buffered sample shuffle with a seeded RNG: memory bounded by the buffer size.

The RNG is seeded from (seed, epoch, rank, worker), so an epoch's order is reproducible.
"""

from __future__ import annotations

import random
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def worker_rng(seed: int, epoch: int, rank: int, worker: int) -> random.Random:
    # String seeds hash through SHA-512: stable across runs and Python versions.
    return random.Random(f"shardstream:{seed}:{epoch}:{rank}:{worker}")


def shuffle_samples(samples: Iterable[T], *, buffer_size: int, initial: int, rng: random.Random) -> Iterator[T]:
    """Yield every item of ``samples`` exactly once, in a shuffled order.

    Fills the buffer to ``initial`` items before the first yield, then lets it grow to
    ``buffer_size``; each yield takes a random buffered item.
    """
    if buffer_size <= 1:
        yield from samples
        return
    initial = max(1, min(initial, buffer_size))
    buf: list[T] = []
    randrange = rng.randrange
    grow = False
    for item in samples:
        buf.append(item)
        if len(buf) < initial:
            continue
        if len(buf) < buffer_size:
            # Past the initial fill, yield on every other item so the buffer grows to full size.
            grow = not grow
            if grow:
                continue
        i = randrange(len(buf))
        buf[i], buf[-1] = buf[-1], buf[i]
        yield buf.pop()
    rng.shuffle(buf)
    yield from buf
