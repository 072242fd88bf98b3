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

import itertools
import logging
import multiprocessing
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info

from shardstream.errors import ConfigError
from shardstream.format.manifest import Manifest, load_manifest
from shardstream.format.tar import DEFAULT_READ_SIZE
from shardstream.mixing import Mix, Source, open_mix
from shardstream.pipeline.batch import BatchStats, batch_samples, default_collate, pack_for_transport
from shardstream.pipeline.decode import Decoder, decode_samples, default_decoders
from shardstream.pipeline.mix import merge_sources
from shardstream.pipeline.read import RangeSource, read_ranges
from shardstream.pipeline.shuffle import shuffle_samples, worker_rng
from shardstream.plan.epoch import EpochPlan, plan_epoch
from shardstream.plan.mix import MixPlan
from shardstream.plan.resume import ResumePlan, ResumeState, Segment, dataset_digest
from shardstream.plan.steps import step_windows, worker_steps
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


def _remote(manifest: Manifest) -> bool:
    first = manifest.shard_url(0) if manifest.shards else ""
    return "://" in first and not first.startswith("file://")


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
    sample appears at least once. Call ``set_epoch(e)`` before each epoch for a new order.
    """

    def __init__(
        self,
        source: str | Sequence[str] | Manifest | Source | Sequence[Source],
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
        per_batch: str = "spread",
        steps: int | None = None,
        samples_per_epoch: int | None = None,
    ):
        super().__init__()
        self.storage_options = dict(storage_options or {})
        # A mix (Source values or a mix file) holds one manifest per source; self.manifest is the first.
        self.mix: Mix | None = open_mix(source, self.storage_options, resolve_manifest)
        if self.mix is None:
            self.manifest = resolve_manifest(source, self.storage_options)  # type: ignore[arg-type]
        else:
            self.manifest = self.mix.manifests[0]
        self.per_batch = per_batch
        self.counts = self.manifest.counts  # int64 array, one entry per shard: all that planning needs
        self.world = World.detect(rank, world_size)
        self.steps = _steps(steps, samples_per_epoch, self.world.world_size * batch_size)
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
        manifests = [self.manifest] if self.mix is None else self.mix.manifests
        # Read-ahead pays where storage has latency; on local disk the page cache already reads ahead.
        self.readahead = [readahead_bytes if readahead_bytes is not None else (DEFAULT_READAHEAD if _remote(m) else 0)
                          for m in manifests]
        self.readahead_bytes = self.readahead[0]
        self.cache = None
        if cache_dir is not None:
            if cache_limit is None:
                raise ConfigError("cache_dir needs cache_limit (bytes of local disk the cache may use)")
            self.cache = ShardCache(cache_dir, cache_limit, verify=verify_checksums)
            for m in manifests:
                if len(m.sizes):
                    largest = int(m.sizes.argmax())
                    self.cache.check_fits(int(m.sizes[largest]), m.shard_url(largest))
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
        self._init_resume()

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

    def plan(self, epoch: int | None = None, num_workers: int | None = None) -> EpochPlan | MixPlan:
        """The exact plan of an epoch for this topology (pure: no I/O).

        With ``steps`` the epoch is a data epoch (steps run through them back to back) and workers
        split the steps, not the epoch: the plan is made for one worker.
        """
        workers = num_workers if num_workers is not None else (self.num_workers or 0)
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
        return plan_epoch(
            self.counts, world_size=self.world.world_size, num_workers=workers,
            batch_size=self.batch_size, seed=self.seed, epoch=epoch, shuffle=self.shuffle, mode=self.mode,
            compressed_shards=int(self.manifest.compressed.sum()),
        )

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
        policy = ErrorPolicy(self.on_error, self.error_tolerance, counters)
        stats = BatchStats()
        resume = self.resume_plan(num_workers)
        samples: Iterator[list[dict[str, Any]]]
        if resume is not None:  # the rest of a saved epoch (plan/resume.py): buffer rebuilt, RNG restored
            source = RangeSource(self.manifest, storage_options=self.storage_options, read_size=self.read_size,
                                 counters=counters, cache=self.cache, readahead_bytes=self.readahead_bytes,
                                 verify_stream=self.verify_stream)
            continued = resume.worker(rank, worker)
            num_batches = continued.num_batches
            samples = continued.samples(resume.ids, lambda rs: read_ranges(source, rs, policy=policy))
        else:
            samples = itertools.chain.from_iterable(
                self._read(p, begin, end, rank, worker, counters, policy) for p, begin, end in windows
            )
        decoder, transform = _bind_per_sample(self.decoder, self.transform)
        samples = decode_samples(samples, decoder, policy)
        if transform is not None:
            samples = ([transform(x) for x in chunk] for chunk in samples)
        batches = batch_samples(samples, batch_size=self.batch_size, num_batches=num_batches,
                                collate=self.collate, stats=stats) if num_batches else iter(())
        if self.inline_transport and get_worker_info() is not None:
            batches = map(pack_for_transport, batches)
        if get_worker_info() is None:
            batches = self._count_received(batches, plan.epoch, resume)
        else:
            self._workers_seen.value = num_workers
        yield from batches
        if policy.skipped or stats.refilled:
            logger.warning("rank %d worker %d epoch %d: skipped %d bad samples, repeated %d to keep batches equal",
                           rank, worker, plan.epoch, policy.skipped, stats.refilled)

    # -- resume (plan/resume.py): Stateful protocol -----------------------------------------------
    def _init_resume(self) -> None:
        self._resume: ResumeState | None = None  # a loaded state, until its epoch's pass has run
        m = self.manifest  # from the columns: no ShardInfo per shard
        self._digest = dataset_digest(zip(m.paths, m.counts.tolist(), m.sizes.tolist(), (m.sha256(i) for i in range(len(m.paths)))))
        # Main-process iteration (num_workers=0, or a plain ``for batch in dataset``): [epoch, batches
        # received, the ResumePlan that pass followed or None]. Workers cannot see what the loop received.
        self._main_pass: list[Any] | None = None
        self._workers_seen = multiprocessing.RawValue("q", 0)  # DataLoader workers per rank, written by workers

    def resume_plan(self, num_workers: int | None = None) -> ResumePlan | None:
        """How the next pass continues a loaded state (None when it starts the epoch afresh): which
        samples remain and how they are split; ``.summary()`` says it in one line. Pure, no I/O."""
        if self._resume is None or self._resume.epoch != self.epoch or self.mix is not None or self.steps is not None:
            return None
        workers = num_workers if num_workers is not None else (self.num_workers or self._workers_seen.value)
        return ResumePlan(self.counts.tolist(), self._resume, self._segment(workers))

    def _segment(self, num_workers: int, batches: int = 0) -> Segment:
        return Segment(self.world.world_size, max(1, num_workers), self.batch_size, self.shuffle_buffer,
                       self.shuffle_initial, batches)

    def _state(self, received: int, resume: ResumePlan | None, num_workers: int) -> dict[str, Any]:
        """The state after ``received`` batches of the current pass of the current epoch."""
        if resume is not None:
            return resume.state_after(received).to_json()
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
        workers = self.num_workers if self.num_workers is not None else self._workers_seen.value
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
        """Continue from ``state`` (from ``state_dict``): the next pass over its epoch delivers the
        rest of that epoch. Same topology: exactly the batches an uninterrupted run would have
        delivered, in order. Another world size, worker count, batch size or shuffle buffer: every
        sample not yet consumed, once (pad mode: at least once), in equal batches per rank. Sets
        the epoch to the state's. Raises StateError for a state of another dataset, seed, shuffle,
        mode or version. Load it before the DataLoader starts its (persistent) workers."""
        if self.mix is not None or self.steps is not None:
            raise ConfigError("resuming a mixed stream or a stream defined by steps= is not supported yet: "
                              "checkpoint at epoch boundaries (set_epoch) for those")
        loaded = ResumeState.from_json(dict(state))
        loaded.check(manifest=self._digest, samples=int(self.counts.sum()), seed=self.seed, shuffle=self.shuffle, mode=self.mode)
        self._resume = loaded
        self._main_pass = None
        self.set_epoch(loaded.epoch)

    def _count_received(self, batches, epoch: int, resume: ResumePlan | None):
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
              policy: ErrorPolicy):
        """Samples of positions [begin, end) of an epoch's sequence, shuffled (per source in a mix)."""
        def shuffled(samples, rng: random.Random):
            if self.shuffle_buffer <= 1:
                return samples
            return shuffle_samples(samples, buffer_size=self.shuffle_buffer, initial=self.shuffle_initial, rng=rng)

        if isinstance(plan, EpochPlan):
            source = RangeSource(self.manifest, storage_options=self.storage_options, read_size=self.read_size,
                                 counters=counters, cache=self.cache, readahead_bytes=self.readahead_bytes,
                                 verify_stream=self.verify_stream)
            samples = read_ranges(source, plan.ranges_between(begin, end, self.counts), policy=policy)
            yield from shuffled(samples, worker_rng(self.seed, plan.epoch, rank, worker))
            return
        assert self.mix is not None
        ranges, pattern = plan.reads(begin, end)
        streams = []
        for i, manifest in enumerate(self.mix.manifests):
            source = RangeSource(manifest, storage_options=self.mix.storage_options[i], read_size=self.read_size,
                                 counters=counters, cache=self.cache, readahead_bytes=self.readahead[i],
                                 verify_stream=self.verify_stream)
            rng = random.Random(f"shardstream:{self.seed}:{plan.epoch}:{rank}:{worker}:source{i}")
            streams.append(shuffled(read_ranges(source, ranges[i], policy=policy), rng))
        yield from merge_sources(streams, pattern, self.mix.names)

    # -- pickling (DataLoader spawn, copies) ----------------------------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None and not isinstance(self._epoch, int):
            state["_epoch"] = self._epoch.value  # plain copies cannot share the counter
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
