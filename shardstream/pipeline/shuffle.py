"""Buffered sample shuffle with a seeded RNG: memory bounded by the buffer (plus one read block).

The RNG comes from ``plan.shuffle.stream_rng`` (seed, epoch, rank, worker, ...), so an order is
reproducible. The shuffle is ``plan.shuffle.BufferShuffler`` run over samples: the planner runs
the same state machine over positions to know, without I/O, which samples a resumed worker still
holds (``StreamCut``); ``continue_samples`` puts them back and goes on from there.

Record shape in and out: lists of samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import numpy as np

from shardstream.plan.shuffle import BufferShuffler, StreamCut

T = TypeVar("T")


def shuffle_samples(
    chunks: Iterable[list[T]], *, buffer_size: int, initial: int, rng: Any, buffer: list[T] | None = None, grow: bool = False
) -> Iterator[list[T]]:
    """Yield every item of the incoming lists (and of ``buffer``) exactly once, shuffled, as lists.
    Row refs come as int64 arrays (the columnar table path) and go out as arrays, shuffled by
    ``BufferShuffler.push_array``: the same order as the lists' loop, at a fraction of its cost."""
    if buffer_size <= 1:
        yield from chunks
        return
    shuffler = BufferShuffler(buffer_size, initial, rng, buffer=buffer, grow=grow)
    arrays = False
    for chunk in chunks:
        if isinstance(chunk, np.ndarray):
            arrays = True
            got = shuffler.push_array(chunk)
            if len(got):
                yield got
            continue
        out: list[T] = []
        shuffler.push(chunk, out)
        if out:
            yield out
    rest = shuffler.drain()
    if rest:
        yield np.asarray(rest, dtype=np.int64) if arrays else rest  # type: ignore[misc]


def continue_samples(
    back: Iterable[list[T]], rest: Iterable[list[T]], cut: StreamCut, placement: np.ndarray | None, *, buffer_size: int, initial: int
) -> Iterator[list[T]]:
    """A stream's shuffled samples from where ``cut`` stood: ``back`` holds the samples that sat in
    its buffer, read back in ``placement`` order (sorted by sample: ``placement[i]`` is the buffer
    slot of the i-th read), ``rest`` the samples it had not read yet. A fresh stream has nothing
    to read back and a fresh cut: this is then ``shuffle_samples``."""
    buffer: list[Any] = []
    if cut.buffered:
        got = [s for chunk in back for s in chunk]
        if placement is not None and len(got) == len(placement):  # fewer only when reads were skipped (on_error="skip")
            buffer = [None] * len(got)
            for sample, slot in zip(got, placement.tolist()):
                buffer[slot] = sample
        else:
            buffer = got
    if cut.drained:
        if buffer:
            yield buffer
        return
    if buffer_size <= 1 or cut.rng is None:
        yield from rest
        return
    yield from shuffle_samples(rest, buffer_size=buffer_size, initial=initial, rng=cut.rng, buffer=buffer, grow=cut.grow)
