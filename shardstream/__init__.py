"""shardstream: pack datasets into WebDataset tar shards and stream them into DDP training.

    source -> writer -> shards + manifest -> plan (rank, worker) -> tar stream -> samples
           -> shuffle -> decode -> batch -> loader -> device

``import shardstream`` stays light: heavy modules load on first use of a name below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardstream.version import __version__

_EXPORTS = {
    "ShardWriter": "write.writer",
    "pack": "write.pack",
    "PackResult": "write.pack",
    "Manifest": "format.manifest",
    "load_manifest": "format.manifest",
    "ShardStream": "dataset",
    "Shuffle": "options",
    "Decode": "options",
    "OnError": "options",
    "Read": "options",
    "Cache": "options",
    "Store": "options",
    "Schedule": "options",
    "Source": "sources",
    "Table": "format.parquet",
    "Tokens": "format.tokens",
    "pack_tokens": "write.tokens",
    "Batched": "pipeline.table",
    "plan_mix": "plan.mix",
    "MixPlan": "plan.mix",
    "make_loader": "loader",
    "to_device": "device",
    "DevicePrefetcher": "device",
    "World": "plan.topology",
    "get_worker_info": "plan.topology",
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
    "StorageNotFound": "errors",
    "AccessDenied": "errors",
    "NoCredentials": "errors",
    "StorageUnavailable": "errors",
    "StorageTimeout": "errors",
    "TooManyErrors": "errors",
    "WorkerTimeout": "errors",
    "WorkerDied": "errors",
    "BucketNotFound": "errors",
    "StateError": "errors",
    "StorageConfig": "storage.config",
}

__all__ = [  # literal, so linters and type checkers see it; tests check it matches _EXPORTS
    "AccessDenied",
    "Batched",
    "BucketNotFound",
    "Cache",
    "ChecksumError",
    "ConfigError",
    "Decode",
    "DestinationError",
    "DevicePrefetcher",
    "EpochPlan",
    "get_worker_info",
    "load_manifest",
    "make_loader",
    "Manifest",
    "ManifestError",
    "MixPlan",
    "NoCredentials",
    "OnError",
    "pack",
    "PackResult",
    "plan_epoch",
    "plan_mix",
    "RandomResizedCrop",
    "Read",
    "SampleError",
    "Schedule",
    "ShardFormatError",
    "ShardStream",
    "ShardstreamError",
    "ShardWriter",
    "Shuffle",
    "Source",
    "SourceError",
    "StateError",
    "StorageConfig",
    "StorageError",
    "StorageNotFound",
    "StorageTimeout",
    "StorageUnavailable",
    "Store",
    "Table",
    "to_device",
    "Tokens",
    "pack_tokens",
    "TooManyErrors",
    "World",
    "WorkerDied",
    "WorkerTimeout",
    "__version__",
]

if TYPE_CHECKING:  # the real types for mypy and editors; at run time __getattr__ loads them lazily
    from shardstream.dataset import ShardStream
    from shardstream.device import DevicePrefetcher, to_device
    from shardstream.errors import (
        AccessDenied,
        BucketNotFound,
        ChecksumError,
        ConfigError,
        DestinationError,
        ManifestError,
        NoCredentials,
        SampleError,
        ShardFormatError,
        ShardstreamError,
        SourceError,
        StateError,
        StorageError,
        StorageNotFound,
        StorageTimeout,
        StorageUnavailable,
        TooManyErrors,
        WorkerDied,
        WorkerTimeout,
    )
    from shardstream.format.manifest import Manifest, load_manifest
    from shardstream.format.parquet import Table
    from shardstream.format.tokens import Tokens
    from shardstream.loader import make_loader
    from shardstream.options import Cache, Decode, OnError, Read, Schedule, Shuffle, Store
    from shardstream.pipeline.augment import RandomResizedCrop
    from shardstream.pipeline.table import Batched
    from shardstream.plan.epoch import EpochPlan, plan_epoch
    from shardstream.plan.mix import MixPlan, plan_mix
    from shardstream.plan.topology import World, get_worker_info
    from shardstream.sources import Source
    from shardstream.storage.config import StorageConfig
    from shardstream.write.pack import PackResult, pack
    from shardstream.write.tokens import pack_tokens
    from shardstream.write.writer import ShardWriter


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
