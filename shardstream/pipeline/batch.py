"""Group samples into batches of exactly ``batch_size``; default collate into a dict of batched fields.

A worker must yield exactly its planned number of batches (ranks stay in step). If samples were
skipped under the error policy, the last batches are filled by repeating recent good samples;
the number repeated is counted and logged.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from shardstream.errors import TooManyErrors

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
        elif isinstance(v, bool):
            out[name] = torch.tensor(values, dtype=torch.bool)
        elif isinstance(v, numbers.Integral):
            out[name] = torch.tensor(values, dtype=torch.int64)
        elif isinstance(v, numbers.Real):
            out[name] = torch.tensor(values, dtype=torch.float64)
        elif type(v).__module__ == "numpy" and hasattr(v, "shape"):
            import numpy as np

            out[name] = torch.from_numpy(np.stack(values)) if all(x.shape == v.shape for x in values) else values
        else:
            out[name] = values
    return out


def _finish(chunks: Iterator[list[dict[str, Any]]], left: int) -> None:
    """Run the upstream stages to their end after the last batch, so that the checks they make
    after their last sample (the manifest's count, the shard's sha256) are not skipped. The
    plan gives each worker exactly its batches' samples, so nothing is normally left."""
    for chunk in chunks:
        left += len(chunk)
    if left:
        logger.debug("%d samples beyond this worker's planned batches were not used", left)


class BatchStats:
    def __init__(self) -> None:
        self.refilled = 0


def batch_samples(
    chunks: Iterable[list[dict[str, Any]]],
    *,
    batch_size: int,
    num_batches: int,
    collate: Callable[[list[dict[str, Any]]], Any] = default_collate,
    stats: BatchStats | None = None,
) -> Iterator[Any]:
    """Yield exactly ``num_batches`` collated batches of ``batch_size`` samples."""
    pending: list[dict[str, Any]] = []
    recent: list[dict[str, Any]] = []  # the last full batch: material to refill from
    made = 0
    chunks = iter(chunks)
    for chunk in chunks:
        pending += chunk
        start = 0
        while len(pending) - start >= batch_size:
            recent = pending[start : start + batch_size]
            yield collate(recent)
            start += batch_size
            made += 1
            if made == num_batches:
                _finish(chunks, len(pending) - start)
                return
        del pending[:start]
    if made < num_batches:
        pool = recent + pending
        if not pool:
            raise TooManyErrors(f"no sample could be read for this worker: all of its samples failed and were skipped, "
                                f"so its {num_batches} batches cannot be filled (see the warnings above for why)")
        missing = (num_batches - made) * batch_size - len(pending)
        if stats is not None:
            stats.refilled += missing
        logger.warning("repeating %d samples to keep %d equal batches (samples were skipped)", missing, num_batches)
        i = 0
        while made < num_batches:
            pending.append(pool[i % len(pool)])
            i += 1
            if len(pending) == batch_size:
                yield collate(pending)
                made += 1
                pending = []


# -- worker -> main process hand-off --------------------------------------------------------
# DataLoader workers send every torch tensor through a new shared-memory segment, a fixed cost of
# tens of microseconds per tensor that dominates for small fields (labels, ids). Under make_loader
# such small tensors travel inline as numpy arrays and become tensors again on arrival
# (``torch.from_numpy``, no copy); large ones (images) keep the shared-memory path.
INLINE_KEY = "__inline__"
INLINE_MAX_BYTES = 64 * 1024


def pack_for_transport(batch: Any, max_bytes: int = INLINE_MAX_BYTES) -> Any:
    import torch

    if not isinstance(batch, dict):
        return batch
    inline = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.nbytes <= max_bytes and v.device.type == "cpu"]
    for k in inline:
        batch[k] = batch[k].numpy()
    if inline:
        batch[INLINE_KEY] = inline
    return batch


def unpack_after_transport(batch: Any, pin: bool = False) -> Any:
    if not isinstance(batch, dict) or INLINE_KEY not in batch:
        return batch
    import torch

    for k in batch.pop(INLINE_KEY):
        t = torch.from_numpy(batch[k])
        batch[k] = t.pin_memory() if pin else t
    return batch
