"""ShardStream: the IterableDataset users import. It wires the stages together, in order:

    manifest -> plan_epoch (rank, worker) -> read_ranges -> shuffle_samples -> decode_samples
             -> transform -> batch_samples -> batches

Between read_ranges and batch_samples, samples travel as lists (one per read block).

Each stage is a function in its own module; this class only holds settings and the epoch.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info

from shardstream.errors import ConfigError
from shardstream.format.manifest import Manifest, load_manifest
from shardstream.format.tar import DEFAULT_READ_SIZE
from shardstream.pipeline.batch import BatchStats, batch_samples, default_collate, pack_for_transport
from shardstream.pipeline.decode import Decoder, decode_samples, default_decoders
from shardstream.pipeline.read import RangeSource, read_ranges
from shardstream.pipeline.shuffle import shuffle_samples, worker_rng
from shardstream.plan.epoch import EpochPlan, plan_epoch
from shardstream.plan.topology import World, current_worker
from shardstream.policy import ErrorPolicy
from shardstream.stats import StreamStats
from shardstream.storage.cache import ShardCache
from shardstream.storage.scan import scan_shards
from shardstream.storage.urls import expand_urls, is_shard_pattern

logger = logging.getLogger(__name__)

DEFAULT_READAHEAD = 64 << 20


def resolve_manifest(source: str | Sequence[str] | Manifest, storage_options: Mapping[str, Any] | None) -> Manifest:
    """A manifest, a dataset root / index.json URL, or shard URLs (brace pattern, glob, list).

    Shard URLs without a manifest are indexed once, here: every shard is read end to end (8 in
    parallel) to count its samples and find their offsets. For large datasets, run
    ``shardstream pack`` (or write a manifest once) instead.
    """
    if isinstance(source, Manifest):
        return source
    if isinstance(source, str) and not is_shard_pattern(source):
        return load_manifest(source, storage_options)
    patterns = [source] if isinstance(source, str) else list(source)
    urls = [u for p in patterns for u in expand_urls(p, storage_options)]
    if not urls:
        raise ConfigError(f"no shards match {source!r}")
    logger.info("no manifest given: indexing %d shards (one full read each)", len(urls))
    return scan_shards(urls, storage_options)


class ShardStream(torch.utils.data.IterableDataset):
    """Stream batches from WebDataset tar shards, split exactly across ranks and workers.

    Every rank yields ``len(self)`` batches per epoch, known before it starts; in ``mode="drop"``
    no sample appears twice in an epoch across all ranks and workers, in ``mode="pad"`` every
    sample appears at least once. Call ``set_epoch(e)`` before each epoch for a new order.
    """

    def __init__(
        self,
        source: str | Sequence[str] | Manifest,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        shuffle_initial: int | None = None,
        decode: bool | Mapping[str, Callable[[bytes], Any]] = True,
        image: str = "tensor",
        draft_size: tuple[int, int] | None = None,
        required: Sequence[str] = (),
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        collate: Callable[[list[dict[str, Any]]], Any] | None = None,
        mode: str = "drop",
        on_error: str = "raise",
        error_tolerance: int = 16,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        read_size: int = DEFAULT_READ_SIZE,
        readahead_bytes: int | None = None,
        cache_dir: str | None = None,
        cache_limit: int | None = None,
        verify_checksums: bool = True,
        verify_stream: bool = False,
    ):
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.manifest = resolve_manifest(source, self.storage_options)
        self.counts = self.manifest.counts  # int64 array, one entry per shard: all that planning needs
        self.world = World.detect(rank, world_size)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer if shuffle else 0
        self.shuffle_initial = shuffle_initial if shuffle_initial is not None else max(1, shuffle_buffer // 10)
        self.mode = mode
        self.transform = transform
        self.collate = collate or default_collate
        self.on_error = on_error
        self.error_tolerance = error_tolerance
        self.read_size = read_size
        self.verify_stream = verify_stream
        first = self.manifest.shard_url(0) if self.manifest.shards else ""
        remote = "://" in first and not first.startswith("file://")
        # Read-ahead pays where storage has latency; on local disk the page cache already reads ahead.
        self.readahead_bytes = readahead_bytes if readahead_bytes is not None else (DEFAULT_READAHEAD if remote else 0)
        self.cache = None
        if cache_dir is not None:
            if cache_limit is None:
                raise ConfigError("cache_dir needs cache_limit (bytes of local disk the cache may use)")
            self.cache = ShardCache(cache_dir, cache_limit, verify=verify_checksums)
            if len(self.manifest.sizes):
                largest = int(self.manifest.sizes.argmax())
                self.cache.check_fits(int(self.manifest.sizes[largest]), self.manifest.shard_url(largest))
        if decode is False:
            decoders: dict = {}
        else:
            decoders = default_decoders(image, draft_size)
            if isinstance(decode, Mapping):
                decoders.update(decode)
        self.decoder = Decoder(decoders, required)
        ErrorPolicy(on_error, error_tolerance)  # raises on a bad on_error here, not later in a worker
        # Shared with DataLoader workers (persistent ones too), so set_epoch reaches them.
        self._epoch = multiprocessing.RawValue("q", 0)
        self._stats = StreamStats()
        self.num_workers = num_workers
        self.inline_transport = False  # set by make_loader, which undoes it on arrival
        self.plan(num_workers=num_workers or 0)  # settings that cannot work fail here

    # -- epochs and plans ----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch.value if not isinstance(self._epoch, int) else self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows (same on every rank)."""
        if isinstance(self._epoch, int):
            self._epoch = epoch
        else:
            self._epoch.value = epoch

    def plan(self, epoch: int | None = None, num_workers: int | None = None) -> EpochPlan:
        """The exact plan of an epoch for this topology (pure: no I/O)."""
        return plan_epoch(
            self.counts, world_size=self.world.world_size,
            num_workers=num_workers if num_workers is not None else (self.num_workers or 0),
            batch_size=self.batch_size, seed=self.seed, epoch=self.epoch if epoch is None else epoch,
            shuffle=self.shuffle, mode=self.mode,
        )

    def stats(self) -> dict[str, int]:
        """Counters summed over this rank's workers since construction (see ``stats.COUNTERS``)."""
        return self._stats.totals()

    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same on every rank and every epoch)."""
        return self.plan(num_workers=0).batches_per_rank

    # -- iteration (runs in each DataLoader worker) ---------------------------------------------
    def __iter__(self):
        worker, num_workers = current_worker()
        plan = self.plan(num_workers=num_workers)
        rank = self.world.rank
        ranges = plan.ranges(rank, worker, self.counts)
        if worker == 0 and rank == 0:
            logger.info("%s", plan.summary())
        for fn in (*self.decoder.decoders.values(), self.transform):
            if fn is not None and hasattr(fn, "bind"):  # seeded augmentation: reproducible per (epoch, rank, worker)
                fn.bind(plan.epoch, rank, worker)
        counters = self._stats.counters(worker)
        policy = ErrorPolicy(self.on_error, self.error_tolerance, counters)
        stats = BatchStats()
        source = RangeSource(self.manifest, storage_options=self.storage_options, read_size=self.read_size,
                             counters=counters, cache=self.cache, readahead_bytes=self.readahead_bytes,
                             verify_stream=self.verify_stream)
        samples = read_ranges(source, ranges, policy=policy)
        if self.shuffle_buffer > 1:
            samples = shuffle_samples(samples, buffer_size=self.shuffle_buffer, initial=self.shuffle_initial,
                                      rng=worker_rng(self.seed, plan.epoch, rank, worker))
        samples = decode_samples(samples, self.decoder, policy)
        if self.transform is not None:
            transform = self.transform
            samples = ([transform(x) for x in chunk] for chunk in samples)
        batches = batch_samples(samples, batch_size=self.batch_size, num_batches=plan.worker_batches(worker),
                                collate=self.collate, stats=stats)
        if self.inline_transport and get_worker_info() is not None:
            batches = map(pack_for_transport, batches)
        yield from batches
        if policy.skipped or stats.refilled:
            logger.warning("rank %d worker %d epoch %d: skipped %d bad samples, repeated %d to keep batches equal",
                           rank, worker, plan.epoch, policy.skipped, stats.refilled)

    # -- pickling (DataLoader spawn, copies) ----------------------------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None and not isinstance(self._epoch, int):
            state["_epoch"] = self._epoch.value  # plain copies cannot share the counter
        return state
