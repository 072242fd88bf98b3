"""ShardStream: the IterableDataset users import. It wires the stages together, in order:

    sources (one dataset, or a mix) -> RunPlan: pass plan -> (rank, worker) windows
        -> read_ranges per source -> shuffle (continued where a resumed pass stood) -> merge_sources
        -> decode_samples -> transform -> batch_samples -> batches

Between read_ranges and batch_samples, samples travel as lists (one per read block). What each
(rank, worker) reads in a pass, for one dataset or a mix, by epochs or by steps, fresh or resumed
(exactly or elastically), is ``plan/run.py``'s answer; this class holds the settings, the epoch
clock and a loaded state, and asks it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardstream.buffers import BufferPool
from shardstream.clock import EpochClock
from shardstream.errors import ConfigError
from shardstream.format.manifest import Manifest
from shardstream.options import Decode, OnError, Schedule, Shuffle, Store, refuse_moved
from shardstream.pipeline.batch import BatchStats, batch_samples, default_collate
from shardstream.pipeline.decode import Decoder, decode_samples, default_decoders
from shardstream.pipeline.interleave import read_planned
from shardstream.pipeline.read import RangeSource, read_ranges, read_scattered
from shardstream.pipeline.transform import bind_per_sample, transform_samples
from shardstream.plan.epoch import EpochPlan
from shardstream.plan.mix import MixPlan
from shardstream.plan.run import PassPlan, RunPlan, RunSettings
from shardstream.plan.state import State
from shardstream.plan.topology import World, current_worker
from shardstream.policy import ErrorPolicy
from shardstream.sources import Mix, Source, open_sources, plan_sources, source_transforms
from shardstream.stats import StreamStats
from shardstream.storage.cache import ShardCache
from shardstream.storage.requests import with_requests
from shardstream.storage.scan import scan_shards
from shardstream.storage.urls import expand_urls

logger = logging.getLogger(__name__)


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
    ``on_error=OnError(policy, tolerance)``, ``store=Store(options, config, read, cache)`` (where
    the shards are and how they are read), ``schedule=Schedule(steps, samples_per_epoch,
    per_batch)`` (a pass's length, a mix's interleave) and ``world=World(rank, world_size)``
    (default: detected, see ``World.detect``).
    """

    def __init__(
        self,
        source: str | Manifest | Source | Sequence[Source],
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
        store: Store | None = None,
        schedule: Schedule | None = None,
        **moved: Any,
    ):
        super().__init__()
        refuse_moved("ShardStream", moved)
        self.store, self.schedule = store or Store(), schedule or Schedule()
        self.storage_options = dict(self.store.options or {})  # the stream's; a mix's Source may give its own
        self.storage, self.read = self.store.config, self.store.read
        self.sources: Mix = open_sources(source, self.storage_options, self.storage)  # a single dataset is a mix of one
        self.manifest = self.sources.manifests[0]
        self.counts = self.manifest.counts  # int64 array, one entry per shard: all that planning needs
        self.world = world if world is not None else World.detect()
        self.batch_size, self.seed, self.mode = batch_size, seed, mode
        # None: no shuffling at all (shards in manifest order, no buffer).
        self.shuffler: Shuffle | None = (Shuffle() if shuffle is True else shuffle) if shuffle is not False else None
        self.shuffle = self.shuffler is not None
        self.transform, self.collate = transform, collate or default_collate
        self._transform = source_transforms(self.sources, transform)  # a mix's per-source transforms, then this one
        self.on_error = OnError.of(on_error)
        manifests = self.sources.manifests
        # The documented default (options.Read): read-ahead where any shard is on remote storage.
        self.readahead = [self.read.readahead_for(m.shard_url(i) for i in range(len(m.shards))) for m in manifests]
        self.readahead_bytes = self.readahead[0]
        self.cache = self._open_cache(manifests)
        self.decode = Decode.of(decode)
        decoders = default_decoders(self.decode.image, self.decode.draft_size) if self.decode.defaults else {}
        decoders.update(self.decode.decoders or {})
        self.decoder = Decoder(decoders, self.decode.required, self.decode.alias)
        self._run = RunPlan(
            plan_sources(self.sources),
            RunSettings(  # settings that cannot work fail here
                seed=seed,
                shuffle=self.shuffle,
                mode=mode,
                per_batch=self.schedule.per_batch,
                world_size=self.world.world_size,
                batch_size=batch_size,
                shuffle_buffer=self.shuffler.buffer if self.shuffler is not None else 0,
                shuffle_initial=(self.shuffler or Shuffle()).initial_fill,
                steps=self.schedule.steps,
                samples_per_epoch=self.schedule.samples_per_epoch,
            ),
        )
        self._loaded: State | None = None  # a loaded state: its pass continues it (a run by steps goes on from it)
        # Shared with DataLoader workers (persistent ones too), so set_epoch and a loaded state reach them.
        self._clock = EpochClock()
        self._stats = StreamStats()

    def _open_cache(self, manifests: Sequence[Manifest]) -> ShardCache | None:
        cache = self.store.cache
        if cache is None:
            return None
        opened = ShardCache(cache.dir, cache.limit, verify=cache.verify)
        for m in manifests:
            if len(m.sizes):  # the smallest shard, and every one too large to cache (numpy, not a loop)
                picks = {int(m.sizes.argmin()), *(int(i) for i in np.flatnonzero(m.sizes > opened.limit))}
                opened.check_fits([(int(m.sizes[i]), m.shard_url(i)) for i in sorted(picks)])
        return opened

    @classmethod
    def from_urls(cls, urls: str | Sequence[str], *, store: Store | None = None, threads: int = 8, **options: Any) -> ShardStream:
        """A ShardStream over shard files that have no manifest: a brace pattern, a glob, a URL or
        a list of them. Every shard is read end to end once, here (``threads`` in parallel), to
        count its samples and find their offsets; for large datasets write the manifest once with
        ``shardstream index`` (or pack with ``shardstream pack``) and pass its folder instead.
        ``options`` are the constructor's."""
        refuse_moved("ShardStream.from_urls", {k: v for k, v in options.items() if k == "storage_options"})
        store = store or Store()
        patterns = [urls] if isinstance(urls, str) else list(urls)
        found = [u for p in patterns for u in expand_urls(p, store.options)]
        if not found:
            raise ConfigError(f"no shards match {urls!r}: check the pattern (brace ranges, glob) and the storage options")
        logger.info("indexing %d shards without a manifest (one full read each)", len(found))
        return cls(scan_shards(found, store.options, threads=threads, config=store.config), store=store, **options)

    # -- epochs and plans ----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress (or the last one); before any pass, the one set."""
        return self._clock.current

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass follow epoch ``epoch`` (same on every rank); later passes go on from it."""
        self._clock.set(epoch)

    def plan(self, epoch: int | None = None, num_workers: int | None = None) -> EpochPlan | MixPlan:
        """The exact plan of a data epoch for this topology (pure: no I/O); ``num_workers`` is
        checked (ConfigError when some worker would have nothing to yield). A run by steps crosses
        data epochs: workers split each pass, the plan is the data epoch's. Without
        ``num_workers``, with a loaded state waiting for this epoch, the summary also says how the
        next pass resumes (with as many workers as the last pass had)."""
        plan = self._run.report(self.epoch if epoch is None else epoch, num_workers)
        plan = with_requests(plan, self.sources.manifests)  # remote data: the summary says the GETs it makes (storage/requests.py)
        resume = self.resume_plan() if num_workers is None and epoch in (None, self.epoch) else None
        return dataclasses.replace(plan, resumed=resume.summary()) if resume is not None else plan

    def check_workers(self, num_workers: int) -> None:
        """Raise ConfigError, naming the numbers, where ``num_workers`` workers per rank cannot
        work (some would have nothing to yield): what ``plan(num_workers=...)`` checks, without
        planning the epoch's shard order."""
        self._run.check_workers(num_workers)

    def pass_plan(self, num_workers: int | None = None) -> PassPlan:
        """How the next pass runs with ``num_workers`` workers per rank (default: as many as the
        last pass had): what every (rank, worker) reads, and the state after n batches of it."""
        workers = self._clock.workers if num_workers is None else num_workers
        return self._run.pass_plan(self._clock.upcoming, workers, self._loaded, self._clock.upcoming_resumed)

    def resume_plan(self, num_workers: int | None = None) -> PassPlan | None:
        """How the next pass continues a loaded state (None when none waits for it): exactly, or
        elastically on another topology; ``.summary()`` says it in one line. Pure, no I/O."""
        return self.pass_plan(num_workers) if self._clock.upcoming_resumed else None

    def stats(self) -> dict[str, int]:
        """Counters summed over this rank's workers since construction (see ``stats.COUNTERS``)."""
        return self._stats.totals()

    @property
    def counters(self) -> StreamStats:
        """The counters shared with this rank's workers (totals, and each worker's last step)."""
        return self._stats

    def __len__(self) -> int:
        """Batches this rank yields per pass (the same on every rank and every epoch; ``steps`` if given)."""
        return self._run.batches_per_pass

    # -- iteration (runs in each DataLoader worker) ---------------------------------------------
    def __iter__(self):
        worker, num_workers = current_worker()
        rank = self.world.rank
        epoch, resumed = self._clock.start_pass(worker, num_workers)  # self.epoch is this pass's from here on
        plan = self._run.pass_plan(epoch, num_workers, self._loaded, resumed)
        part = plan.worker(rank, worker)
        if worker == 0 and rank == 0:
            logger.info("%s", plan.summary())
        for fn in (*self.decoder.decoders.values(), self._transform):
            if fn is not None and hasattr(fn, "bind"):  # seeded augmentation: reproducible per (epoch, rank, worker)
                fn.bind(epoch, rank, worker)
        counters = self._stats.counters(worker)
        counters.step(f"planning its share of epoch {epoch} (rank {rank}, worker {worker} of {num_workers})")
        buffers = BufferPool()  # this pass's large member and batch buffers, reused once unreferenced
        policy = ErrorPolicy(self.on_error.policy, self.on_error.tolerance, counters)
        stats = BatchStats()
        sources = [self._range_source(i, counters, buffers) for i in range(len(self.sources.manifests))]
        samples = read_planned(
            part,
            lambda i, ranges: read_ranges(sources[i], ranges, policy=policy),
            lambda i, ranges: read_scattered(sources[i], ranges, policy=policy),
        )
        decoder, transform = bind_per_sample(self.decoder, self._transform)
        samples = decode_samples(samples, decoder, policy)
        filtered = [0]
        if transform is not None:
            samples = transform_samples(samples, transform, counters, filtered, policy)
        batches = (
            batch_samples(samples, batch_size=self.batch_size, num_batches=part.num_batches, collate=self.collate, stats=stats, buffers=buffers)
            if part.num_batches
            else iter(())
        )
        for made, batch in enumerate(batches, 1):
            counters.step(f"made batch {made} of {part.num_batches} of epoch {epoch}", batch=True)
            yield batch
        if policy.skipped or stats.refilled or filtered[0]:
            dropped = f" (and the transform dropped {filtered[0]})" if filtered[0] else ""
            logger.warning(
                "rank %d worker %d epoch %d: skipped %d bad samples%s, repeated %d to keep batches equal",
                rank,
                worker,
                epoch,
                policy.skipped,
                dropped,
                stats.refilled,
            )

    def _range_source(self, i: int, counters: Any, buffers: BufferPool | None = None) -> RangeSource:
        """Where source i is read from: its own storage options (a mix's Source) or the stream's, and its read-ahead."""
        own = self.sources.sources[i].storage_options
        return RangeSource(
            self.sources.manifests[i],
            storage_options=dict(own) if own is not None else self.storage_options,
            read_size=self.read.read_size,
            counters=counters,
            cache=self.cache,
            readahead_bytes=self.readahead[i],
            verify_stream=self.read.verify_stream,
            config=self.storage,
            keep_buffers=self.decoder.viewing_exts(),
            buffers=buffers,
            readahead_threads=self.read.readahead_threads,
        )

    # -- resume: torchdata's Stateful protocol ----------------------------------------------------
    def state_dict(self, batches: int | None = None, num_workers: int | None = None) -> dict[str, Any]:
        """The data position as a small JSON-serialisable dict (plan/state.py).

        ``batches``: how many batches the training loop received in the current pass (its step
        count within the loader epoch). Only the loop knows what it received (batches sitting in
        prefetch queues are not consumed), so once a pass has started, give it: with your own
        DataLoader, or iterating this dataset yourself. ``make_loader``'s loader counts for you:
        prefer ``loader.state_dict()``. Every rank receives the same count, so rank 0's state is
        enough for all ranks. Before a pass starts: the state at its start (a loaded one, as loaded).
        """
        if not self._clock.started:
            return self.pass_plan(num_workers).state_after(batches or 0)
        if batches is None:
            raise ConfigError(
                "a pass over this ShardStream has started and only the training loop knows how many batches "
                "it received: call state_dict(batches=STEPS_THIS_EPOCH), or use make_loader's loader.state_dict()"
            )
        workers = self._clock.workers if num_workers is None else num_workers
        plan = self._run.pass_plan(self._clock.current, workers, self._loaded, self._clock.current_resumed)
        return plan.state_after(batches)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from ``state_dict``): the next pass over its loader epoch
        delivers the rest of it. Same topology: exactly the batches an uninterrupted run would
        have delivered, in order. Another world size, worker count, batch size or shuffle buffer:
        the data epoch in progress is finished first (every sample not yet consumed, once; pad
        mode: at least once) in equal batches per rank, then fresh data epochs follow. Sets the
        epoch to the state's. Raises StateError for a state of other data, seed, shuffle, mode,
        schedule or version. Load it before the DataLoader starts its (persistent) workers."""
        self._loaded = self._run.load(state)
        self._clock.load(self._loaded.loader_epoch)
