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
        self._pass: list[Any] | None = None  # [epoch, batches received, ResumePlan or None] of the last pass
        self.num_workers = int(kwargs.get("num_workers") or 0)
        self.persistent_workers = bool(kwargs.get("persistent_workers"))

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self):
        pin = self.pin
        interval = self.log_interval
        next_log = time.monotonic() + interval if interval else None
        # Counted here, in the main process, as the loop receives them: batches still in worker
        # queues at checkpoint time are not counted, so they are delivered again after a resume.
        resume = self.dataset.resume_plan(self.num_workers)
        if resume is not None:
            logger.info("%s", resume.summary())
        record: list[Any] = [self.dataset.epoch, 0, resume]
        self._pass = record
        for batch in super().__iter__():
            record[1] += 1
            yield unpack_after_transport(batch, pin)
            if interval and next_log is not None and time.monotonic() >= next_log:
                next_log = time.monotonic() + interval
                logger.info("shardstream: %s", " ".join(f"{k}={v}" for k, v in self.dataset.stats().items()))

        self._end_pass(record)

    def _end_pass(self, record: list[Any]) -> None:
        if record[2] is None:
            return
        # The resumed pass is over: later passes over this epoch start it afresh, so persistent
        # workers (which hold the dataset as it was when they started) are replaced.
        self.dataset._resume = None
        record[1], record[2] = len(self.dataset), None
        if self.persistent_workers:
            self._forget_workers()

    def state_dict(self) -> dict[str, Any]:
        """The data position (torchdata ``Stateful``): small, JSON-serialisable, versioned. It
        counts the batches this loop received in the current epoch; every rank receives the same
        count, so rank 0's state is enough for all. See ``ShardStream.load_state_dict``."""
        record = self._pass
        if record is not None and record[0] == self.dataset.epoch:
            return self.dataset._state(record[1], record[2], self.num_workers)
        return self.dataset.state_dict(batches=0)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``: the next pass over its epoch delivers the rest of it
        (exactly, or elastically on another topology). Persistent workers already started are
        replaced, so they see the state."""
        self.dataset.load_state_dict(state)
        self._pass = None
        self._forget_workers()

    def _forget_workers(self) -> None:
        # The wrapped DataLoader keeps persistent workers in ``_iterator``; dropping it shuts them
        # down, and the next pass starts workers holding the dataset as it is now.
        self.pipeline[0]._iterator = None

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
