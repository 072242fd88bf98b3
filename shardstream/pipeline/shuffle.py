"""Buffered sample shuffle with a seeded RNG: memory bounded by the buffer (plus one read block).

The RNG is seeded from (seed, epoch, rank, worker), so an epoch's order is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def worker_rng(seed: int, epoch: int, rank: int, worker: int) -> random.Random:
    # String seeds hash through SHA-512: stable across runs and Python versions.
    return random.Random(f"shardstream:{seed}:{epoch}:{rank}:{worker}")


def shuffle_samples(chunks: Iterable[list[T]], *, buffer_size: int, initial: int, rng: random.Random) -> Iterator[list[T]]:
    """Yield every item of the incoming lists exactly once, in a shuffled order, as lists.

    Fills the buffer to ``initial`` items before the first output, then lets it grow to
    ``buffer_size``; each output takes a random buffered item.
    """
    if buffer_size <= 1:
        yield from chunks
        return
    initial = max(1, min(initial, buffer_size))
    buf: list[T] = []
    random = rng.random
    grow = False
    for chunk in chunks:
        out: list[T] = []
        for item in chunk:
            buf.append(item)
            n = len(buf)
            if n < initial:
                continue
            if n < buffer_size:
                # Past the initial fill, output on every other item so the buffer grows to full size.
                grow = not grow
                if grow:
                    continue
            i = int(random() * n)
            buf[i], buf[-1] = buf[-1], buf[i]
            out.append(buf.pop())
        if out:
            yield out
    rng.shuffle(buf)
    if buf:
        yield buf
