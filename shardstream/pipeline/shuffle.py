"""Buffered sample shuffle with a seeded RNG: memory bounded by the buffer (plus one read block).

The RNG is seeded from (seed, epoch, rank, worker), so an epoch's order is reproducible. The
shuffle's decisions depend only on how many items went in, never on their contents, so running
the same ``BufferShuffler`` over stream positions (plain ints, no I/O) tells exactly which items
were output after k outputs and which sit in the buffer: that is how a resumed epoch rebuilds
the buffer without re-reading what was already consumed (``plan/resume.py``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


def worker_rng(seed: int, epoch: int, rank: int, worker: int, segment: int = 0) -> random.Random:
    # String seeds hash through SHA-512: stable across runs and Python versions. Segment 0 is the
    # epoch as planned; later segments are the rest of an epoch laid out again after an elastic resume.
    suffix = f":segment{segment}" if segment else ""
    return random.Random(f"shardstream:{seed}:{epoch}:{rank}:{worker}{suffix}")


class BufferShuffler(Generic[T]):
    """The shuffle as a state machine: ``push`` items, collect outputs, ``drain`` at the end.

    Fills the buffer to ``initial`` items before the first output, then lets it grow to
    ``buffer_size``; each output takes a random buffered item. ``buffer``/``grow`` restore a
    state captured by an earlier run (with ``rng`` in the matching state).
    """

    def __init__(self, buffer_size: int, initial: int, rng: random.Random, *,
                 buffer: list[T] | None = None, grow: bool = False):
        self.buffer_size = buffer_size
        self.initial = max(1, min(initial, buffer_size))
        self.rng = rng
        self.buffer: list[T] = buffer if buffer is not None else []
        self.grow = grow

    def push(self, items: Sequence[T], out: list[T], limit: int = -1) -> int:
        """Feed ``items`` in order, appending outputs to ``out``; stop once ``len(out) == limit``.
        Returns how many items were taken."""
        buf = self.buffer
        rand = self.rng.random
        initial, size, grow = self.initial, self.buffer_size, self.grow
        taken = 0
        for item in items:
            taken += 1
            buf.append(item)
            n = len(buf)
            if n < initial:
                continue
            if n < size:
                # Past the initial fill, output on every other item so the buffer grows to full size.
                grow = not grow
                if grow:
                    continue
            i = int(rand() * n)
            buf[i], buf[-1] = buf[-1], buf[i]
            out.append(buf.pop())
            if len(out) == limit:
                break
        self.grow = grow
        return taken

    def drain(self) -> list[T]:
        """The end of the input: what is left, in a random order."""
        buf, self.buffer = self.buffer, []
        self.rng.shuffle(buf)
        return buf


def shuffle_samples(chunks: Iterable[list[T]], *, buffer_size: int, initial: int, rng: random.Random,
                    buffer: list[T] | None = None, grow: bool = False) -> Iterator[list[T]]:
    """Yield every item of the incoming lists (and of ``buffer``) exactly once, shuffled, as lists."""
    if buffer_size <= 1:
        yield from chunks
        return
    shuffler = BufferShuffler(buffer_size, initial, rng, buffer=buffer, grow=grow)
    for chunk in chunks:
        out: list[T] = []
        shuffler.push(chunk, out)
        if out:
            yield out
    rest = shuffler.drain()
    if rest:
        yield rest
