"""Interleave the sample streams of a mix's sources by the plan's pattern, tagging each sample;
and ``read_planned``, a worker's whole planned read: window by window, every source read (its
buffered samples read back first in a resumed window), shuffled from where the plan says its
shuffle stood, then interleaved.

Record shape in: one stream per source of lists of samples (already shuffled within the source,
so the shuffle never blurs a batch's composition). Out: lists of samples in the planned mixed
order, each with ``"__source__": name`` (a single dataset has one stream, passed on as it is).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from shardstream.pipeline.shuffle import continue_samples
from shardstream.plan.epoch import Range
from shardstream.plan.run import WorkerPlan

logger = logging.getLogger(__name__)

CHUNK = 1024  # samples per list handed on (the stages after this one loop over lists)
REPEAT = 1 << 62  # on a row ref (pipeline/table.py): the plan's repeat of a row, __valid__ False


def _tagged(chunks: Iterable[list[dict[str, Any]]], name: str) -> Iterator[list[dict[str, Any]]]:
    for chunk in chunks:
        for sample in chunk:
            sample["__source__"] = name
        yield chunk


def merge_sources(
    streams: Sequence[Iterable[list[dict[str, Any]]]], pattern: Iterable[int] | None, names: Sequence[str] | None
) -> Iterator[list[dict[str, Any]]]:
    """Position by position, take the next sample of the source the pattern names (no pattern:
    one stream, passed on; no names: samples are not tagged).

    A source that comes up short (samples skipped under the error policy) leaves its positions
    empty; the batch stage refills at the end, so every worker still yields its planned batches.
    Afterwards every stream is run to its end, so the checks after a range's last sample run.
    """
    if pattern is None:
        (stream,) = streams
        yield from (_tagged(stream, names[0]) if names else stream)
        return
    tagged: list[Iterable[list[dict[str, Any]]]] = [_tagged(s, name) for s, name in zip(streams, names)] if names else list(streams)
    flat = [itertools.chain.from_iterable(s) for s in tagged]
    pattern = iter(pattern)
    short = 0
    while block := list(itertools.islice(pattern, CHUNK)):
        got = [next(flat[i], None) for i in block]  # one comprehension: no per-sample Python statements
        out = [x for x in got if x is not None] if None in got else got
        short += len(got) - len(out)
        if out:
            yield out  # type: ignore[misc]  # the Nones are gone
    left = sum(1 for stream in flat for _ in stream)
    if short or left:
        logger.debug("mix: %d positions found their source short, %d samples left over", short, left)


def _marked(chunks: Iterable[list[Any]], valid: int | np.ndarray | None) -> Iterable[list[Any]]:
    """Pad mode: each sample gets ``"__valid__"``, False for the layout's repeats (positions past
        the epoch's end), before the shuffle moves them. ``valid``: how many samples, from the first,
        are originals, or one bool per sample; None (drop mode): samples pass as they are. Row refs
    (int64 arrays: columnar table batches) are marked with the ``REPEAT`` bit instead. Marked by
        position: a sample skipped under ``on_error="skip"`` shifts the marks after it by one."""
    if valid is None:
        yield from chunks
        return
    flags = valid.tolist() if isinstance(valid, np.ndarray) else None
    k = 0
    for chunk in chunks:
        if isinstance(chunk, np.ndarray):  # row refs (pipeline/table.py): a repeat's ref carries the REPEAT bit
            at = np.arange(k, k + len(chunk))
            if isinstance(valid, np.ndarray):
                original = np.zeros(len(chunk), dtype=bool)
                inside = at < len(valid)
                original[inside] = valid[at[inside]]
            else:
                original = at < valid
            k += len(chunk)
            yield np.where(original, chunk, chunk | REPEAT)
            continue
        for sample in chunk:
            if isinstance(sample, dict):  # (samples as read are dicts; a planner's simulation reads other records)
                sample["__valid__"] = (k < len(flags) and flags[k]) if flags is not None else k < valid
            k += 1
        yield chunk


def read_planned(
    part: WorkerPlan,
    read: Callable[[int, list[Range]], Iterable[list[Any]]],
    read_back: Callable[[int, list[Range]], Iterable[list[Any]]] | None = None,
) -> Iterator[list[Any]]:
    """The samples of a worker's planned pass (``plan.run.WorkerPlan``), window after window.
    ``read(source, ranges)`` yields lists of samples in range order; ``read_back`` (default
    ``read``) does so for the buffered samples a resumed window reads back (scattered single
    samples: a pool of requests, see ``pipeline.read.read_scattered``)."""
    back = read_back or read
    for window in part.windows:
        streams = [
            continue_samples(
                _marked(back(i, s.back), s.back_valid) if s.back else iter(()),
                _marked(read(i, s.ranges), s.valid) if s.ranges else iter(()),
                s.cut,
                s.placement,
                buffer_size=part.shuffle_buffer,
                initial=part.shuffle_initial,
            )
            for i, s in enumerate(window.sources)
        ]
        yield from merge_sources(streams, window.pattern(), part.names)
