"""pack(): list a source, load its samples (in parallel processes), write shards and the manifest.

The order of samples is fixed by listing (and an optional seeded shuffle) before anything is
loaded, and results are written in that order whatever the number of workers, so the output is
byte-identical for any ``workers``.

With an ``executor`` (a process pool, Dask's ``Client.get_executor()``) the work is shard tasks
instead (``write.tasks``): the driver cuts the listing into shards of ``max_count`` units, workers
write them, the driver writes the manifest last. ``pack(fn, inputs, dest)`` packs what the user's
``fn(input)`` returns or yields, the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from shardstream.errors import ConfigError, SourceError
from shardstream.format.manifest import Manifest, ShardInfo, check_dataset_root
from shardstream.policy import ErrorPolicy
from shardstream.storage import fs as storage
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.write.loading import load_encoded, run_task, set_options
from shardstream.write.localshards import ListedWork, LocalShardDone, LocalShardTask, Sizes, plan_shards, sample_size, write_local_shard
from shardstream.write.procs import Workers, fork_safe, map_in_order
from shardstream.write.sources import Item, batches_of, list_source
from shardstream.write.tasks import DEFAULT_IN_FLIGHT, ShardTask, adopt, cut_shards, run_tasks, write_shard
from shardstream.write.writer import DEFAULT_MAX_COUNT, DEFAULT_MAX_SIZE, ShardWriter, shard_name

logger = logging.getLogger(__name__)


@dataclass
class PackResult:
    """What ``pack`` (``pack_source``, ``pack_fn``) returns once the manifest is written.

    ``manifest``: the dataset's ``Manifest``, as written; ``manifest_url``: where (the
    destination's ``index.json``); ``samples``: samples written; ``shards``: shards written;
    ``bytes``: their total size (shards only, not sidecars or the manifest); ``seconds``: wall time
    of the whole pack, listing included; ``skipped``: samples left out under ``on_error="skip"``,
    the first 100 as ``{"source": ..., "error": ...}``; ``skipped_count``: all of them;
    ``hidden``: files of a directory tree left out unread because a part of their path starts
    with "." (not samples: not in ``skipped``).
    """

    manifest: Manifest
    manifest_url: str
    samples: int
    shards: int
    bytes: int
    seconds: float
    skipped: list[dict[str, str]] = field(default_factory=list)
    skipped_count: int = 0
    tokens: int | None = None  # a token corpus (write/tokens.py): the tokens written, else None
    hidden: int = 0

    @classmethod
    def of(cls, writer: ShardWriter, started: float, **extra: Any) -> PackResult:
        """What a closed ``writer`` wrote, in a pack that started at ``started`` (``perf_counter``)."""
        assert writer.manifest is not None  # the with-block closed the writer without an error
        return cls(
            manifest=writer.manifest,
            manifest_url=writer.manifest_url,
            samples=writer.samples_written,
            shards=len(writer.shards),
            bytes=sum(s.bytes for s in writer.shards),
            seconds=time.perf_counter() - started,
            **extra,
        )


def pack(source: str | Callable[[Any], Any], *args: Any, **options: Any) -> PackResult:
    """``pack(src, dest, ...)`` packs a directory tree, JSONL file or shards (``pack_source``);
    ``pack(fn, inputs, dest, ...)`` packs what ``fn(input)`` returns or yields (``pack_fn``).
    Both take ``config`` (a ``StorageConfig``): the storage policy of the destination (see
    ``ShardWriter``) and, for ``pack_source``, of the source too."""
    if callable(source):
        if len(args) != 2:
            raise TypeError("pack(fn, inputs, dest, ...) takes the inputs and the destination")
        return pack_fn(source, args[0], args[1], **options)
    if len(args) != 1:
        raise TypeError("pack(src, dest, ...) takes one destination")
    return pack_source(source, args[0], **options)


def pack_source(
    src: str,
    dest: str,
    *,
    kind: str = "auto",
    max_count: int = DEFAULT_MAX_COUNT,
    max_size: int = DEFAULT_MAX_SIZE,
    shuffle: bool = False,
    seed: int = 0,
    workers: int | None = None,
    label_from_dir: bool = False,
    columns: Sequence[str] | None = None,
    key: str | None = None,
    overwrite: bool = False,
    on_error: str = "raise",
    error_tolerance: int | None = None,
    prefix: str = "shard",
    prefixes: int = 1,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    executor: Executor | None = None,
    in_flight: int = DEFAULT_IN_FLIGHT,
    config: StorageConfig = DEFAULT_STORAGE,
    on_listed: Callable[[int], None] | None = None,
    allow_outside: Sequence[str] = (),
) -> PackResult:
    """Pack ``src`` into shards under ``dest``; see the module docstring of ``sources`` for kinds.

    The source reads only inside its own root (a tree's folder, a JSONL file's folder or bucket
    prefix): a ``$file`` reference or symlink leading elsewhere is a bad sample (``on_error``)
    unless it lies under a folder or URL prefix in ``allow_outside`` (CLI: ``--allow-outside``).

    ``on_error="raise"`` stops at the first bad sample with a SourceError naming it (and leaves
    no manifest); ``"skip"`` leaves bad samples out, counts them and lists them in the manifest
    (the reader's ``ErrorPolicy``: ``error_tolerance`` consecutive bad samples, None = no limit,
    raise TooManyErrors).
    ``columns`` and ``key``: a Parquet source's columns to pack (default: all) and the column
    whose value is each sample's key (default: the file's path and the row's number).
    ``progress(samples, bytes)`` is called after each written sample; ``on_listed(n)`` once, when
    the source is listed, with the number of items to load (a progress bar's total).
    ``config`` is the storage policy of both sides: the source's listing and every read of its
    items (retries and ``deadline``; a shards source's manifest may list shards under
    ``allow_roots``) and the destination (``ShardWriter``). It goes with the storage options to
    every process that loads items (``workers``) or writes shards (under an ``executor``).
    """
    policy = ErrorPolicy(on_error, error_tolerance, log=False)  # raises ConfigError on a bad on_error
    check_dataset_root(dest)  # before the source is listed or anything is written
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ConfigError(f"workers must be an integer >= 1 (or None: chosen by the pack), got {workers!r}")
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        loaders: int | Workers | None = workers
        if workers is not None and workers > 1 and executor is None and not _forks_after_listing(src, dest, storage_options, config):
            loaders = _start_loaders(workers, storage_options, config)  # started first: their imports overlap the listing
            stack.callback(loaders.stop)  # (ended already when the pack went through)
        return _pack_listed(
            src,
            dest,
            loaders,
            kind=kind,
            max_count=max_count,
            max_size=max_size,
            shuffle=shuffle,
            seed=seed,
            label_from_dir=label_from_dir,
            columns=columns,
            key=key,
            overwrite=overwrite,
            policy=policy,
            on_error=on_error,
            prefix=prefix,
            prefixes=prefixes,
            storage_options=storage_options,
            progress=progress,
            executor=executor,
            in_flight=in_flight,
            config=config,
            on_listed=on_listed,
            allow_outside=allow_outside,
            started=started,
        )


def _pack_listed(
    src: str,
    dest: str,
    loaders: int | Workers | None,
    *,
    kind: str,
    max_count: int,
    max_size: int,
    shuffle: bool,
    seed: int,
    label_from_dir: bool,
    columns: Sequence[str] | None,
    key: str | None,
    overwrite: bool,
    policy: ErrorPolicy,
    on_error: str,
    prefix: str,
    prefixes: int,
    storage_options: Mapping[str, Any] | None,
    progress: Callable[[int, int], None] | None,
    executor: Executor | None,
    in_flight: int,
    config: StorageConfig,
    on_listed: Callable[[int], None] | None,
    allow_outside: Sequence[str],
    started: float,
) -> PackResult:
    """``pack_source`` once its loaders are started (``Workers``, or a count: 1 loads here; None:
    chosen here, ``auto_workers``)."""
    listing = list_source(
        src,
        kind,
        label_from_dir=label_from_dir,
        columns=columns,
        key=key,
        storage_options=storage_options,
        config=config,
        allow_outside=allow_outside,
    )
    if listing.hidden:
        logger.info("%s: left out %d hidden files (a part of their path starts with '.')", src, listing.hidden)
    if shuffle and listing.kind == "parquet":
        raise ConfigError(
            "--shuffle does not apply to a Parquet source (rows load a row group at a time): shuffle when reading, ShardStream(shuffle=...)"
        )
    if listing.errors and policy.on_error == "raise":
        where, what = listing.errors[0]
        more = f" (and {len(listing.errors) - 1} more problems)" if len(listing.errors) > 1 else ""
        raise SourceError(where, what + more)
    items = list(listing.items)
    if on_listed is not None:
        on_listed(len(items))
    if shuffle:
        random.Random(seed).shuffle(items)
    if not items and not listing.errors:
        raise SourceError(src, "source holds no samples")
    if executor is None and items and all(payload[0] == "local" for _, payload in items) and _is_local(dest, storage_options, config):
        return _pack_planned(
            items,
            listing.errors,
            dest,
            loaders,
            src=src,
            max_count=max_count,
            max_size=max_size,
            prefix=prefix,
            prefixes=prefixes,
            overwrite=overwrite,
            policy=policy,
            storage_options=storage_options,
            label_map=listing.label_map,
            hidden=listing.hidden,
            progress=progress,
            config=config,
            started=started,
        )
    if loaders is None:
        loaders = 1
    if executor is not None:
        done = _pack_tasks(
            items,
            None,
            dest,
            src=src,
            executor=executor,
            max_count=max_count,
            max_size=max_size,
            prefix=prefix,
            prefixes=prefixes,
            storage_options=storage_options,
            overwrite=overwrite,
            on_error=on_error,
            label_map=listing.label_map,
            errors=listing.errors,
            progress=progress,
            started=started,
            in_flight=in_flight,
            config=config,
        )
        done.hidden = listing.hidden
        return done
    with (
        ShardWriter(
            dest,
            max_count=max_count,
            max_size=max_size,
            prefix=prefix,
            prefixes=prefixes,
            storage_options=storage_options,
            overwrite=overwrite,
            label_map=listing.label_map,
            config=config,
        ) as writer,
        # closed first on an error or Ctrl-C: its pool is stopped (and collected) before the writer
        # cleans up, not whenever the generator happens to be collected (at exit its pipes were gone)
        contextlib.closing(_load_all(items, loaders, storage_options, config)) as loaded,
    ):
        for where, what in listing.errors:
            writer.skip(where, what)
        for (where, _), (ok, a, b) in zip(items, loaded):
            try:
                if not ok:
                    raise SourceError(a, b)
                try:
                    writer.write_members(a, *b)
                except SourceError as exc:  # the writer knows the key; the listing knows the file or line
                    raise SourceError(f"{where} ({exc.where})", exc.what) from None
            except SourceError as exc:
                policy.failed(exc)  # raises under "raise" (and past the tolerance)
                writer.skip(exc.where, exc.what)
                continue
            policy.ok()
            if progress is not None:
                progress(writer.samples_written, writer.bytes_written)
        if writer.samples_written == 0:
            raise SourceError(src, f"no sample could be packed ({writer.skipped_count} skipped)")
    return PackResult.of(writer, started, skipped=writer.skipped, skipped_count=writer.skipped_count, hidden=listing.hidden)


def _is_local(dest: str, storage_options: Mapping[str, Any] | None, config: StorageConfig) -> bool:
    return storage.is_local(storage.get_fs(dest, storage_options, config)[0])


def _forks_after_listing(src: str, dest: str, storage_options: Mapping[str, Any] | None, config: StorageConfig) -> bool:
    """Whether a pack's workers are best forked once the source is listed (``_pack_planned``):
    a local folder into a local destination, in a process where a fork is sound
    (``procs.fork_safe``). Spawned workers start before the listing instead, so that their
    imports overlap it; forked ones start in milliseconds holding the listing."""
    return fork_safe() and "://" not in src and os.path.isdir(src) and _is_local(dest, storage_options, config)


AUTO_BYTES_PER_WORKER = 32 * 1000**2  # planned shard bytes that make one more worker worth its start


def auto_workers(cuts: Sequence[range], total_bytes: int, cpus: int | None = None, load: float | None = None) -> int:
    """The worker count a pack of planned shards (``localshards.plan_shards``) runs on when none
    is given: one per idle CPU, the CPUs this process may run on less the 1-minute load average
    (as ``make -l`` holds back jobs on a busy machine: where other work already fills the cores, a
    worker adds its start and shares them, and was slower than none), plus this process; never
    more than the shards (one is written by one process) nor than one per
    ``AUTO_BYTES_PER_WORKER`` of data (a worker's start, a new Python, costs more than it saves
    on less). 1 means no worker process at all."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    idle = 1 + int(max(0.0, cpus - load))
    return max(1, min(cpus, idle, len(cuts), 1 + total_bytes // AUTO_BYTES_PER_WORKER))


def _pack_planned(
    items: list[Item],
    errors: list[tuple[str, str]],
    dest: str,
    loaders: int | Workers | None,
    *,
    src: str,
    max_count: int,
    max_size: int,
    prefix: str,
    prefixes: int,
    overwrite: bool,
    policy: ErrorPolicy,
    storage_options: Mapping[str, Any] | None,
    label_map: dict[str, int] | None,
    hidden: int,
    progress: Callable[[int, int], None] | None,
    config: StorageConfig,
    started: float,
) -> PackResult:
    """A local tree into a local destination: shards planned from the files' sizes
    (``localshards``), each written whole by one process (here with one worker), the manifest
    last. The main process lists, plans and adopts shards; it handles no sample. Where a fork is
    sound (``procs.fork_safe``) the workers are forked holding the listing: a given count is
    started before the stat, which they share; the default's count comes from the plan."""
    with contextlib.ExitStack() as pool_stack:

        def start(n: int) -> Workers:
            pool = Workers(ListedWork(items), n, context="fork") if fork_safe() else _start_loaders(n, storage_options, config)
            pool_stack.callback(pool.stop)  # (ended already when the pack went through)
            return pool

        workers: int | Workers | None = loaders
        if isinstance(workers, int) and workers > 1 and fork_safe():  # a given count: forked now, to share the stat
            workers = start(workers)
        if isinstance(workers, Workers) and workers.forked:
            spans = _spans(len(items), 2 * len(workers.procs))
            sizes = [n for part in workers.map(spans, ahead=len(spans), describe=_describe_sizes(items)) for n in part]
        else:
            sizes = [sample_size(item) for item in items]
        cuts = plan_shards(sizes, max_count, max_size)
        if workers is None:
            workers = auto_workers(cuts, sum(sizes))
        if isinstance(workers, int) and workers > 1:  # started before the destination is prepared: their start overlaps it
            workers = start(workers)
        return _write_planned(
            items,
            sizes,
            cuts,
            errors,
            dest,
            workers,
            src=src,
            max_count=max_count,
            max_size=max_size,
            prefix=prefix,
            prefixes=prefixes,
            overwrite=overwrite,
            policy=policy,
            storage_options=storage_options,
            label_map=label_map,
            hidden=hidden,
            progress=progress,
            config=config,
            started=started,
        )


def _write_planned(
    items: list[Item],
    sizes: list[int],
    cuts: list[range],
    errors: list[tuple[str, str]],
    dest: str,
    workers: int | Workers,
    *,
    src: str,
    max_count: int,
    max_size: int,
    prefix: str,
    prefixes: int,
    overwrite: bool,
    policy: ErrorPolicy,
    storage_options: Mapping[str, Any] | None,
    label_map: dict[str, int] | None,
    hidden: int,
    progress: Callable[[int, int], None] | None,
    config: StorageConfig,
    started: float,
) -> PackResult:
    """``_pack_planned`` once its workers are started (``Workers``; 1: the shards are written here)."""
    with (
        ShardWriter(
            dest,
            max_count=max_count,
            max_size=max_size,
            prefix=prefix,
            prefixes=prefixes,
            storage_options=storage_options,
            overwrite=overwrite,
            label_map=label_map,
            config=config,
        ) as writer,
        contextlib.ExitStack() as stack,
    ):
        for where, what in errors:
            writer.skip(where, what)
        listed = isinstance(workers, Workers) and workers.forked  # the workers hold the listing: shards go by position
        tasks = (
            LocalShardTask(
                writer.root,
                shard_name(prefix, i, prefixes),
                () if listed else items[r.start : r.stop],
                sizes[r.start : r.stop],
                policy.on_error,
                positions=r if listed else None,
            )
            for i, r in enumerate(cuts)
        )
        results: Iterable[LocalShardDone]
        if isinstance(workers, Workers) or workers > 1:  # two a worker: the next is there when one ends
            ahead = 2 * (len(workers.procs) if isinstance(workers, Workers) else workers)
            describe = _describe_local_task(items)
            results = stack.enter_context(contextlib.closing(map_in_order(run_task, tasks, workers=workers, ahead=ahead, describe=describe)))
        else:
            results = map(write_local_shard, tasks)
        for done in results:
            at = 0
            for position, where, what in done.skipped:
                if position > at:
                    policy.ok()
                policy.failed(SourceError(where, what))  # raises past the tolerance
                writer.skip(where, what)
                at = position + 1
            if at < len(done.keys) + len(done.skipped):
                policy.ok()
            info = ShardInfo(done.name, done.samples, done.bytes, done.sha256, index=done.sidecar, span=done.span, member_bytes=done.member_bytes)
            writer.add_shard(info, done.extensions, done.label_counts)
            if progress is not None:
                progress(writer.samples_written, writer.bytes_written)
        if writer.samples_written == 0:
            raise SourceError(src, f"no sample could be packed ({writer.skipped_count} skipped)")
    return PackResult.of(writer, started, skipped=writer.skipped, skipped_count=writer.skipped_count, hidden=hidden)


def _describe_local_task(items: Sequence[Item]) -> Callable[[LocalShardTask], str]:
    """How a WorkerDied names a shard task (its items, or its positions in ``items``)."""

    def describe(task: LocalShardTask) -> str:
        span = items[task.positions.start : task.positions.stop] if task.positions is not None else task.items
        return f"shard {task.name} ({len(span)} samples, {span[0][0]} to {span[-1][0]})"

    return describe


def _describe_sizes(items: Sequence[Item]) -> Callable[[Sizes], str]:
    return lambda task: f"the sizes of {items[task.start][0]} to {items[task.stop - 1][0]}"


def _spans(n: int, parts: int) -> list[Sizes]:
    """``0:n`` in ``parts`` spans about as long (none empty)."""
    bounds = sorted({n * i // parts for i in range(parts + 1)})
    return [Sizes(a, b) for a, b in zip(bounds, bounds[1:])]


def pack_fn(
    fn: Callable[[Any], Any],
    inputs: Iterable[Any],
    dest: str,
    *,
    max_count: int = DEFAULT_MAX_COUNT,
    max_size: int = DEFAULT_MAX_SIZE,
    workers: int = 1,
    executor: Executor | None = None,
    overwrite: bool = False,
    on_error: str = "raise",
    prefix: str = "shard",
    prefixes: int = 1,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    in_flight: int = DEFAULT_IN_FLIGHT,
    config: StorageConfig = DEFAULT_STORAGE,
) -> PackResult:
    """Pack the samples ``fn(input)`` returns (a dict) or yields (dicts) for every input, in the
    order of ``inputs``, whatever runs it: here (``workers=1``), N spawned processes
    (``workers=N``, ``write.procs``; ``fn`` must be importable, i.e. defined at module level) or ``executor``.

    Shard ``i`` holds the samples of inputs ``[i * max_count, (i + 1) * max_count)``, so the
    output is byte-identical for any engine and worker count. An exception from ``fn`` names the
    input; ``on_error`` decides (``"skip"`` lists it in the manifest). ``config``: the storage
    policy of the destination (``ShardWriter``), here and in every process that writes a shard.
    """
    ErrorPolicy(on_error, log=False)  # raises ConfigError on a bad on_error
    check_dataset_root(dest)  # before any input is run or anything is written
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an integer >= 1, got {workers!r}")
    started = time.perf_counter()
    units = list(inputs)
    if not units:
        raise SourceError(repr(fn), "no inputs to pack")
    where = getattr(fn, "__qualname__", repr(fn))
    return _pack_tasks(
        units,
        fn,
        dest,
        src=where,
        executor=executor,
        workers=workers,
        max_count=max_count,
        max_size=max_size,
        prefix=prefix,
        prefixes=prefixes,
        storage_options=storage_options,
        overwrite=overwrite,
        on_error=on_error,
        label_map=None,
        errors=[],
        progress=progress,
        started=started,
        in_flight=in_flight,
        config=config,
    )


def _pack_tasks(
    units: Sequence[Any],
    fn: Callable[[Any], Any] | None,
    dest: str,
    *,
    src: str,
    executor: Executor | None,
    max_count: int,
    max_size: int,
    prefix: str,
    prefixes: int,
    storage_options: Mapping[str, Any] | None,
    overwrite: bool,
    on_error: str,
    label_map: dict[str, int] | None,
    errors: list[tuple[str, str]],
    progress: Callable[[int, int], None] | None,
    started: float,
    in_flight: int,
    config: StorageConfig = DEFAULT_STORAGE,
    workers: int = 1,
) -> PackResult:
    """The driver of a task pack: prepare the destination, run one task per shard (on ``executor``,
    else on ``workers`` processes of ``write.procs``, else here), adopt the results in shard order,
    write the manifest last (``ShardWriter.close``)."""
    options = dict(storage_options or {})
    keys: set[str] = set()
    with (
        ShardWriter(
            dest,
            max_count=max_count,
            max_size=max_size,
            prefix=prefix,
            prefixes=prefixes,
            storage_options=options,
            overwrite=overwrite,
            label_map=label_map,
            config=config,
        ) as writer,
        contextlib.ExitStack() as stack,
    ):
        for where, what in errors:
            writer.skip(where, what)
        tasks = (
            ShardTask(
                dest=writer.dest,
                name=shard_name(prefix, i, prefixes),
                index=i,
                first=r.start,
                units=units[r.start : r.stop],
                fn=fn,
                on_error=on_error,
                storage_options=options,
                config=config,
            )
            for i, r in enumerate(cut_shards(len(units), max_count))
        )
        # (closed at once on an error: its running tasks end before the writer cleans up)
        if executor is None and workers > 1:  # two a worker: the next is there when one ends
            results = map_in_order(write_shard, tasks, workers=workers, ahead=2 * workers, describe=_describe_task)
        else:
            results = run_tasks(executor, tasks, in_flight=in_flight)
        for result in stack.enter_context(contextlib.closing(results)):
            for where, what in result.skipped:
                writer.skip(where, what)
            clash = next((k for k in result.keys if k in keys), None)
            if clash is not None:  # across shards: found only once both are written, so never skipped
                raise SourceError(f"key {clash!r}", f"duplicate key: appears again in {result.info.path}")
            keys.update(result.keys)
            adopt(writer, result, max_size, progress)
        if writer.samples_written == 0:
            raise SourceError(src, f"no sample could be packed ({writer.skipped_count} skipped)")
        writer.remove_partials()  # left by attempts the engine killed and retried elsewhere
    return PackResult.of(writer, started, skipped=writer.skipped, skipped_count=writer.skipped_count)


def _describe_task(task: ShardTask) -> str:
    return f"shard {task.name} (inputs #{task.first} to #{task.first + len(task.units) - 1})"


SINGLES_PER_TASK = 64


def _describe_batch(batch: Sequence[Item]) -> str:
    """A task of loads, as a WorkerDied names it."""
    if len(batch) == 1:
        return f"loading {batch[0][0]}"
    return f"loading {len(batch)} samples, {batch[0][0]} to {batch[-1][0]}"


def _start_loaders(workers: int, storage_options, config: StorageConfig) -> Workers:
    """The processes that write whole shards of a local tree or load and encode items
    (``loading.run_task``), reading under ``config``."""
    return Workers(run_task, workers, initializer=set_options, initargs=(dict(storage_options or {}), config))


def _load_all(items: list[Item], workers: int | Workers, storage_options, config: StorageConfig = DEFAULT_STORAGE):
    """Yield load results in item order; with workers (> 1, or ``Workers`` already started by
    ``_start_loaders``) worker processes (``write.procs``) load a bounded window. Items are read
    with ``storage_options`` under ``config``, here and in every worker."""
    set_options(storage_options, config)
    if workers == 1:
        for batch in batches_of(items, SINGLES_PER_TASK):
            yield from load_encoded(batch)
        return
    # Single items go 64 to a task: a task's round trip (pickling, a pipe) costs more than reading
    # a small file, so one task an item kept the workers waiting on the main process.
    batches = batches_of(items, SINGLES_PER_TASK)
    # A sliding window of batches in flight, two a worker: the next is there when one ends, so the
    # workers never wait for the main process to ask (a Parquet row group's span: up to
    # parquet.SPAN_BYTES each, so two a worker is also the memory bound).
    pool = workers if isinstance(workers, Workers) else _start_loaders(workers, storage_options, config)
    results = map_in_order(run_task, batches, workers=pool, ahead=2 * len(pool.procs), describe=_describe_batch)
    with contextlib.closing(results):
        for batch in results:
            yield from batch
