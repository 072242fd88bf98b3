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

CHUNK = 256  # samples per list handed on (the stages after this one loop over lists)


def merge_sources(streams: Sequence[Iterable[list[dict[str, Any]]]], pattern: Iterable[int],
                  names: Sequence[str]) -> Iterator[list[dict[str, Any]]]:
    """Position by position, take the next sample of the source the pattern names.

    A source that comes up short (samples skipped under the error policy) leaves its positions
    empty; the batch stage refills at the end, so every worker still yields its planned batches.
    Afterwards every stream is run to its end, so the checks after a range's last sample run.
    """
    flat = [itertools.chain.from_iterable(s) for s in streams]
    out: list[dict[str, Any]] = []
    short = 0
    for i in pattern:
        sample = next(flat[i], None)
        if sample is None:
            short += 1
            continue
        sample["__source__"] = names[i]
        out.append(sample)
        if len(out) >= CHUNK:
            yield out
            out = []
    if out:
        yield out
    left = sum(1 for stream in flat for _ in stream)
    if short or left:
        logger.debug("mix: %d positions found their source short, %d samples left over", short, left)
