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
        self._bits: np.random.MT19937 | None = None  # push_array's numpy copy of the RNG (large draws)

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
        buffer is full the items go through ``push``; from there on every item's draw comes at once
        from the Python RNG's own stream (``draw_uniform``) and the swaps are resolved at once
        (``_full_step``): at 131,072 rows a call ~30 ns of CPU a row against the loop's ~200."""
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
        if self._bits is None and len(rest) >= DRAW_NUMPY:
            self._bits = np.random.MT19937(0)  # (its state is always set from the Python RNG's before use)
        draws = draw_uniform(self.rng, len(rest), bits=self._bits)
        draws *= size
        slots = draws.astype(_slot_dtype(size - 1))  # int(rand() * n), as push draws
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


DRAW_NUMPY = 4096  # draws of at least this many go through numpy's MT19937 (below: getrandbits)
STEP_BLOCK = 32768  # _full_step resolves this many items at a time (its temporaries stay in cache)


def draw_uniform(rng: random.Random, count: int, *, bits: np.random.MT19937 | None = None) -> np.ndarray:
    """The next ``count`` values of ``rng.random()`` as one array, and ``rng`` advanced past them.

    ``random()`` makes a double from two 32-bit outputs of the generator (a >> 5, b >> 6). Fewer
    than ``DRAW_NUMPY`` come from ``rng.getrandbits(64 * count)`` (the same outputs in order, as
    one int's 32-bit words from the least significant up) and that arithmetic in numpy: no fixed
    cost. More come from numpy's MT19937 (``bits``, or a new one) set to the Python generator's
    state, its ``Generator.random()`` (the same arithmetic), and its state handed back: ~60 us
    fixed, then ~4 ns a value where getrandbits takes ~20."""
    if count < DRAW_NUMPY:
        if count <= 0:
            return np.empty(0, dtype=np.float64)
        words = np.frombuffer(rng.getrandbits(64 * count).to_bytes(8 * count, "little"), dtype="<u4")
        values = (words[0::2] >> 5) * 67108864.0
        values += words[1::2] >> 6
        values *= 1.0 / 9007199254740992.0
        return values
    version, internal, gauss = rng.getstate()
    if bits is None:
        bits = np.random.MT19937(0)
    bits.state = {"bit_generator": "MT19937", "state": {"key": internal[:624], "pos": internal[624]}}
    values = np.random.Generator(bits).random(count)
    state = bits.state["state"]
    rng.setstate((version, (*state["key"].tolist(), int(state["pos"])), gauss))
    return values


def _slot_dtype(last: int) -> type[np.unsignedinteger[Any]]:
    """The smallest unsigned type holding slots 0..last (numpy's stable sort of 16-bit keys is a radix sort)."""
    return np.uint16 if last <= 0xFFFF else np.uint32 if last <= 0xFFFFFFFF else np.uint64


def _stable_order(slots: np.ndarray) -> np.ndarray:
    """``np.argsort(slots, kind="stable")``, as radix sorts of 16-bit keys (numpy sorts wider keys
    stably by merging, ~7x slower): 32-bit slots low half first, then high half."""
    if slots.dtype == np.uint16:
        return np.argsort(slots, kind="stable")
    if slots.dtype == np.uint32:
        low = np.argsort((slots & 0xFFFF).astype(np.uint16), kind="stable")
        return low[np.argsort((slots[low] >> 16).astype(np.uint16), kind="stable")]
    return np.argsort(slots, kind="stable")


def _full_step(buf: np.ndarray, items: np.ndarray, slots: np.ndarray, last: int) -> np.ndarray:
    """The full buffer's loop over ``items`` at once: item j draws slot ``slots[j]``; slot ``last``
    hands the item itself out, any other hands out what the slot holds (what it held before, or
    the latest item drawn into it) and keeps item j. ``buf`` ends as the loop leaves it. Resolved
    ``STEP_BLOCK`` items at a time, in order (each block sees ``buf`` as the ones before left it)."""
    out = np.empty(len(items), dtype=items.dtype)
    for a in range(0, len(items), STEP_BLOCK):
        _full_block(buf, items[a : a + STEP_BLOCK], slots[a : a + STEP_BLOCK], last, out[a : a + STEP_BLOCK])
    return out


def _full_block(buf: np.ndarray, items: np.ndarray, slots: np.ndarray, last: int, out: np.ndarray) -> None:
    """``_full_step`` for one block, into ``out``: the draws sorted by slot (stably: in item order
    within a slot), a draw's output is the item drawn into its slot just before it, or for a
    slot's first draw what the slot held; each slot keeps its last draw's item."""
    order = _stable_order(slots.astype(_slot_dtype(last), copy=False))
    s = slots[order]
    got = np.take(items, order)  # the items in slot order
    cut = int(np.searchsorted(s, s.dtype.type(last)))  # slot ``last`` (the item itself out) sorts last
    if cut:
        out[order[1:cut]] = got[: cut - 1]  # a later draw of a slot: the item drawn into it before
        runs = np.flatnonzero(s[1:cut] != s[: cut - 1])  # run k + 1 (a slot's draws) starts at runs[k] + 1
        runs += 1
        firsts = s[runs]
        out[order[runs]] = buf[firsts]  # a slot's first draw: what it held (over the line above)
        out[order[0]] = buf[s[0]]
        buf[s[runs - 1]] = got[runs - 1]  # each slot keeps its last draw's item (run ends: before each start, and the end)
        buf[s[cut - 1]] = got[cut - 1]
    if cut < len(s):
        out[order[cut:]] = got[cut:]


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
