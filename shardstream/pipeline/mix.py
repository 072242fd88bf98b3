"""Interleave the sample streams of a mix's sources by the plan's pattern, tagging each sample.

Record shape in: one stream per source of lists of samples (already shuffled within the source,
so the shuffle never blurs a batch's composition). Out: lists of samples in the planned mixed
order, each with ``"__source__": name``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

logger = logging.getLogger(__name__)

CHUNK = 1024  # samples per list handed on (the stages after this one loop over lists)


def _tagged(chunks: Iterable[list[dict[str, Any]]], name: str) -> Iterator[list[dict[str, Any]]]:
    for chunk in chunks:
        for sample in chunk:
            sample["__source__"] = name
        yield chunk


def merge_sources(streams: Sequence[Iterable[list[dict[str, Any]]]], pattern: Iterable[int],
                  names: Sequence[str]) -> Iterator[list[dict[str, Any]]]:
    """Position by position, take the next sample of the source the pattern names.

    A source that comes up short (samples skipped under the error policy) leaves its positions
    empty; the batch stage refills at the end, so every worker still yields its planned batches.
    Afterwards every stream is run to its end, so the checks after a range's last sample run.
    """
    flat = [itertools.chain.from_iterable(_tagged(s, name)) for s, name in zip(streams, names)]
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
