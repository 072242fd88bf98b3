"""make_loader: the DataLoader around a ShardStream, as a webdataset.WebLoader with the right defaults.

The dataset batches inside its workers, so the loader's batch_size is None; ``len(loader)`` is the
number of batches per rank per epoch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import webdataset

from shardstream.dataset import ShardStream
from shardstream.pipeline.batch import unpack_after_transport

logger = logging.getLogger(__name__)


def _passthrough(batch: Any) -> Any:
    """The dataset already collated: skip DataLoader's default_convert walk over every element."""
    return batch


class ShardLoader(webdataset.WebLoader):
    """A WebLoader that knows its length (batches per rank per epoch) and forwards set_epoch."""

    def __init__(self, dataset: ShardStream, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        self.dataset = dataset
        self.pin = bool(kwargs.get("pin_memory"))
        self.log_interval: float | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self):
        pin = self.pin
        interval = self.log_interval
        next_log = time.monotonic() + interval if interval else None
        for batch in super().__iter__():
            yield unpack_after_transport(batch, pin)
            if interval and next_log is not None and time.monotonic() >= next_log:
                next_log = time.monotonic() + interval
                logger.info("shardstream: %s", " ".join(f"{k}={v}" for k, v in self.dataset.stats().items()))

    def stats(self) -> dict[str, int]:
        return self.dataset.stats()

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


def make_loader(
    dataset: ShardStream,
    *,
    num_workers: int = 2,
    pin_memory: bool = True,
    prefetch_factor: int | None = 2,
    persistent_workers: bool = False,
    log_interval: float | None = 60.0,
    **kwargs: Any,
) -> ShardLoader:
    """Wrap ``dataset`` in a loader; checks that ``num_workers`` leaves every worker something to read.

    ``pin_memory`` only takes effect where an accelerator is present. Extra keyword arguments go
    to ``torch.utils.data.DataLoader``. Every ``log_interval`` seconds (None: never) the stream
    counters of this rank are logged at INFO level; ``loader.stats()`` reads them any time.
    """
    import torch

    dataset.num_workers = num_workers
    dataset.inline_transport = num_workers > 0
    dataset.plan(num_workers=num_workers)  # raises ConfigError naming the numbers
    kwargs.setdefault("collate_fn", _passthrough)
    loader = ShardLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
        **kwargs,
    )
    loader.log_interval = log_interval
    return loader
