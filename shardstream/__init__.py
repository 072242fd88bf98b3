"""shardstream: pack datasets into WebDataset tar shards and stream them into DDP training.

    source -> writer -> shards + manifest -> plan (rank, worker) -> tar stream -> samples
           -> shuffle -> decode -> batch -> loader -> device

``import shardstream`` stays light: heavy modules load on first use of a name below.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ShardWriter": "write.writer",
    "pack": "write.pack",
    "Manifest": "format.manifest",
    "load_manifest": "format.manifest",
    "ShardStream": "dataset",
    "Source": "mixing",
    "plan_mix": "plan.mix",
    "MixPlan": "plan.mix",
    "make_loader": "loader",
    "to_device": "device",
    "DevicePrefetcher": "device",
    "World": "plan.topology",
    "RandomResizedCrop": "pipeline.augment",
    "plan_epoch": "plan.epoch",
    "EpochPlan": "plan.epoch",
    "ShardstreamError": "errors",
    "ConfigError": "errors",
    "SourceError": "errors",
    "DestinationError": "errors",
    "ManifestError": "errors",
    "StorageError": "errors",
    "ShardFormatError": "errors",
    "ChecksumError": "errors",
    "SampleError": "errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
