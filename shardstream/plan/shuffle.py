"""The buffered shuffle as arithmetic: its RNG streams, its decisions, and where it stood after k outputs.

The shuffle's decisions depend only on how many items went in, never on their contents, so
running the same ``BufferShuffler`` over stream positions (plain ints, no I/O) tells exactly
which items came out after k outputs, which sit in the buffer (in buffer order), where the read
stopped, and leaves the RNG as the real worker had it (``cut_stream``): how a resumed pass
rebuilds a worker's buffer without reading again what was consumed. ``pipeline/shuffle.py``
runs the same state machine over samples.

Every shuffle RNG comes from ``stream_rng``, one string per stream, hashed through SHA-512
(stable across runs and Python versions).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def stream_rng(seed: int, epoch: int, rank: int, worker: int, *, source: int | None = None, segment: int = 0, at: int = 0) -> random.Random:
    """The RNG of one shuffled stream: worker ``worker`` of rank ``rank`` in data epoch ``epoch``;
    ``source``: which source of a mix (None for a single dataset); ``segment``: 0 for the epoch as
    planned, k for its rest laid out again by the k-th elastic resume; ``at``: the batch of the
    epoch where the window starts (a pass that starts mid-epoch, in a run by steps)."""
    tag = (f":source{source}" if source is not None else "") + (f":segment{segment}" if segment else "") + (f":at{at}" if at else "")
    return random.Random(f"shardstream:{seed}:{epoch}:{rank}:{worker}{tag}")


class BufferShuffler(Generic[T]):
    """The shuffle as a state machine: ``push`` items, collect outputs, ``drain`` at the end.

    Fills the buffer to ``initial`` items before the first output, then lets it grow to
    ``buffer_size``; each output takes a random buffered item. ``buffer``/``grow`` restore a
    state captured by an earlier run (with ``rng`` in the matching state).
    """

    def __init__(self, buffer_size: int, initial: int, rng: random.Random, *, buffer: list[T] | None = None, grow: bool = False):
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
        stream = iter(items)
        for item in stream:
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
            if limit < 0 and n == size:
                # Full: from here on every item goes in and one comes out. The same draws and the
                # same buffer as append, swap and pop (slot i takes the item; i == n - 1 is the item
                # itself), at half the work per item.
                last, append = n - 1, out.append
                for item in stream:
                    taken += 1
                    i = int(rand() * n)
                    if i == last:
                        append(item)
                    else:
                        append(buf[i])
                        buf[i] = item
                break
        self.grow = grow
        return taken

    def drain(self) -> list[T]:
        """The end of the input: what is left, in a random order."""
        buf, self.buffer = self.buffer, []
        self.rng.shuffle(buf)
        return buf


@dataclass
class StreamCut:
    """Where one shuffled stream stood after its consumed outputs (all zero for a fresh stream)."""

    taken: int  # stream positions [0, taken) went into the shuffle
    buffered: list[int]  # positions sitting in the buffer, in buffer order
    grow: bool
    rng: random.Random | None  # None: no randomness left (drained) or none needed (no buffer)
    drained: bool  # the input had ended: ``buffered`` is the final output order

    @classmethod
    def fresh(cls, rng: random.Random) -> StreamCut:
        return cls(0, [], False, rng, False)


def cut_stream(length: int, outputs: int, *, buffer_size: int, initial: int, rng: random.Random) -> StreamCut:
    """Simulate the shuffle over ``length`` stream positions until ``outputs`` have come out."""
    if buffer_size <= 1:
        return StreamCut(outputs, [], False, None, False)
    if outputs == 0:
        return StreamCut.fresh(rng)
    shuffler: BufferShuffler[int] = BufferShuffler(buffer_size, initial, rng)
    out: list[int] = []
    taken = shuffler.push(range(length), out, outputs)
    if len(out) == outputs:
        return StreamCut(taken, shuffler.buffer, shuffler.grow, rng, False)
    rest = shuffler.drain()
    return StreamCut(length, rest[outputs - len(out) :], False, None, True)
