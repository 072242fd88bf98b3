"""Group samples into batches of exactly ``batch_size``; default collate into a dict of batched fields.

A worker must yield exactly its planned number of batches (ranks stay in step). If samples were
skipped under the error policy, the last batches are filled by repeating recent good samples;
the number repeated is counted and logged.
"""

from __future__ import annotations

import logging
import numbers
from collections import deque
from typing import Any, Callable, Iterable, Iterator

logger = logging.getLogger(__name__)


def default_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Tensors and numbers are stacked into tensors, numpy arrays too; everything else stays a list.

    ``__key__`` and ``__url__`` come out as lists, so a loop can always tell what it got.
    """
    import torch

    first = samples[0]
    out: dict[str, Any] = {}
    for name in first:
        values = [s[name] for s in samples]
        v = values[0]
        if isinstance(v, torch.Tensor):
            out[name] = torch.stack(values) if all(x.shape == v.shape for x in values) else values
        elif isinstance(v, (bool, numbers.Integral)) and not isinstance(v, bool):
            out[name] = torch.tensor(values, dtype=torch.int64)
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            out[name] = torch.tensor(values, dtype=torch.float64 if isinstance(v, float) else None)
        elif type(v).__module__ == "numpy" and hasattr(v, "shape"):
            import numpy as np

            out[name] = torch.from_numpy(np.stack(values)) if all(x.shape == v.shape for x in values) else values
        else:
            out[name] = values
    return out


class BatchStats:
    def __init__(self) -> None:
        self.refilled = 0


def batch_samples(
    samples: Iterable[dict[str, Any]],
    *,
    batch_size: int,
    num_batches: int,
    collate: Callable[[list[dict[str, Any]]], Any] = default_collate,
    stats: BatchStats | None = None,
) -> Iterator[Any]:
    """Yield exactly ``num_batches`` collated batches of ``batch_size`` samples."""
    recent: deque[dict[str, Any]] = deque(maxlen=batch_size)
    batch: list[dict[str, Any]] = []
    made = 0
    for sample in samples:
        batch.append(sample)
        recent.append(sample)
        if len(batch) == batch_size:
            yield collate(batch)
            made += 1
            batch = []
            if made == num_batches:
                return
    if made < num_batches:
        if not recent:
            raise RuntimeError("no sample could be read for this worker; cannot fill its batches")
        missing = (num_batches - made) * batch_size - len(batch)
        if stats is not None:
            stats.refilled += missing
        logger.warning("repeating %d samples to keep %d equal batches (samples were skipped)", missing, num_batches)
        pool = list(recent)
        i = 0
        while made < num_batches:
            batch.append(pool[i % len(pool)])
            i += 1
            if len(batch) == batch_size:
                yield collate(batch)
                made += 1
                batch = []
