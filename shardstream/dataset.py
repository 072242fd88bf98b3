"""ShardStream: the IterableDataset users import. It wires the stages together, in order:

    manifest -> plan_epoch (rank, worker) -> read_ranges -> shuffle_samples -> decode_samples
             -> transform -> batch_samples -> batches

Between read_ranges and batch_samples, samples travel as lists (one per read block). A mix of
sources (``Source`` values or a mix file) plans with plan_mix and reads every source's ranges
through its own read_ranges -> shuffle_samples, then merge_sources interleaves them by the plan.
With ``steps=N`` a rank's N batches come from data epochs laid back to back (plan/steps.py).

Each stage is a function in its own module; this class only holds settings and the epoch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from shardstream.buffers import BufferPool
from shardstream.errors import ConfigError
from shardstream.format.manifest import Manifest, load_manifest
from shardstream.mixing import Mix, Source, open_mix
from shardstream.options import Cache, Decode, OnError, Read, Shuffle
from shardstream.pipeline.batch import BatchStats, batch_samples, default_collate
from shardstream.pipeline.decode import Decoder, decode_samples, default_decoders
from shardstream.pipeline.mix import merge_sources
from shardstream.pipeline.read import RangeSource, read_ranges, read_scattered
from shardstream.pipeline.shuffle import shuffle_samples, worker_rng
from shardstream.plan.epoch import EpochPlan, plan_epoch
from shardstream.plan.mix import MixPlan
from shardstream.plan.mixresume import MixResumePlan, MixResumeState, source_rng
from shardstream.plan.resume import ResumePlan, ResumeState, Segment, dataset_digest
from shardstream.plan.steps import step_windows, worker_steps
from shardstream.plan.topology import World, current_worker
from shardstream.policy import ErrorPolicy
from shardstream.shared import ProcessLock
from shardstream.stats import MAX_SLOTS, StreamStats
from shardstream.storage.cache import ShardCache
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.scan import scan_shards
from shardstream.storage.urls import expand_urls, is_shard_pattern

logger = logging.getLogger(__name__)

def resolve_manifest(source: str | Sequence[str] | Manifest, storage_options: Mapping[str, Any] | None,
                     config: StorageConfig = DEFAULT_STORAGE) -> Manifest:
    """A manifest, a dataset root / index.json URL, or shard URLs (brace pattern, glob, list): the
    resolver of a mix's ``Source`` values (an explicit value per source, so a pattern there is a
    request to index it). Shard URLs are indexed here: every shard is read end to end (8 in
    parallel) to count its samples and find their offsets."""
    if isinstance(source, Manifest):
        return source
    if isinstance(source, str) and not is_shard_pattern(source):
        return load_manifest(source, storage_options, config=config)
    patterns = [source] if isinstance(source, str) else list(source)
    urls = [u for p in patterns for u in expand_urls(p, storage_options)]
    if not urls:
        raise ConfigError(f"no shards match {source!r}")
    logger.info("no manifest given: indexing %d shards (one full read each)", len(urls))
    return scan_shards(urls, storage_options, config=config)


def _load_source(source: str | Manifest, storage_options: Mapping[str, Any] | None,
                 config: StorageConfig = DEFAULT_STORAGE) -> Manifest:
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
    return load_manifest(source, storage_options, config=config)


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
        self._lock: Any = ProcessLock()

    def set(self, epoch: int) -> None:
        with self._lock:
            self._state[:] = [epoch] + [0] * (len(self._state) - 1)

    @property
    def current(self) -> int:
        """The epoch of the pass in progress or last started; before any pass, the epoch set."""
        return self._state[0] + max(self._state[1] - 1, 0)

    @property
    def upcoming(self) -> int:
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
            self._lock = ProcessLock()
        else:
            self._state, self._lock = d["state"], d["lock"]


def _steps(steps: int | None, samples_per_epoch: int | None, per_step: int) -> int | None:
    """Batches per rank per loader epoch when a run counts steps (or samples); None for whole epochs."""
    if steps is not None and samples_per_epoch is not None:
        raise ConfigError("give steps or samples_per_epoch, not both")
    if samples_per_epoch is not None:
        steps = samples_per_epoch // per_step
        if steps < 1:
            raise ConfigError(f"samples_per_epoch={samples_per_epoch} is less than one step of batch_size x world_size "
                              f"= {per_step} samples")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"steps must be a positive integer, got {steps!r}")
    return steps


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
        storage_options: Mapping[str, Any] | None = None,
        read: Read | None = None,
        cache: Cache | None = None,
        per_batch: str = "spread",
        steps: int | None = None,
        samples_per_epoch: int | None = None,
        storage: StorageConfig | None = None,
    ):
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.storage = storage or DEFAULT_STORAGE  # timeouts, retries, deadline, allowed roots
        # A mix (Source values or a mix file) holds one manifest per source; self.manifest is the first.
        self.mix: Mix | None = open_mix(source, self.storage_options,
                                        lambda src, options: resolve_manifest(src, options, self.storage))
        if self.mix is None:
            self.manifest = _load_source(source, self.storage_options, self.storage)  # type: ignore[arg-type]
        else:
            self.manifest = self.mix.manifests[0]
        self.per_batch = per_batch
        self.counts = self.manifest.counts  # int64 array, one entry per shard: all that planning needs
        self.world = world if world is not None else World.detect()
        self.steps = _steps(steps, samples_per_epoch, self.world.world_size * batch_size)
        self.batch_size = batch_size
        # None: no shuffling at all (shards in manifest order, no buffer).
        self.shuffler: Shuffle | None = (Shuffle() if shuffle is True else shuffle) if shuffle is not False else None
        self.shuffle = self.shuffler is not None
        self.shuffle_buffer = self.shuffler.buffer if self.shuffler is not None else 0
        self.shuffle_initial = self.shuffler.initial_fill if self.shuffler is not None else Shuffle().initial_fill
        self.seed = seed
        self.mode = mode
        self.transform = transform
        self.collate = collate or default_collate
        self.on_error = OnError.of(on_error)
        self.read = read or Read()
        manifests = [self.manifest] if self.mix is None else self.mix.manifests
        # The documented default (options.Read): read-ahead where any shard is on remote storage.
        self.readahead = [self.read.readahead_for(m.shard_url(i) for i in range(len(m.shards))) for m in manifests]
        self.readahead_bytes = self.readahead[0]
        self.cache = None
        if cache is not None:
            self.cache = ShardCache(cache.dir, cache.limit, verify=cache.verify)
            for m in manifests:
                if len(m.sizes):  # the smallest shard, and every one too large to cache (numpy, not a loop)
                    picks = {int(m.sizes.argmin()), *(int(i) for i in np.flatnonzero(m.sizes > self.cache.limit))}
                    self.cache.check_fits([(int(m.sizes[i]), m.shard_url(i)) for i in sorted(picks)])
        self.decode = Decode.of(decode)
        decoders = default_decoders(self.decode.image, self.decode.draft_size) if self.decode.defaults else {}
        decoders.update(self.decode.decoders or {})
        self.decoder = Decoder(decoders, self.decode.required)
        # Shared with DataLoader workers (persistent ones too), so set_epoch reaches them.
        self._clock = EpochClock()
        self._stats = StreamStats()
        self.plan()  # settings that cannot work fail here
        self._init_resume()

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
        storage = options.get("storage") or DEFAULT_STORAGE
        return cls(scan_shards(found, storage_options, threads=threads, config=storage), storage_options=storage_options,
                   **options)

    # -- epochs and plans ----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress (or the last one); before any pass, the one set."""
        return self._clock.current

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass follow epoch ``epoch`` (same on every rank); later passes go on from it."""
        self._clock.set(epoch)

    def plan(self, epoch: int | None = None, num_workers: int | None = None) -> EpochPlan | MixPlan:
        """The exact plan of an epoch for this topology (pure: no I/O).

        With ``steps`` the epoch is a data epoch (steps run through them back to back) and workers
        split the steps, not the epoch: the plan is made for one worker.
        """
        workers = num_workers or 0
        if self.steps is not None:
            if self.steps < workers:
                raise ConfigError(f"steps={self.steps} per rank but num_workers is {workers}: "
                                  f"{workers - self.steps} workers would have nothing to yield")
            workers = 0
        epoch = self.epoch if epoch is None else epoch
        if self.mix is not None:
            if self.mode != "drop":
                raise ConfigError(f"mode={self.mode!r} is for one dataset; a mix always drops the tail that "
                                  "cannot make equal batches (and reports it per source)")
            return self.mix.plan(world_size=self.world.world_size, num_workers=workers, batch_size=self.batch_size,
                                 seed=self.seed, epoch=epoch, shuffle=self.shuffle, per_batch=self.per_batch)
        plan = plan_epoch(
            self.counts, world_size=self.world.world_size, num_workers=workers,
            batch_size=self.batch_size, seed=self.seed, epoch=epoch, shuffle=self.shuffle, mode=self.mode,
            compressed_shards=int(self.manifest.compressed.sum()),
        )
        # A loaded state pending for this epoch: the summary also says how the epoch resumes
        # (exactly, or elastically with the leftover dropped or repeated).
        if num_workers is None and getattr(self, "_resume", None) is not None and plan.epoch == self.epoch:
            resume = self.resume_plan()
            if isinstance(resume, ResumePlan):
                plan = dataclasses.replace(plan, resumed=resume.summary())
        return plan

    def stats(self) -> dict[str, int]:
        """Counters summed over this rank's workers since construction (see ``stats.COUNTERS``)."""
        return self._stats.totals()

    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same on every rank and every epoch; ``steps`` if given)."""
        return self.steps if self.steps is not None else self.plan(num_workers=0).batches_per_rank

    # -- iteration (runs in each DataLoader worker) ---------------------------------------------
    def __iter__(self):
        worker, num_workers = current_worker()
        rank = self.world.rank
        self._clock.start_pass(worker, num_workers)  # self.epoch is this pass's from here on
        if self.steps is None:
            plan = self.plan(num_workers=num_workers)
            windows = [(plan, *plan.worker_slice(rank, worker))]
            num_batches = plan.worker_batches(worker)
        else:
            plan = self.plan(num_workers=num_workers)  # checks steps against num_workers
            first, num_batches = worker_steps(self.steps, num_workers, worker)
            windows = []
            for epoch, batch, count in step_windows(self.epoch * self.steps + first, num_batches, plan.batches_per_rank):
                p = plan if epoch == plan.epoch else self.plan(epoch=epoch, num_workers=num_workers)
                begin = rank * p.samples_per_rank + batch * self.batch_size
                windows.append((p, begin, begin + count * self.batch_size))
        if worker == 0 and rank == 0:
            logger.info("%s", plan.summary())
        for fn in (*self.decoder.decoders.values(), self.transform):
            if fn is not None and hasattr(fn, "bind"):  # seeded augmentation: reproducible per (epoch, rank, worker)
                fn.bind(self.epoch, rank, worker)
        counters = self._stats.counters(worker)
        counters.step(f"planning its share of epoch {plan.epoch} (rank {rank}, worker {worker} of {num_workers})")
        buffers = BufferPool()  # this pass's large member and batch buffers, reused once unreferenced
        policy = ErrorPolicy(self.on_error.policy, self.on_error.tolerance, counters)
        stats = BatchStats()
        resume = self.resume_plan(num_workers)
        samples: Iterator[list[dict[str, Any]]]
        if isinstance(resume, MixResumePlan):  # the rest of a saved mixed epoch (plan/mixresume.py)
            continued_mix = resume.worker(rank, worker)
            num_batches = continued_mix.num_batches
            sources = self._range_sources(counters, buffers)
            streams = continued_mix.samples(lambda i, rs: read_ranges(sources[i], rs, policy=policy))
            assert self.mix is not None
            samples = merge_sources(streams, continued_mix.pattern, self.mix.names)
        elif resume is not None:  # the rest of a saved epoch (plan/resume.py): buffer rebuilt, RNG restored
            source = self._range_source(self.manifest, self.storage_options, self.readahead_bytes, counters, buffers)
            continued = resume.worker(rank, worker)
            num_batches = continued.num_batches
            samples = continued.samples(resume.ids, lambda rs: read_scattered(source, rs, policy=policy))
        else:
            samples = itertools.chain.from_iterable(
                self._read(p, begin, end, rank, worker, counters, policy, buffers) for p, begin, end in windows
            )
        decoder, transform = _bind_per_sample(self.decoder, self.transform)
        samples = decode_samples(samples, decoder, policy)
        filtered = [0]
        if transform is not None:
            samples = transform_samples(samples, transform, counters, filtered, policy)
        batches = batch_samples(samples, batch_size=self.batch_size, num_batches=num_batches,
                                collate=self.collate, stats=stats, buffers=buffers) if num_batches else iter(())
        if get_worker_info() is None:
            batches = self._count_received(batches, plan.epoch, resume)
        else:
            self._workers_seen.value = num_workers
        for made, batch in enumerate(batches, 1):
            counters.step(f"made batch {made} of {num_batches} of epoch {plan.epoch}", batch=True)
            yield batch
        if policy.skipped or stats.refilled or filtered[0]:
            dropped = f" (and the transform dropped {filtered[0]})" if filtered[0] else ""
            logger.warning("rank %d worker %d epoch %d: skipped %d bad samples%s, repeated %d to keep batches equal",
                           rank, worker, plan.epoch, policy.skipped, dropped, stats.refilled)

    # -- resume (plan/resume.py): Stateful protocol -----------------------------------------------
    def _init_resume(self) -> None:
        self._resume: ResumeState | MixResumeState | None = None  # a loaded state, until its epoch's pass has run
        m = self.manifest  # from the columns: no ShardInfo per shard
        self._digest = dataset_digest(zip(m.paths, m.counts.tolist(), m.sizes.tolist(), (m.sha256(i) for i in range(len(m.paths)))))
        # Main-process iteration (num_workers=0, or a plain ``for batch in dataset``): [epoch, batches
        # received, the ResumePlan that pass followed or None]. Workers cannot see what the loop received.
        self._main_pass: list[Any] | None = None
        self._workers_seen = multiprocessing.RawValue("q", 0)  # DataLoader workers per rank, written by workers

    def resume_plan(self, num_workers: int | None = None) -> ResumePlan | MixResumePlan | None:
        """How the next pass continues a loaded state (None when it starts the epoch afresh): which
        samples remain and how they are split; ``.summary()`` says it in one line. Pure, no I/O."""
        if self._resume is None or self._resume.epoch != self.epoch or self.steps is not None:
            return None
        workers = num_workers if num_workers is not None else self._workers_seen.value
        if isinstance(self._resume, MixResumeState):
            self._resume.check(sources=self._mix_identity(), seed=self.seed, shuffle=self.shuffle,
                               per_batch=self.per_batch, topology=self._topology(workers))
            plan = self.plan(num_workers=workers)
            assert isinstance(plan, MixPlan)
            return MixResumePlan(plan, self._resume)
        return ResumePlan(self.counts.tolist(), self._resume, self._segment(workers))

    def _mix_identity(self) -> list[dict[str, Any]]:
        """What a mixed state names: each source's name, manifest digest, size and ask."""
        assert self.mix is not None
        return [{"name": name, "manifest": dataset_digest(zip(m.paths, m.counts.tolist(), m.sizes.tolist(), map(m.sha256, range(len(m.paths))))),
                 "samples": m.total_samples, "ask": source.ask().describe()}
                for name, source, m in zip(self.mix.names, self.mix.sources, self.mix.manifests)]

    def _topology(self, num_workers: int) -> tuple[int, int, int, int, int]:
        return (self.world.world_size, max(1, num_workers), self.batch_size, self.shuffle_buffer, self.shuffle_initial)

    def _segment(self, num_workers: int, batches: int = 0) -> Segment:
        return Segment(self.world.world_size, max(1, num_workers), self.batch_size, self.shuffle_buffer,
                       self.shuffle_initial, batches)

    def _state(self, received: int, resume: ResumePlan | MixResumePlan | None, num_workers: int) -> dict[str, Any]:
        """The state after ``received`` batches of the current pass of the current epoch."""
        if resume is not None:
            return resume.state_after(received).to_json()
        if self.mix is not None:
            return MixResumeState(tuple(self._mix_identity()), self.seed, self.shuffle, self.per_batch, self.epoch,
                                  self._topology(num_workers), received).to_json()
        return ResumeState(manifest=self._digest, samples=int(self.counts.sum()),
                           seed=self.seed, shuffle=self.shuffle, mode=self.mode, epoch=self.epoch,
                           segments=(self._segment(num_workers, received),)).to_json()

    def state_dict(self, batches: int | None = None) -> dict[str, Any]:
        """The data position as a small JSON-serialisable dict (torchdata's ``Stateful`` protocol).

        ``batches``: how many batches the training loop received in the current pass over this
        epoch (its step count within the epoch). Needed with your own DataLoader with workers:
        only the loop knows what it received (batches sitting in prefetch queues are not
        consumed). Without it, the count is that of iterating this dataset in the main process.
        Every rank receives the same count, so rank 0's state is enough for all ranks.
        ``make_loader``'s loader counts for you: prefer ``loader.state_dict()``.
        """
        workers = self._workers_seen.value
        if batches is None:
            if self._main_pass is not None and self._main_pass[0] == self.epoch:
                return self._state(self._main_pass[1], self._main_pass[2], workers)
            if self._workers_seen.value:
                raise ConfigError("this ShardStream was iterated in DataLoader workers, so it cannot know how many "
                                  "batches the training loop received: call state_dict(batches=STEPS_THIS_EPOCH), "
                                  "or use make_loader's loader.state_dict()")
            batches = 0
        if self._resume is not None and self._resume.epoch == self.epoch and batches == 0:
            return self._resume.to_json()
        return self._state(batches, self.resume_plan(workers), workers)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load_state(state, None)

    def _load_state(self, state: Mapping[str, Any], num_workers: int | None) -> None:
        """Continue from ``state`` (from ``state_dict``): the next pass over its epoch delivers the
        rest of that epoch. Same topology: exactly the batches an uninterrupted run would have
        delivered, in order. Another world size, worker count, batch size or shuffle buffer: every
        sample not yet consumed, once (pad mode: at least once), in equal batches per rank. Sets
        the epoch to the state's. Raises StateError for a state of another dataset, seed, shuffle,
        mode or version. Load it before the DataLoader starts its (persistent) workers."""
        if self.steps is not None:
            raise ConfigError("resuming a stream defined by steps= is not supported yet: "
                              "checkpoint at loader epoch boundaries (set_epoch) for those")
        if self.mix is not None:  # exact resume on the same topology (plan/mixresume.py)
            mixed = MixResumeState.from_json(dict(state))
            mixed.check(sources=self._mix_identity(), seed=self.seed, shuffle=self.shuffle, per_batch=self.per_batch,
                        topology=mixed.topology if num_workers is None else self._topology(num_workers))
            self._resume = mixed
            self._main_pass = None
            self.set_epoch(mixed.epoch)
            return
        loaded = ResumeState.from_json(dict(state))
        loaded.check(manifest=self._digest, samples=int(self.counts.sum()), seed=self.seed, shuffle=self.shuffle, mode=self.mode)
        self._resume = loaded
        self._main_pass = None
        self.set_epoch(loaded.epoch)

    def _count_received(self, batches, epoch: int, resume: ResumePlan | MixResumePlan | None):
        """Main-process iteration: count what the consumer received; a finished resumed pass is done."""
        record: list[Any] = [epoch, 0, resume]
        self._main_pass = record
        for batch in batches:
            record[1] += 1
            yield batch
        if resume is not None:
            self._resume = None
            record[1], record[2] = len(self), None  # the epoch is complete under this topology

    def _read(self, plan: EpochPlan | MixPlan, begin: int, end: int, rank: int, worker: int, counters: Any,
              policy: ErrorPolicy, buffers: BufferPool | None = None):
        """Samples of positions [begin, end) of an epoch's sequence, shuffled (per source in a mix)."""
        def shuffled(samples, rng: random.Random):
            if self.shuffle_buffer <= 1:
                return samples
            return shuffle_samples(samples, buffer_size=self.shuffle_buffer, initial=self.shuffle_initial, rng=rng)

        if isinstance(plan, EpochPlan):
            source = self._range_source(self.manifest, self.storage_options, self.readahead_bytes, counters, buffers)
            samples = read_ranges(source, plan.ranges_between(begin, end, self.counts), policy=policy)
            yield from shuffled(samples, worker_rng(self.seed, plan.epoch, rank, worker))
            return
        assert self.mix is not None
        ranges, pattern = plan.reads(begin, end)
        streams = [shuffled(read_ranges(source, ranges[i], policy=policy), source_rng(self.seed, plan.epoch, rank, worker, i))
                   for i, source in enumerate(self._range_sources(counters, buffers))]
        yield from merge_sources(streams, pattern, self.mix.names)

    def _range_sources(self, counters: Any, buffers: BufferPool | None = None) -> list[RangeSource]:
        """Where each source of a mix is read from (its own storage options and read-ahead)."""
        assert self.mix is not None
        return [self._range_source(manifest, self.mix.storage_options[i], self.readahead[i], counters, buffers)
                for i, manifest in enumerate(self.mix.manifests)]

    def _range_source(self, manifest: Manifest, storage_options: Any, readahead: int, counters: Any,
                      buffers: BufferPool | None = None) -> RangeSource:
        return RangeSource(manifest, storage_options=storage_options, read_size=self.read.read_size, counters=counters,
                           cache=self.cache, readahead_bytes=readahead, verify_stream=self.read.verify_stream,
                           config=self.storage, keep_buffers=self.decoder.viewing_exts(), buffers=buffers,
                           readahead_threads=self.read.readahead_threads)

    # -- pickling (DataLoader spawn, copies) ----------------------------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None:
            state["_workers_seen"] = _Plain(self._workers_seen.value)
        state["_main_pass"] = None
        return state


class _Plain:
    """A RawValue stand-in for plain (non-spawn) copies."""

    def __init__(self, value: int):
        self.value = value


def _bind_per_sample(decoder: Callable[[dict], dict], transform: Callable[[dict], dict] | None):
    """Decoders and transforms with ``bind_sample(name)`` (seeded augmentation) get the sample's
    name before each call, so their randomness is a function of (seed, epoch, sample): the same
    after a resume and under any topology."""
    keyed = [fn for fn in getattr(decoder, "decoders", {}).values() if hasattr(fn, "bind_sample")]
    if keyed:
        inner = decoder

        def decoder(sample: dict) -> dict:
            name = sample_name(sample)
            for fn in keyed:
                fn.bind_sample(name)
            return inner(sample)

    if transform is not None and hasattr(transform, "bind_sample"):
        bound, plain = transform, transform

        def transform(sample: dict) -> dict:
            bound.bind_sample(sample_name(sample))
            return plain(sample)

    return decoder, transform


def sample_name(sample: Mapping[str, Any]) -> str:
    """Shard file name and key: the same wherever the dataset is stored."""
    url = str(sample.get("__url__", ""))
    return f"{url.rsplit('/', 1)[-1]}/{sample.get('__key__', '')}"


def transform_samples(chunks, transform, counters, filtered: list[int], policy: ErrorPolicy):
    """Apply the user's transform to lists of samples; a None result drops the sample (counted).
    A transform that raises fails its sample under the user's policy, as a decode error does: a
    SampleError naming the shard and key, raised, or skipped, counted and logged (``policy``, with
    its tolerance of consecutive failures counted across chunks here)."""
    from shardstream.errors import SampleError

    run = 0  # consecutive samples whose transform failed
    for chunk in chunks:
        out = []
        for x in chunk:
            url, key = x.get("__url__", "?"), x.get("__key__", "?")  # before the transform changes the sample
            try:
                out.append(transform(x))
            except Exception as exc:  # noqa: BLE001 - the user's transform: its failure goes to the error policy, named
                error = exc if isinstance(exc, SampleError) else SampleError(url, key, f"transform failed: {type(exc).__name__}: {exc}")
                if error is not exc:
                    error.__cause__ = exc  # raise ... from exc
                run += 1
                policy.failed(error, consecutive=run)
                continue
            run = 0
        kept = [y for y in out if y is not None]
        if len(kept) != len(out):
            counters.add("samples_filtered", len(out) - len(kept))
            filtered[0] += len(out) - len(kept)
        if kept:
            yield kept
