"""``ShardDataModule``: shardstream datasets as a PyTorch Lightning ``LightningDataModule``.

Train, validation, test and predict sources are anything ``ShardStream`` accepts (a dataset root
or manifest URL, a ``Manifest``, a ``Source`` or a mix of them); the streams are built in
``setup``, on each rank once Lightning has started the process group, so each learns its rank from
it. Every loader is a ``make_loader`` loader, which Lightning leaves as it is: it replaces the
sampler only of a ``torch.utils.data.DataLoader``, and shardstream splits the data over ranks itself.

- **Training** resumes mid-epoch through Lightning's own checkpoint (``fit(ckpt_path=...)``),
  exactly on the same topology and elastically on another. The loader is Stateful
  (``state_dict``/``load_state_dict``), so the fit loop saves its position with the checkpoint.
  Lightning counts the epoch's batches itself: it restores its count of the batches done and
  ends the epoch at ``len(loader)``, a length it reads *before* loading the loader's state. So the
  module saves the position in its own ``state_dict`` too (with the count of batches done in the
  pass, which an elastic resume cannot recompute), and its ``load_state_dict``, which Lightning
  calls before it asks for the loaders, gives it to the training loader as it is made: its
  ``len`` is then the batches done plus those the resumed pass yields, on any topology. Every rank
  receives the same number of batches, so rank 0's state, the one in the checkpoint, is every
  rank's. The loader's epoch follows the trainer's: Lightning calls ``set_epoch`` on a loader's
  ``sampler`` at each epoch start, and this loader's ``sampler`` passes it on.
- **Validation, test and predict** run in pad mode without shuffling: every rank gets the same
  number of batches (no collective waits on a rank that has run out), and each batch carries
  ``batch["__valid__"]``, a bool tensor that is False for the samples repeated to make batches
  equal. A metric that weighs samples by it counts each sample of the dataset exactly once over
  all ranks.

- **No validation data** with a model that has ``validation_step``: validation is skipped, as
  Lightning skips it for a module without a val dataloader.

``ShardDataModule`` is a ``LightningDataModule`` of every Lightning package installed:
``lightning.pytorch`` (the ``lightning`` package) and ``pytorch_lightning`` (``pytorch-lightning``,
``pip install 'shardstream[lightning]'``). Installing ``lightning`` often leaves an earlier
``pytorch-lightning`` in place; either package's ``Trainer`` then takes the module as its own.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from shardstream.dataset import ShardStream
from shardstream.errors import ConfigError
from shardstream.loader import ShardLoader, make_loader

LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")  # the two packages' module names


def _datamodule_bases() -> tuple[type, ...]:
    """The ``LightningDataModule`` class of each Lightning package that imports here: a Trainer
    accepts a datamodule only of its own package's class, and the user's Trainer may come from either."""
    bases = []
    for name in LIGHTNING_PACKAGES:
        try:
            bases.append(importlib.import_module(name).LightningDataModule)
        except ImportError:
            continue
    if not bases:
        raise ImportError("shardstream.lightning needs PyTorch Lightning: pip install 'shardstream[lightning]' (or lightning)")
    return tuple(bases)


STAGES = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
EVAL_SPLITS = ("val", "test", "predict")


class _LoaderEpochs:
    """What Lightning finds as the loader's ``sampler``: its ``set_epoch(n)``, called at every epoch
    start (also the one a checkpoint resumes), sets the loader's epoch."""

    def __init__(self, loader: ShardLoader):
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)  # the epoch of a loaded state keeps that state (a resume)


class ShardDataModule(*_datamodule_bases()):  # type: ignore[misc]
    """Lightning data for shardstream datasets (see the module docstring).

    ``train``, ``val``, ``test``, ``predict``: the sources (what ``ShardStream`` takes as its
    first argument), any of them None. ``batch_size``: per rank; ``eval_batch_size`` for the
    other splits (default ``batch_size``). ``num_workers`` and ``loader_options`` (a dict of
    further ``make_loader`` keywords) make every loader. Other keywords are ``ShardStream``
    options (``shuffle``, ``seed``, ``decode``, ``transform``, ``collate``, ``on_error``, ``store``,
    ``schedule``, ``mode``, ...) for every split, and ``eval_options`` overrides them for
    validation, test and predict, which always run with ``mode="pad"`` and ``shuffle=False``
    (``eval_options`` may change the shuffle, not the mode).
    """

    def __init__(
        self,
        train: Any = None,
        val: Any = None,
        test: Any = None,
        predict: Any = None,
        *,
        batch_size: int,
        eval_batch_size: int | None = None,
        num_workers: int = 2,
        loader_options: Mapping[str, Any] | None = None,
        eval_options: Mapping[str, Any] | None = None,
        **stream_options: Any,
    ):
        super().__init__()
        if eval_options and eval_options.get("mode", "pad") != "pad":
            raise ConfigError("validation, test and predict run in mode='pad' (every sample once, repeats marked in __valid__)")
        for name in ("batch_size", "world"):
            if name in stream_options:
                raise ConfigError(f"ShardDataModule sets {name} itself: pass batch_size=, and leave the rank to the trainer")
        self.sources = {"train": train, "val": val, "test": test, "predict": predict}
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.loader_options = dict(loader_options or {})
        self.stream_options = dict(stream_options)
        self.eval_options = {"shuffle": False, **(eval_options or {}), "mode": "pad"}
        self.eval_options.pop("schedule", None)
        self.streams: dict[str, ShardStream] = {}
        self.train_loader: ShardLoader | None = None  # the last one train_dataloader made
        self._resume: dict[str, Any] | None = None  # from load_state_dict, for the next training loader

    def stream(self, split: str) -> ShardStream:
        """The ``ShardStream`` of ``split`` ("train", "val", "test" or "predict"), built on first use."""
        if split not in self.sources:
            raise ConfigError(f"no split {split!r}: train, val, test or predict")
        if self.sources[split] is None:
            raise ConfigError(f"this ShardDataModule has no {split} data: pass {split}= to it")
        if split not in self.streams:
            options = dict(self.stream_options)
            batch_size = self.batch_size
            if split in EVAL_SPLITS:
                options.pop("schedule", None)
                options.update(self.eval_options)
                batch_size = self.eval_batch_size
            self.streams[split] = ShardStream(self.sources[split], batch_size=batch_size, **options)
        return self.streams[split]

    def setup(self, stage: str) -> None:
        for split in STAGES.get(stage, ()):
            if self.sources[split] is not None:
                self.stream(split)

    def _loader(self, split: str) -> ShardLoader:
        return make_loader(self.stream(split), num_workers=self.num_workers, **self.loader_options)

    def train_dataloader(self) -> ShardLoader:
        loader = self.train_loader = self._loader("train")
        loader.sampler = _LoaderEpochs(loader)
        resume, self._resume = self._resume, None
        if resume is not None:  # before Lightning reads len(loader): the resumed pass's length
            loader.load_state_dict(resume["train"])
            loader.counted_before = int(resume["counted"])
        return loader

    def val_dataloader(self) -> ShardLoader | list:
        if self.sources["val"] is None:
            return []  # no validation data: Lightning skips validation, as for a module without val_dataloader
        return self._loader("val")

    def test_dataloader(self) -> ShardLoader:
        return self._loader("test")

    def predict_dataloader(self) -> ShardLoader:
        return self._loader("predict")

    def state_dict(self) -> dict[str, Any]:
        """What Lightning saves with a checkpoint: the training loader's position and the batches
        of the pass done (Lightning's own count; see the module docstring). Empty before training."""
        loader = self.train_loader
        if loader is None:
            return {}
        return {"train": loader.state_dict(), "counted": len(loader) - loader.remaining}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called by Lightning with a checkpoint's ``state_dict()`` before it asks for the loaders:
        the next training loader starts from it."""
        if state_dict.get("train") is not None:
            self._resume = dict(state_dict)
