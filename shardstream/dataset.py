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

from shardstream.errors import ConfigError
from shardstream.format.manifest import Manifest, load_manifest
from shardstream.options import Cache, Decode, OnError, Read, Shuffle
from shardstream.pipeline.batch import BatchStats, batch_samples, default_collate
from shardstream.pipeline.decode import Decoder, decode_samples, default_decoders
from shardstream.pipeline.read import RangeSource, read_ranges
from shardstream.pipeline.shuffle import shuffle_samples, worker_rng
from shardstream.plan.epoch import EpochPlan, plan_epoch
from shardstream.plan.topology import World, current_worker
from shardstream.policy import ErrorPolicy
from shardstream.stats import MAX_SLOTS, StreamStats
from shardstream.storage.cache import ShardCache
from shardstream.storage.scan import scan_shards
from shardstream.storage.urls import expand_urls, is_shard_pattern

logger = logging.getLogger(__name__)


def _load_source(source: str | Manifest, storage_options: Mapping[str, Any] | None) -> Manifest:
    """A Manifest as is, or the manifest of a dataset root / index.json URL. Shard URLs are refused
    here: indexing them reads every shard, which ``ShardStream.from_urls`` does on request."""
    if isinstance(source, Manifest):
        return source
    if not isinstance(source, str) or is_shard_pattern(source):
        shown = source if isinstance(source, str) else "[...]"
        raise ConfigError(
            f"{source!r} names shard files, not a packed dataset (a folder or URL with index.json): use "
            f"ShardStream.from_urls({shown!r}, ...) to index them at start-up (one full read of every shard), "
            f"or write their manifest once with `shardstream index '{shown}' DEST` and pass DEST"
        )
    return load_manifest(source, storage_options)


def _shared_lock() -> Any:
    """A lock that forked, spawned and forkserver workers can all share: a spawn-context lock
    (a fork-context one refuses to travel to spawned processes)."""
    return multiprocessing.get_context("spawn").Lock()


class EpochClock:
    """Which epoch each pass over the dataset follows, shared by the main process and its workers.

    ``set_epoch(e)``: the next pass is epoch e. Without it, every new pass advances the epoch by
    one by itself (the same on every rank, which all make the same passes). A pass is recognised
    where it starts, in each worker: a worker that already took part in the current pass, or a
    different number of workers than the current pass has, starts the next one. So persistent
    and fresh workers, a plain DataLoader, ``make_loader`` and direct iteration all count alike.
    """

    def __init__(self) -> None:
        # [set epoch, passes started since, workers in the current pass, then per worker slot the
        # pass it last took part in]
        self._state: Any = multiprocessing.RawArray("q", 3 + MAX_SLOTS)
        self._lock: Any = _shared_lock()

    def set(self, epoch: int) -> None:
        with self._lock:
            self._state[:] = [epoch] + [0] * (len(self._state) - 1)

    @property
    def next(self) -> int:
        """The epoch the next pass will follow."""
        return self._state[0] + self._state[1]

    def start_pass(self, worker: int, num_workers: int) -> int:
        """Called once per pass by each worker (or the main process as worker 0 of 1): its epoch."""
        state = self._state
        slot = 3 + worker % MAX_SLOTS
        with self._lock:
            if state[1] == 0 or state[slot] == state[1] or state[2] != num_workers:
                state[1] += 1
                state[2] = num_workers
            state[slot] = state[1]
            return state[0] + state[1] - 1

    def __getstate__(self):
        if multiprocessing.context.get_spawning_popen() is None:
            return {"values": list(self._state)}  # a plain copy (pickle, deepcopy): its own clock
        return {"state": self._state, "lock": self._lock}

    def __setstate__(self, d) -> None:
        if "values" in d:
            self._state = multiprocessing.RawArray("q", d["values"])
            self._lock = _shared_lock()
        else:
            self._state, self._lock = d["state"], d["lock"]


class ShardStream(torch.utils.data.IterableDataset):
    """Stream batches from WebDataset tar shards, split exactly across ranks and workers.

    Every rank yields ``len(self)`` batches per epoch, known before it starts; in ``mode="drop"``
    no sample appears twice in an epoch across all ranks and workers, in ``mode="pad"`` every
    sample appears at least once. Each new pass over the dataset follows the next epoch's order by
    itself; ``set_epoch(e)`` makes the next pass epoch e (call it every epoch to be explicit, e.g.
    when resuming).

    Batches are made inside the dataset: under a plain ``torch.utils.data.DataLoader`` pass
    ``batch_size=None`` (its default of 1 would add a dimension of 1 to every field), or use
    ``make_loader``. A ``transform`` may return a dict, a tuple, a list or a tensor (batched like
    torch's default_collate), or None to drop the sample (counted in ``stats()["samples_filtered"]``;
    batches stay equal by repeating recent samples, as after skipped errors).

    The common options are keywords; rare ones come grouped as small frozen values documented in
    ``shardstream.options``: ``shuffle=Shuffle(buffer, initial)``, ``decode=Decode(...)``,
    ``on_error=OnError(policy, tolerance)``, ``read=Read(...)``, ``cache=Cache(dir, limit)``, and
    ``world=World(rank, world_size)`` (default: detected, see ``World.detect``).
    """

    def __init__(
        self,
        source: str | Manifest,
        *,
        batch_size: int,
        shuffle: bool | Shuffle = True,
        seed: int = 0,
        decode: bool | Mapping[str, Callable[[bytes], Any]] | Decode = True,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        mode: str = "drop",
        on_error: str | OnError = "raise",
        world: World | None = None,
        storage_options: Mapping[str, Any] | None = None,
        read: Read | None = None,
        cache: Cache | None = None,
    ):
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.manifest = _load_source(source, self.storage_options)
        self.counts = [s.samples for s in self.manifest.shards]
        self.world = world if world is not None else World.detect()
        self.batch_size = batch_size
        # None: no shuffling at all (shards in manifest order, no buffer).
        self.shuffle: Shuffle | None = (Shuffle() if shuffle is True else shuffle) if shuffle is not False else None
        self.seed = seed
        self.mode = mode
        self.transform = transform
        self.collate = collate or default_collate
        self.on_error = OnError.of(on_error)
        self.read = read or Read()
        self.readahead_bytes = self.read.readahead_for(self.manifest.shard_url(i) for i in range(len(self.counts)))
        self.cache = None
        if cache is not None:
            self.cache = ShardCache(cache.dir, cache.limit, verify=cache.verify)
            largest = max(range(len(self.manifest.shards)), key=lambda i: self.manifest.shards[i].bytes, default=None)
            if largest is not None:
                self.cache.check_fits(self.manifest.shards[largest].bytes, self.manifest.shard_url(largest))
        self.decode = Decode.of(decode)
        decoders = default_decoders(self.decode.image, self.decode.draft_size) if self.decode.defaults else {}
        decoders.update(self.decode.decoders or {})
        self.decoder = Decoder(decoders, self.decode.required)
        # Shared with DataLoader workers (persistent ones too), so set_epoch reaches them.
        self._clock = EpochClock()
        self._stats = StreamStats()
        self.plan()  # settings that cannot work fail here

    @classmethod
    def from_urls(
        cls,
        urls: str | Sequence[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        threads: int = 8,
        **options: Any,
    ) -> ShardStream:
        """A ShardStream over shard files that have no manifest: a brace pattern, a glob, a URL or
        a list of them. Every shard is read end to end once, here (``threads`` in parallel), to
        count its samples and find their offsets; for large datasets write the manifest once with
        ``shardstream index`` (or pack with ``shardstream pack``) and pass its folder instead.
        ``options`` are the constructor's."""
        patterns = [urls] if isinstance(urls, str) else list(urls)
        found = [u for p in patterns for u in expand_urls(p, storage_options)]
        if not found:
            raise ConfigError(f"no shards match {urls!r}: check the pattern (brace ranges, glob) and the storage options")
        logger.info("indexing %d shards without a manifest (one full read each)", len(found))
        return cls(scan_shards(found, storage_options, threads=threads), storage_options=storage_options, **options)

    # -- epochs and plans ----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next pass over the dataset will follow."""
        return self._clock.next

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass follow epoch ``epoch`` (same on every rank); later passes go on from it."""
        self._clock.set(epoch)

    def plan(self, epoch: int | None = None, num_workers: int | None = None) -> EpochPlan:
        """The exact plan of an epoch for this topology (pure: no I/O). ``num_workers``: DataLoader
        workers per rank (0 or None: iteration in the main process); inside a worker, ``__iter__``
        plans for the loader's actual number, from ``torch.utils.data.get_worker_info``."""
        return plan_epoch(
            self.counts, world_size=self.world.world_size,
            num_workers=num_workers or 0,
            batch_size=self.batch_size, seed=self.seed, epoch=self.epoch if epoch is None else epoch,
            shuffle=self.shuffle is not None, mode=self.mode,
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
        plan = self.plan(epoch=self._clock.start_pass(worker, num_workers), num_workers=num_workers)
        rank = self.world.rank
        ranges = plan.ranges(rank, worker, self.counts)
        if worker == 0 and rank == 0:
            logger.info("%s", plan.summary())
        for fn in (*self.decoder.decoders.values(), self.transform):
            if fn is not None and hasattr(fn, "bind"):  # seeded augmentation: reproducible per (epoch, rank, worker)
                fn.bind(plan.epoch, rank, worker)
        counters = self._stats.counters(worker)
        policy = ErrorPolicy(self.on_error.policy, self.on_error.tolerance, counters)
        stats = BatchStats()
        source = RangeSource(self.manifest, storage_options=self.storage_options, read_size=self.read.read_size,
                             counters=counters, cache=self.cache, readahead_bytes=self.readahead_bytes,
                             verify_stream=self.read.verify_stream)
        samples = read_ranges(source, ranges, policy=policy)
        if self.shuffle is not None and self.shuffle.buffer > 1:
            samples = shuffle_samples(samples, buffer_size=self.shuffle.buffer, initial=self.shuffle.initial_fill,
                                      rng=worker_rng(self.seed, plan.epoch, rank, worker))
        samples = decode_samples(samples, self.decoder, policy)
        filtered = [0]
        if self.transform is not None:
            samples = transform_samples(samples, self.transform, counters, filtered)
        yield from batch_samples(samples, batch_size=self.batch_size, num_batches=plan.worker_batches(worker),
                                 collate=self.collate, stats=stats)
        if policy.skipped or stats.refilled or filtered[0]:
            dropped = f" (and the transform dropped {filtered[0]})" if filtered[0] else ""
            logger.warning("rank %d worker %d epoch %d: skipped %d bad samples%s, repeated %d to keep batches equal",
                           rank, worker, plan.epoch, policy.skipped, dropped, stats.refilled)



def transform_samples(chunks, transform, counters, filtered: list[int]):
    """Apply the user's transform to lists of samples; a None result drops the sample (counted)."""
    for chunk in chunks:
        out = [transform(x) for x in chunk]
        kept = [y for y in out if y is not None]
        if len(kept) != len(out):
            counters.add("samples_filtered", len(out) - len(kept))
            filtered[0] += len(out) - len(kept)
        if kept:
            yield kept
