"""ShardStream: the IterableDataset users import. It wires the stages together, in order:

    sources (one dataset, or a mix) -> RunPlan: pass plan -> (rank, worker) windows
        -> read_ranges per source -> shuffle (continued where a resumed pass stood) -> merge_sources
        -> decode_samples -> transform -> batch_samples -> batches

Between read_ranges and batch_samples, samples travel as lists (one per read block). What each
(rank, worker) reads in a pass, for one dataset or a mix, by epochs or by steps, fresh or resumed
(exactly or elastically), is ``plan/run.py``'s answer; this class holds the settings, the epoch
clock and a loaded state, and asks it. Its position in this process is one ``Place``
(plan/cursor.py): the cursor of the pass it iterates (in a worker, its own share, each batch
handed over with its origin) and how a loaded state reached it. Under make_loader the main
process opens each pass (``open_pass``) and every worker checks its plan against it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardstream.buffers import BufferPool
from shardstream.clock import EpochClock
from shardstream.errors import ConfigError, StateError
from shardstream.format.manifest import Manifest
from shardstream.format.parquet import Table, TableManifest, is_table_url
from shardstream.format.scan import scan_shards
from shardstream.format.tokens import TokenManifest, Tokens
from shardstream.handover import read_once
from shardstream.options import Decode, OnError, Schedule, Shuffle, Store, refuse_moved
from shardstream.pipeline.batch import BatchStats, batch_samples, default_collate
from shardstream.pipeline.decode import Decoder, decode_samples, default_decoders
from shardstream.pipeline.interleave import read_planned
from shardstream.pipeline.read import PlannedReads, RangeSource, read_ranges, read_scattered
from shardstream.pipeline.table import (
    Batched,
    Blocks,
    HFImage,
    PlannedGroups,
    TableSource,
    batch_refs,
    columnar_batch,
    image_columns,
    table_refs,
    table_rows,
)
from shardstream.pipeline.tokens import MAX_SOURCES, TokenReader
from shardstream.pipeline.transform import bind_per_sample, transform_samples
from shardstream.plan.cursor import Cursor, Origin, Place
from shardstream.plan.epoch import EpochPlan, check_seed
from shardstream.plan.mix import MixPlan
from shardstream.plan.requests import with_requests
from shardstream.plan.run import PassPlan, RunPlan, RunSettings
from shardstream.plan.state import State, furthest
from shardstream.plan.topology import World, current_worker, get_worker_info
from shardstream.policy import ErrorPolicy
from shardstream.portable import reduce_portable
from shardstream.redact import get_logger
from shardstream.sources import Mix, Source, open_sources, plan_sources, source_transforms
from shardstream.stats import StreamStats
from shardstream.storage.cache import ShardCache
from shardstream.storage.readahead import Budget
from shardstream.storage.urls import expand_urls

logger = get_logger(__name__)
# What plan().summary() adds to its worker count before make_loader has said how many there are.
WORKERS_UNKNOWN = " (assumed: the worker count is not known yet; make_loader(num_workers=...) sets it, or pass plan(num_workers=...))"


def _planned(source: Any, part: Any, i: int) -> PlannedReads | PlannedGroups:
    """Source i's read-ahead over a worker's whole pass (``part``): its planned ranges of every
    window, so fetching runs on from one window into the next (tar: ``PlannedReads``; a table:
    ``PlannedGroups``, its windows' row groups)."""
    if isinstance(source, TableSource):
        return PlannedGroups(source, [window.sources[i].ranges for window in part.windows])
    return PlannedReads(source, [r for window in part.windows for r in window.sources[i].ranges])


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

    Parquet tables (``Table(url, columns=[...])``, a ``.parquet`` URL or glob, a folder of them)
    stream the same way, a row group planned as a shard and a row as a sample; when every source
    is a table and no per-sample transform is given, batches are columnar (a tensor per numeric
    column), and ``transform=Batched(fn)`` hands ``fn`` each whole batch as a ``pyarrow.Table``
    (docs/tables.md).

    The common options are keywords; rare ones come grouped as small frozen values documented in
    ``shardstream.options``: ``shuffle=Shuffle(buffer, initial, documents)``, ``decode=Decode(...)``,
    ``on_error=OnError(policy, tolerance)``, ``store=Store(options, config, read, cache)`` (where
    the shards are and how they are read), ``schedule=Schedule(steps, samples_per_epoch, tokens,
    per_batch)`` (a pass's length, a mix's interleave) and ``world=World(rank, world_size)``
    (default: detected, see ``World.detect``).
    """

    def __init__(
        self,
        source: str | Manifest | Table | Tokens | Source | Sequence[Source],
        *,
        batch_size: int,
        shuffle: bool | Shuffle = True,
        seed: int = 0,
        decode: bool | Mapping[str, Callable[[bytes], Any]] | Decode = True,
        transform: Callable[[dict[str, Any]], Any] | Batched | None = None,
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
        seed = check_seed(seed)  # any integer (a numpy one kept as an int, for the JSON state); ConfigError otherwise
        self.store, self.schedule = store or Store(), schedule or Schedule()
        self.storage_options = dict(self.store.options or {})  # the stream's; a mix's Source may give its own
        self.storage, self.read = self.store.config, self.store.read
        # A single dataset is a mix of one. Under a process group rank 0 reads it and hands it over (handover.py).
        self.sources: Mix = read_once(lambda: open_sources(source, self.storage_options, self.storage), world)
        self.manifest = self.sources.manifests[0]
        self.counts = self.manifest.counts  # int64 array, one entry per shard: all that planning needs
        self.world = world if world is not None else World.detect()
        self.batch_size, self.seed, self.mode = batch_size, seed, mode
        # None: no shuffling at all (shards in manifest order, no buffer).
        self.shuffler: Shuffle | None = (Shuffle() if shuffle is True else shuffle) if shuffle is not False else None
        self.shuffle = self.shuffler is not None
        # Batched(fn): fn takes whole columnar batches of Parquet tables (pipeline/table.py), not samples.
        self.batch_transform = transform if isinstance(transform, Batched) else None
        self.transform = None if isinstance(transform, Batched) else transform
        self.collate = collate or default_collate
        self._transform = source_transforms(self.sources, self.transform)  # a mix's per-source transforms, then this one
        self.on_error = OnError.of(on_error)
        manifests = self.sources.manifests
        # The documented default (options.Read): read-ahead where any shard is on remote storage.
        self.readahead = [self.read.readahead_for(m.shard_url(i) for i in range(len(m.shards))) for m in manifests]
        self.readahead_bytes = self.readahead[0]
        self.cache = self._open_cache(manifests)
        self.decode = Decode.of(decode)
        decoders = default_decoders(self.decode.image, self.decode.draft_size, size=self.decode.size) if self.decode.defaults else {}
        decoders.update(self.decode.decoders or {})
        self.tables = [m for m in manifests if isinstance(m, TableManifest)]
        self._images: dict[str, HFImage] = {}  # Hugging Face image columns, decoded like image fields
        if self.decode.defaults and self.tables:
            image = decoders.get("png")
            self._images = {name: HFImage(image) for m in self.tables for name in image_columns(m)} if image is not None else {}
            decoders.update({name: fn for name, fn in self._images.items() if name not in decoders})
        self.decoder = Decoder(decoders, self.decode.required, self.decode.alias)
        # Columnar batches (pipeline/table.py): every source a table of one schema, no per-sample transform.
        schemas = {tuple(m.columns if m.projection is None else [c for c in m.columns if c[0] in m.projection]) for m in self.tables}
        # Work done on each sample between the read and the batch: a transform, or decoders of the user's.
        self.per_sample = self._transform is not None or bool(self.decode.decoders or self.decode.required or self.decode.alias)
        self.columnar = len(self.tables) == len(manifests) and len(schemas) == 1 and not self.per_sample
        # Batches that are the samples as stored (no decoding, transform or collate of the user's:
        # nothing between the read and the batch sees a field), which a worker process hands over as read.
        self.as_stored = not (self.per_sample or self.decode.defaults or not batch_size or self.tables or self.collate is not default_collate)
        self.tokens = self._check_tokens(manifests, mode)  # token corpora: batches of sequences (pipeline/tokens.py)
        # Shuffle(documents=True): each shard's documents in an order of (seed, epoch, source, shard), token corpora only.
        self.documents = self.shuffler is not None and self.shuffler.documents
        if self.documents and not self.tokens:
            raise ConfigError(
                "Shuffle(documents=True) lays a token corpus's documents in a new order every epoch: the sources must be "
                "Tokens(...) corpora; other datasets shuffle samples with Shuffle(buffer)"
            )
        if self.batch_transform is not None and not self.columnar:
            raise ConfigError(
                "transform=Batched(fn) takes whole columnar batches: every source must be a Parquet table (of one schema), "
                "with no Decode(decoders=..., required=...)"
            )
        tokens = self.schedule.tokens  # Schedule(tokens=T): samples_per_epoch of T // seq_len sequences
        if tokens is not None and not self.tokens:
            raise ConfigError("Schedule(tokens=...) counts a run in tokens: the sources must be Tokens(...) corpora; use Schedule(steps=N) otherwise")
        seq_len = self.sources.manifests[0].seq_len if tokens is not None else 0  # type: ignore[attr-defined]  # (checked: token corpora)
        self._run = RunPlan(
            plan_sources(self.sources, documents=self.documents),
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
                samples_per_epoch=tokens // seq_len if tokens is not None else self.schedule.samples_per_epoch,
                tokens=tokens,
                seq_len=seq_len,
            ),
        )
        self._loaded: State | None = None  # a loaded state: its pass continues it (a run by steps goes on from it)
        # This process's own position (plan/cursor.py): the pass it iterates and the batches it
        # yielded (in a worker, its own share), and how the loaded state reached it.
        self._place = Place()
        # Large member and batch buffers, reused once unreferenced, pass after pass: shared by the
        # thread workers' views; a worker process's copy starts its own (buffers.py).
        self._buffers = BufferPool()
        # Shared with DataLoader workers (persistent ones too), so set_epoch and a loaded state reach them.
        self._clock = EpochClock()
        self._stats = StreamStats()

    def __reduce__(self) -> Any:
        # Pickled for workers that are not forked: the user's functions by value where a worker
        # could not import them (a notebook's, a lambda, a closure: portable.py).
        return reduce_portable(self)

    def thread_view(self) -> ShardStream:
        """A view of this dataset for one thread worker (loader/threads.py): the same plan, epoch
        clock, counters, storage and cache; its own place in a pass, and its own copies of the
        decoders and transform where they carry state (a seeded augmentation's ``bind``)."""
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view._place = Place()
        view._place.loader_workers = self._place.loader_workers
        view._place.own_state = self._place.own_state
        for name in ("decoder", "_transform"):
            try:
                setattr(view, name, copy.deepcopy(getattr(self, name)))
            except Exception:  # noqa: BLE001 - what cannot be copied is shared (a stateless function is)
                pass
        return view

    def _check_tokens(self, manifests: Sequence[Manifest], mode: str) -> bool:
        """Whether the sources are token corpora (``Tokens``): all of them or none, of one
        ``seq_len``, in drop mode, with no per-sample work (a batch is cut from their tokens whole)."""
        corpora = [m for m in manifests if isinstance(m, TokenManifest)]
        if not corpora:
            return False
        if len(corpora) != len(manifests):
            raise ConfigError("a mix with Tokens sources takes Tokens sources only: every source a token corpus of one seq_len")
        if len(corpora) > MAX_SOURCES:
            raise ConfigError(f"a mix of token corpora takes at most {MAX_SOURCES} sources, got {len(corpora)}")
        if len({m.seq_len for m in corpora}) > 1:
            raise ConfigError(f"the Tokens sources of a mix need one seq_len, got {sorted({m.seq_len for m in corpora})}")
        if len({m.boundaries for m in corpora}) > 1:  # one batch's rows come from several sources: one set of keys
            raise ConfigError(f"the Tokens sources of a mix need one boundaries=, got {sorted({repr(m.boundaries) for m in corpora})}")
        if mode != "drop":
            raise ConfigError(f'Tokens sources stream in mode="drop" (no token is used twice in an epoch), got mode={mode!r}')
        if self.per_sample or self.batch_transform is not None:
            raise ConfigError("Tokens sources yield whole batches of sequences: no transform= or Decode(...) applies; map the batch in your loop")
        return True

    def _open_cache(self, manifests: Sequence[Manifest]) -> ShardCache | None:
        cache = self.store.cache
        if cache is None:
            return None
        opened = ShardCache(cache.dir, cache.limit, verify=cache.verify)
        for m in manifests:
            # the smallest shard, and every one too large to cache (numpy, not a loop); a table's
            # shards are its row groups, each cached as its projected columns' runs
            if len(m.sizes):
                picks = {int(m.sizes.argmin()), *(int(i) for i in np.flatnonzero(m.sizes > opened.limit))}
                opened.check_fits([(int(m.sizes[i]), m.shard_url(i)) for i in sorted(picks)])
        return opened

    @property
    def loader_workers(self) -> int | None:
        """The workers of the loader ``make_loader`` built over this dataset (what ``plan()`` assumes)."""
        return self._place.loader_workers

    @loader_workers.setter
    def loader_workers(self, workers: int | None) -> None:
        self._place.loader_workers = workers

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
        if patterns and all(is_table_url(p) for p in patterns):  # Parquet files: their footers are enough (format/parquet.py)
            return cls(Table(urls), store=store, **options)
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
        self._place.cursor = None

    def _workers(self) -> int:
        """Workers per rank a plan assumes when not told: in a DataLoader worker, its loader's; in
        a pass, the pass's; between passes, those of the loader make_loader built, else the last pass's."""
        info = get_worker_info()
        if info is not None:
            return info.num_workers
        return self._clock.workers if self._clock.started or self.loader_workers is None else self.loader_workers

    def plan(self, epoch: int | None = None, num_workers: int | None = None) -> EpochPlan | MixPlan:
        """The exact plan of a data epoch for this topology (pure: no I/O); ``num_workers`` is
        checked (ConfigError when some worker would have nothing to yield). A run by steps crosses
        data epochs: workers split each pass, the plan is the data epoch's. Without
        ``num_workers``: the workers of the loader ``make_loader`` built over this dataset (else
        as many as the last pass had); with a loaded state waiting for this epoch, the summary
        also says how the next pass resumes."""
        plan = self._run.report(self.epoch if epoch is None else epoch, num_workers, self._workers())
        if self.tokens:
            plan = dataclasses.replace(plan, tokens=self._token_note(plan))
        else:  # (a token corpus's samples are sequences, not the members the request count is of)
            plan = with_requests(plan, self.sources.manifests)  # remote data: the summary says the GETs it makes (plan/requests.py; a table's too)
        if num_workers is None and self._workers_unknown():
            plan = dataclasses.replace(plan, workers_note=WORKERS_UNKNOWN)
        resume = self.resume_plan() if num_workers is None and epoch in (None, self.epoch) else None
        return dataclasses.replace(plan, resumed=resume.summary()) if resume is not None else plan

    def _workers_unknown(self) -> bool:
        """Whether the worker count a plan assumes is a guess: no loader built over this dataset,
        no pass run yet, not in a worker."""
        return get_worker_info() is None and not self._clock.started and self.loader_workers is None

    def _token_note(self, plan: EpochPlan | MixPlan) -> str:
        """What a plan of token corpora means in tokens: used, dropped, left over past the last sequence."""
        corpora: list[TokenManifest] = self.sources.manifests  # type: ignore[assignment]  # (checked: every source is one)
        width = corpora[0].window
        total = sum(int(m.token_starts[-1]) for m in corpora)
        left = sum(m.left_over for m in corpora)
        used = plan.world_size * plan.batches_per_rank * plan.batch_size
        return (
            f"tokens: {total} in {sum(m.sequences for m in corpora)} sequences of {width} (seq_len {width - 1}); "
            f"{used * width} tokens per epoch ({used} sequences), {plan.dropped * width} dropped with the "
            f"{plan.dropped} sequences left out, {left} after the last whole sequence"
        )

    def check_workers(self, num_workers: int) -> None:
        """Raise ConfigError, naming the numbers, where ``num_workers`` workers per rank cannot
        work (some would have nothing to yield): what ``plan(num_workers=...)`` checks, without
        planning the epoch's shard order."""
        self._run.check_workers(num_workers)

    def pass_plan(self, num_workers: int | None = None) -> PassPlan:
        """How the next pass runs with ``num_workers`` workers per rank (default: those of the
        loader make_loader built, else as many as the last pass had): what every (rank, worker)
        reads, and the state after n batches of it."""
        workers = self._workers() if num_workers is None else num_workers
        return self._run.pass_plan(self._clock.upcoming, workers, self._loaded, self._clock.upcoming_resumed)

    def open_pass(self, num_workers: int) -> Cursor:
        """In the main process, as its loader's pass starts: the pass planned once, announced to
        the workers (they join it and check their plan against it), and the loop's cursor over it."""
        cursor = Cursor(self.pass_plan(num_workers))
        epoch, _ = self._clock.announce(max(1, num_workers), cursor.id)
        assert epoch == cursor.plan.loader_epoch
        return cursor

    def close_pass(self, cursor: Cursor) -> None:
        """The loop's pass over ``cursor`` is over (or abandoned): workers recognise passes again."""
        self._clock.close(cursor.id)

    def origin(self) -> Origin | None:
        """Where the batch this process's pass handed over last came from (None before one)."""
        cursor = self._place.cursor
        return cursor.last if cursor is not None else None

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
        share_over = self._place.begin()  # until its pass starts, this process's state is that pass's start
        return self._iterate(share_over)

    def _iterate(self, share_over: bool = False):
        if share_over and not (self._clock.upcoming_resumed or self._clock.current_resumed):
            # Every worker's share was over (none waits for the pass, none runs it): this is the
            # iterator StatefulDataLoader made over a finished pass and drops; it starts no pass.
            return
        worker, num_workers = current_worker()
        rank = self.world.rank
        epoch, resumed, announced = self._clock.start_pass(worker, num_workers)  # self.epoch is this pass's from here on
        plan = self._run.pass_plan(epoch, num_workers, self._loaded, resumed)
        # The DataLoader slot this worker fills: its own, or (StatefulDataLoader's own resume) the
        # one that has it go on with its own batches.
        slot = (worker - plan.received) % num_workers if resumed and self._place.own_state else worker
        part = plan.worker(rank, slot)
        cursor = self._place.cursor = Cursor(plan, slot, num_workers, worker)
        if announced and cursor.id != announced:
            raise StateError(
                f"rank {rank} worker {worker} planned loader epoch {epoch} as {cursor.id:016x}, but the main process "
                f"planned that pass as {announced:016x}: this worker's copy of the dataset differs from the main "
                "process's (changed after the workers started?); it reads nothing rather than other data"
            )
        if worker == 0 and rank == 0:
            logger.info("%s", plan.summary())
        for fn in (*self.decoder.decoders.values(), self._transform):
            if fn is not None and hasattr(fn, "bind"):  # seeded augmentation: reproducible per (epoch, rank, worker)
                fn.bind(epoch, rank, worker)
        counters = self._stats.counters(worker)
        counters.step(f"planning its share of epoch {epoch} (rank {rank}, worker {worker} of {num_workers})")
        buffers = self._buffers
        policy = ErrorPolicy(self.on_error.policy, self.on_error.tolerance, counters)
        stats = BatchStats()
        if self.tokens:
            yield from self._token_batches(part, epoch, counters, policy, stats, cursor)
            return
        if self.columnar:
            yield from self._columnar(part, epoch, counters, policy, stats, cursor)
            return
        # One read-ahead budget for the worker (Read(readahead_bytes) is the whole worker's, not a
        # source's), and per source one Prefetcher over its ranges of every window of the pass.
        budget = Budget(max(self.readahead), counters) if max(self.readahead) > 0 else None
        sources = [self._range_source(i, counters, buffers, budget) for i in range(len(self.sources.manifests))]
        planned = [_planned(source, part, i) for i, source in enumerate(sources)]
        try:
            yield from self._rows(part, epoch, worker, counters, policy, stats, cursor, buffers, sources, planned)
        finally:
            for reads in planned:
                reads.close()

    def _rows(
        self,
        part: Any,
        epoch: int,
        worker: int,
        counters: Any,
        policy: ErrorPolicy,
        stats: BatchStats,
        cursor: Cursor,
        buffers: BufferPool,
        sources: list[Any],
        planned: list[Any],
    ) -> Any:
        """A pass of per-sample batches: read (through ``planned``'s read-ahead), decode,
        transform, batch."""
        rank = self.world.rank

        def read(i: int, ranges: list[Any]) -> Any:
            source = sources[i]
            if isinstance(source, TableSource):
                return table_rows(source, ranges, policy=policy, planned=planned[i])
            return read_ranges(source, ranges, policy=policy, planned=planned[i])

        def read_back(i: int, ranges: list[Any]) -> Any:
            source = sources[i]
            return table_rows(source, ranges, policy=policy) if isinstance(source, TableSource) else read_scattered(source, ranges, policy=policy)

        samples = read_planned(part, read, read_back)
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
            cursor.take()  # counted as it is handed over: a state taken now includes it
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

    def _columnar(self, part: Any, epoch: int, counters: Any, policy: ErrorPolicy, stats: BatchStats, cursor: Cursor) -> Any:
        """A pass of columnar batches (every source a table): the shuffle moves row refs, batches
        are gathered from the held row groups (pipeline/table.py)."""
        blocks = Blocks(pad=self.mode == "pad")
        names = part.names
        budget = Budget(max(self.readahead), counters) if max(self.readahead) > 0 else None  # the worker's one, as in _rows
        sources = [self._range_source(i, counters, budget=budget) for i in range(len(self.sources.manifests))]
        if not part.num_batches:
            return
        planned = [_planned(source, part, i) for i, source in enumerate(sources)]  # read-ahead across windows

        def read(i: int, ranges: list[Any]) -> Any:
            return table_refs(sources[i], ranges, blocks, policy=policy, name=names[i] if names else "", planned=planned[i])  # type: ignore[arg-type]

        def read_back(i: int, ranges: list[Any]) -> Any:  # a resumed window's buffered rows: not in the planned sequence
            return table_refs(sources[i], ranges, blocks, policy=policy, name=names[i] if names else "")  # type: ignore[arg-type]

        refs = read_planned(dataclasses.replace(part, names=None), read, read_back)
        images, transform = self._images, self.batch_transform

        def collate(batch: Any) -> Any:
            rows = blocks.gather(batch)
            return transform.apply(rows) if transform is not None else columnar_batch(rows, images)

        batches = batch_refs(refs, batch_size=self.batch_size, num_batches=part.num_batches, collate=collate, stats=stats, pad=self.mode == "pad")
        try:
            for made, batch in enumerate(batches, 1):
                counters.step(f"made batch {made} of {part.num_batches} of epoch {epoch}", batch=True)
                cursor.take()
                yield batch
        finally:
            for reads in planned:
                reads.close()

    def _token_batches(self, part: Any, epoch: int, counters: Any, policy: ErrorPolicy, stats: BatchStats, cursor: Cursor) -> Any:
        """A pass of token sequences: the shuffle moves sequence refs, each batch is cut from the
        shards' tokens (pipeline/tokens.py)."""
        if not part.num_batches:
            return
        sources = [self._range_source(i, counters) for i in range(len(self.sources.manifests))]
        documents = self.seed if self.documents else None
        reader = TokenReader(self.sources.manifests, sources, part.names, policy, documents)  # type: ignore[arg-type]  # (checked: token corpora)
        untagged = dataclasses.replace(part, names=None)

        def windows() -> Any:  # window by window, so that each window's refs carry its data epoch (shuffled documents)
            for window in part.windows:
                refs_of = functools.partial(reader.refs, epoch=window.epoch)
                yield from read_planned(dataclasses.replace(untagged, windows=[window]), refs_of)  # type: ignore[arg-type]  # (ref arrays, as a table's)

        refs = windows()
        batches = batch_refs(refs, batch_size=self.batch_size, num_batches=part.num_batches, collate=reader.gather, stats=stats, pad=False)
        for made, batch in enumerate(batches, 1):
            counters.step(f"made batch {made} of {part.num_batches} of epoch {epoch}", batch=True)
            cursor.take()
            yield batch

    def _range_source(self, i: int, counters: Any, buffers: BufferPool | None = None, budget: Budget | None = None) -> RangeSource | TableSource:
        """Where source i is read from: its own storage options (a mix's Source) or the stream's, and its read-ahead."""
        own = self.sources.sources[i].storage_options
        manifest = self.sources.manifests[i]
        if isinstance(manifest, TokenManifest):  # a token corpus's shards are read as its documents: tar shards or row groups
            manifest = manifest.docs
        if isinstance(manifest, TableManifest):
            return TableSource(
                manifest,
                storage_options=dict(own) if own is not None else self.storage_options,
                counters=counters,
                config=self.storage,
                readahead_bytes=self.readahead[i],
                read_size=self.read.read_size,
                budget=budget if self.readahead[i] > 0 else None,
                cache=self.cache,
            )
        return RangeSource(
            manifest,
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
            budget=budget if self.readahead[i] > 0 else None,
        )

    # -- resume: torchdata's Stateful protocol ----------------------------------------------------
    def state_dict(self, batches: int | None = None, num_workers: int | None = None) -> dict[str, Any]:
        """The data position as a small JSON-serialisable dict (plan/state.py).

        Where this process iterates the dataset itself (no DataLoader workers, or inside one: how
        StatefulDataLoader calls it), the state counts the batches it handed over. With your own
        DataLoader's workers, the main process cannot see them: give ``batches``, how many
        batches the training loop received in the current pass (a resumed pass counts from 0;
        batches in prefetch queues are not consumed). ``make_loader``'s loader counts for you:
        prefer ``loader.state_dict()``. Every rank receives the same count, so rank 0's state is
        enough for all ranks. Before a pass starts: the state at its start (a loaded one, as loaded).
        """
        cursor = self._place.cursor
        if cursor is not None and num_workers in (None, cursor.plan.topology.num_workers) and self._clock.current == cursor.plan.loader_epoch:
            return cursor.state(batches)  # the pass this process iterates
        if not self._clock.started or (cursor is None and (self._place.iterated or get_worker_info() is not None)):
            return self.pass_plan(num_workers).state_after(batches or 0)  # the next pass, not started
        if batches is None:
            raise ConfigError(
                "a pass over this ShardStream has started in DataLoader workers and only the training loop knows how many "
                "batches it received: call state_dict(batches=STEPS_THIS_EPOCH), or use make_loader's loader.state_dict()"
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
        epoch to the state's; a state saved once its pass was over sets the next one (its pass
        follows on; ``set_epoch`` with the state's epoch gives that pass, empty). Raises
        StateError for a state of other data, seed, shuffle, mode, schedule or version. Load it
        before the DataLoader starts its (persistent) workers.

        ``state`` may also be a ``StatefulDataLoader``'s own ``state_dict()`` over this dataset:
        its position is read from the snapshots of its workers (the furthest), so the next pass
        may run on another number of workers (a new StatefulDataLoader, not loaded, or
        ``make_loader``)."""
        if "_snapshot" in state or "_num_yielded" in state:
            state = self._from_stateful_dataloader(state)
        loaded = self._loaded = self._run.load(state)
        info = get_worker_info()
        self._place.cursor, self._place.own_state = None, info is not None
        if info is not None:  # StatefulDataLoader's snapshot of this worker: it goes on with its own batches
            self._load_in_worker(loaded, info.id, info.num_workers)
            return
        self._clock.load(loaded.loader_epoch)
        if self._run.finished(loaded):
            self._clock.set(loaded.loader_epoch + 1)

    def _load_in_worker(self, loaded: State, worker: int, num_workers: int) -> None:
        """Each worker holds only its own position: the pass goes on where every worker stood,
        which needs the topology it was saved on; it is over when every worker's share is. Then
        StatefulDataLoader drops the iterator it made over it (its workers' first) for a new one:
        that first iterator starts no pass, so the next pass is the next epoch, wherever it runs."""
        if loaded.last.topology != self._run.topology(num_workers):
            raise StateError(
                f"a DataLoader worker was given a state saved on {loaded.last.topology.describe()}, but it runs on "
                f"{self._run.topology(num_workers).describe()}: a worker's own state resumes only on its topology. Load "
                "the StatefulDataLoader's state into the dataset instead (dataset.load_state_dict(loader.state_dict())) "
                "and iterate a new StatefulDataLoader without loading it: the pass then continues elastically"
            )
        plan = self._run.pass_plan(loaded.loader_epoch, num_workers, loaded, True)
        if plan.worker(self.world.rank, (worker - plan.received) % num_workers).num_batches:
            self._clock.load(loaded.loader_epoch)
        else:
            self._clock.follow(loaded.loader_epoch + 1)
            self._place.share_over = True

    def _from_stateful_dataloader(self, sdl: Mapping[str, Any]) -> dict[str, Any]:
        """The position in a StatefulDataLoader's state_dict (torchdata 0.11): with no
        workers, the dataset's own state; with K, the furthest of the K workers' (the one that
        delivered the last batch received), moved on by the steps received since that snapshot."""
        if "_num_yielded" in sdl:  # no workers: the dataset ran in the loop's process and counted
            found = sdl.get("dataset_state")
            if found is None:
                raise StateError("this StatefulDataLoader state holds no dataset state: it was not saved over a ShardStream")
            return found
        snapshot = sdl["_snapshot"]
        states = [w.get("dataset_state") for w in snapshot.get("_worker_snapshots", {}).values()]
        if not states or any(s is None for s in states):
            raise StateError("this StatefulDataLoader state holds no dataset state per worker: it was not saved over a ShardStream")
        state = furthest(states)
        since = int(sdl.get("_steps_since_snapshot", 0))
        if since:
            loaded = self._run.load(state)
            state = self._run.pass_plan(loaded.loader_epoch, loaded.last.topology.num_workers, loaded, True).state_after(since)
        return state
