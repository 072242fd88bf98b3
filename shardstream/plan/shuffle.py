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
from typing import Any, Generic, TypeVar

import numpy as np

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

    def push_array(self, items: np.ndarray) -> np.ndarray:
        """``push`` for row refs (an int64 array in, the outputs as one out): the same outputs, the
        same buffer and the same RNG state after, as ``push`` over ``items.tolist()``. Until the
        buffer is full the items go through ``push``; from there on every item's draw comes from
        one numpy MT19937 run on the Python RNG's state (``random.random()`` and numpy's
        ``Generator.random()`` make a double from the same two 32-bit outputs), and the
        swaps are resolved at once (``_full_step``): ~10x less CPU per row than the loop."""
        out: list[Any] = []
        size, pos, n = self.buffer_size, 0, len(items)
        while pos < n and len(self.buffer) < size - 1:
            step = size - 1 - len(self.buffer)  # no item of these can find the buffer full
            self.push(items[pos : pos + step].tolist(), out)
            pos = min(n, pos + step)
        if pos == n:
            return np.asarray(out, dtype=np.int64)
        rest = items[pos:]
        buf = self.buffer if isinstance(self.buffer, np.ndarray) else np.asarray(self.buffer, dtype=np.int64)
        slots = (draw_uniform(self.rng, len(rest)) * size).astype(np.int64)  # int(rand() * n), as push draws
        full = _full_step(buf, rest, slots, size - 1)
        self.buffer = buf  # type: ignore[assignment]  # a full buffer of refs stays an array
        return np.concatenate([np.asarray(out, dtype=np.int64), full]) if out else full

    def drain(self) -> list[T]:
        """The end of the input: what is left, in a random order."""
        buf, self.buffer = self.buffer, []
        if isinstance(buf, np.ndarray):
            buf = buf.tolist()
        self.rng.shuffle(buf)
        return buf


def draw_uniform(rng: random.Random, count: int) -> np.ndarray:
    """The next ``count`` values of ``rng.random()`` as one array, and ``rng`` advanced past them
    (numpy's MT19937 started from the Python generator's state, and its state handed back)."""
    version, internal, gauss = rng.getstate()
    bits = np.random.MT19937()
    bits.state = {"bit_generator": "MT19937", "state": {"key": np.array(internal[:624], dtype=np.uint32), "pos": internal[624]}}
    values = np.random.Generator(bits).random(count)
    state = bits.state["state"]
    rng.setstate((version, (*state["key"].tolist(), int(state["pos"])), gauss))
    return values


def _full_step(buf: np.ndarray, items: np.ndarray, slots: np.ndarray, last: int) -> np.ndarray:
    """The full buffer's loop over ``items`` at once: item j draws slot ``slots[j]``; slot ``last``
    hands the item itself out, any other hands out what the slot holds (what it held before, or
    the latest item drawn into it) and keeps item j. ``buf`` ends as the loop leaves it."""
    out = items.copy()
    moved = np.flatnonzero(slots != last)
    if len(moved):
        keys = slots[moved]
        if last <= np.iinfo(np.uint16).max:
            keys = keys.astype(np.uint16)  # numpy's stable sort of 16-bit keys is a radix sort
        by_slot = moved[np.argsort(keys, kind="stable")]  # grouped by slot, in item order within
        s = slots[by_slot]
        first = np.ones(len(s), dtype=bool)
        first[1:] = s[1:] != s[:-1]
        got = np.empty(len(s), dtype=np.int64)
        got[first] = buf[s[first]]  # a slot's first draw: what it held
        later = np.flatnonzero(~first)
        got[later] = items[by_slot[later - 1]]  # later ones: the item drawn into it before
        out[by_slot] = got
        final = np.ones(len(s), dtype=bool)
        final[:-1] = first[1:]
        buf[s[final]] = items[by_slot[final]]
    return out


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
