"""Read planned row ranges of Parquet tables (``format/parquet.py``): as per-row sample dicts, or as
row refs gathered into columnar batches.

A range (row group g, rows [a, b)) reads row group g's projected column chunks once (consecutive
ranges of one row group share the read: a resumed worker's read-back of single rows costs a read
per row group, not per row), with read-ahead across row groups when ``readahead_bytes`` is set:
over a whole pass (``PlannedGroups``), so the next window's row groups are fetched while this
window's are consumed, in the worker's one budget.

Two shapes out, from one plan:

- ``table_rows``: lists of ``{"__key__": "FILE:ROW", "__url__": file URL, column: value, ...}``,
  so a table mixes with tar sources and every per-sample stage works on it.
- ``table_refs``: lists of ints, one per row (``block << 32 | row``), into ``Blocks``, the Arrow
  row groups a worker holds. The shuffle (``continue_samples``, the same state machine as for
  samples, so exact resume holds) moves these ints, not dicts; ``Blocks.gather`` takes a batch's
  rows from the held row groups (a slice when they are consecutive; shuffled rows as one take of
  packed row records, ``Held.pack``, from the row group holding most of the batch, the other row
  groups' records put over theirs) and frees a row group once none of its rows is left to deliver. ``columnar_batch`` turns the gathered
  Arrow table into tensors (zero-copy for fixed-width columns without nulls).
"""

from __future__ import annotations

import functools
import logging
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from shardstream.errors import ConfigError, SampleError, ShardFormatError, StorageError, TooManyErrors
from shardstream.format.parquet import TableManifest, footer_for, group_runs, read_group
from shardstream.pipeline.batch import Batch, BatchStats, finish_upstream, stack_tensors
from shardstream.pipeline.interleave import REPEAT
from shardstream.plan.epoch import Range
from shardstream.policy import ErrorPolicy
from shardstream.storage.cache import ShardCache
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.ranges import DOWNLOAD_BLOCK, open_range
from shardstream.storage.readahead import Budget, PlannedSequence, Prefetcher

logger = logging.getLogger(__name__)

CHUNK = 1024  # rows per list handed on
BLOCK_BITS = 32
ROW_MASK = (1 << BLOCK_BITS) - 1
LOCAL = ("file", "local")  # protocols of local files: read directly, never cached
VALID = "__valid__"  # pad mode's mask of the plan's repeats, in a batch
REF_MASK = REPEAT - 1  # a ref without its REPEAT bit (pad mode's mark of a repeated row)
HF_IMAGE = re.compile(r"struct<bytes: (large_)?binary, path: (large_)?(string|null)>")  # datasets.Image() as Parquet holds it


def image_columns(m: TableManifest) -> list[str]:
    """The columns holding Hugging Face images (``struct<bytes, path>``) that this table reads."""
    wanted = m.projection
    return [n for n, t in m.columns if HF_IMAGE.fullmatch(t) and (wanted is None or n in wanted)]


class HFImage:
    """Decode a Hugging Face image value (``{"bytes": ..., "path": ...}``, or plain bytes) with an image decoder."""

    def __init__(self, decode: Callable[[bytes], Any]):
        self.decode = decode

    def __call__(self, value: Any) -> Any:
        data = value.get("bytes") if isinstance(value, dict) else value
        if data is None:
            raise ValueError(f"the image holds no bytes (only a path: {value.get('path') if isinstance(value, dict) else None!r})")
        return self.decode(data)


@dataclass(frozen=True)
class Batched:
    """``ShardStream(table, transform=Batched(fn))``: ``fn`` takes each whole batch of a Parquet
    table stream as a ``pyarrow.Table`` (its rows in the batch's order) and returns the batch, in
    place of per-row samples and the default columnar batch (a DataModule's ``transform(df)``).

    In ``mode="pad"`` the table ``fn`` gets has a last bool column ``__valid__`` (False for the
    plan's repeats), and when ``fn`` returns a dict without a ``"__valid__"`` key, the mask is
    added to it as a bool tensor (so a masked validation metric works whatever ``fn`` keeps);
    anything else ``fn`` returns (a tuple, a tensor) carries the mask only if ``fn`` puts it there."""

    fn: Callable[[Any], Any]

    def apply(self, rows: Rows) -> Any:
        """``fn`` over a gathered batch, the pad mask added to a dict result (see above)."""
        out = self.fn(rows.to_arrow())
        if rows.valid is not None and isinstance(out, MutableMapping) and VALID not in out:
            import torch

            out[VALID] = torch.from_numpy(rows.valid)
        return out

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError(f"Batched(fn): fn must be callable, got {type(self.fn).__name__}")


class TableSource:
    """Where a worker's row ranges come from: the table, storage options, counters, read-ahead
    (``budget``: the worker's one read-ahead budget, shared with its other sources, tar or table;
    without one, ``readahead_bytes`` of its own), and the local ``cache`` of whole files."""

    def __init__(
        self,
        manifest: TableManifest,
        *,
        storage_options: Mapping[str, Any] | None = None,
        counters: Any = None,
        config: StorageConfig = DEFAULT_STORAGE,
        readahead_bytes: int = 0,
        read_size: int = 4 << 20,
        budget: Budget | None = None,
        cache: Any = None,
    ):
        self.manifest = manifest
        self.storage_options = storage_options
        self.counters = counters
        self.config = config
        self.readahead_bytes = readahead_bytes
        self.read_size = read_size
        self.budget = budget
        self.cache = cache

    def runs(self, g: int) -> list[tuple[int, int]]:
        m = self.manifest
        metadata = footer_for(m, int(m.group_file[g]), self.storage_options, config=self.config, counters=self.counters)
        return group_runs(metadata, int(m.group_index[g]), m.projection)

    def opener(self, g: int) -> Callable[[], tuple[Callable[[int], bytes], Callable[[], None]]]:
        """Open row group g's projected runs as one stream of bytes for the read-ahead: one
        ranged request per run, handed over in blocks of at most the read-ahead's block size (so a
        row group's bytes count against the budget block by block, as a shard's do). The reader
        says what is left (``remaining``) and can send its requests early (``start``), so the
        read-ahead asks for the next row groups while this one's bytes arrive, as for tar ranges."""

        def open_it() -> tuple[Callable[[int], bytes], Callable[[], None]]:
            f = int(self.manifest.group_file[g])
            runs = RunsReader(self, f, self.runs(g))
            return runs, runs.close

        return open_it


class RunsReader:
    """``read(n)`` (or calling it): the next <= n bytes of a row group's runs, one run after another
    (each run one ``open_range``: one ranged request, or a cached file's bytes); bytes, so the
    read-ahead counts them. ``start()`` opens every run now, their requests sent (the read-ahead
    does so for the row groups after the one it reads); ``remaining()``: bytes not handed out yet."""

    def __init__(self, source: TableSource, f: int, runs: list[tuple[int, int]]):
        self.source, self.f, self.runs = source, f, runs
        self.url = source.manifest.file_url(f)
        self.k = 0
        self.left = self.at = 0
        self.cached: list[memoryview] | None = None  # the runs from the cache, while it serves them
        self._read: Any = None
        self._close: Callable[[], None] | None = None
        self._opened: list[tuple[Any, Callable[[], None]]] = []  # runs k, k + 1, ... opened by start(), not yet read
        self._sizes = [b - a for a, b in runs]

    def remaining(self) -> int:
        return self.left + sum(self._sizes[self.k :])

    def start(self) -> None:
        if self.source.cache is not None or self._read is not None or self._opened:
            return  # (a cache serves its own bytes; runs already under way)
        for a, b in self.runs[self.k :]:
            # A failure here is left to the read that needs the run: it opens (or sends) it again,
            # under the retry policy, and hands what fails to the consumer in order.
            try:
                read, close = open_bytes(self.source, self.f, a, b)
            except Exception:  # noqa: BLE001
                return
            self._opened.append((read, close))
            begin = getattr(read, "start", None)
            if begin is not None:
                try:
                    begin()
                except Exception:  # noqa: BLE001
                    return

    def __call__(self, n: int) -> bytes:
        return self.read(n)

    def read(self, n: int) -> bytes:
        if self.cached is None and self.source.cache is not None:
            self.cached = cached_runs(self.source, self.f, self.runs) or []
        if self.cached:
            block, rest = self.cached[0][:n], self.cached[0][n:]
            self.cached[0] = rest
            if not len(rest):
                self.cached.pop(0)
                if not self.cached:
                    self.k = len(self.runs)  # all served
            return bytes(block)
        while True:
            if self._read is None:
                if self.k >= len(self.runs):
                    return b""
                a, b = self.runs[self.k]
                self.k += 1
                self._read, self._close = self._opened.pop(0) if self._opened else open_bytes(self.source, self.f, a, b)
                self.left, self.at = b - a, a
            if self.left > 0:
                chunk = self._read(min(n, self.left))
                if not len(chunk):
                    what = "the file ends before the row group's column chunks do (truncated, or changed since it was indexed)"
                    raise ShardFormatError(self.url, self.at, what)
                self.left -= len(chunk)
                self.at += len(chunk)
                return chunk if isinstance(chunk, (bytes, bytearray)) else bytes(chunk)
            self._end_run()

    def _end_run(self) -> None:
        """End the run being read (the next read goes on with the next run)."""
        close, self._read, self._close = self._close, None, None
        if close is not None:
            close()

    def close(self) -> None:
        """End the run being read and the runs ``start`` opened that were not read."""
        self._end_run()
        opened, self._opened = self._opened, []
        for _, end in opened:
            end()


def open_bytes(source: TableSource, f: int, a: int, b: int) -> tuple[Any, Callable[[], None]]:
    """``(read, close)`` for bytes [a, b) of file f: one ranged read."""
    m = source.manifest
    return open_range(m.file_url(f), a, b, source.storage_options, source.counters, config=source.config, hint="")


def cached_runs(source: TableSource, f: int, runs: list[tuple[int, int]]) -> list[memoryview] | None:
    """A row group's projected runs through the cache (``Cache``: ``storage/cache.py``), or None
    where there is none (no cache, a local file, or the cache bypassed: full, no room).

    The cache holds one entry per row group and projection: the runs' bytes, fetched once (the same
    requests as without a cache) and CRC-checked on every hit, so a hit checks exactly the bytes
    it serves (a whole file per row group read would check the file once per row group) and the
    disk holds the projected columns only. Its key is the file's URL and size and the runs."""
    m = source.manifest
    url = m.file_url(f)
    if source.cache is None or fsspec.utils.get_protocol(url) in LOCAL:
        return None
    size = sum(b - a for a, b in runs)
    key = f"{url}@{int(m.file_sizes[f])}#" + ",".join(f"{a}-{b}" for a, b in runs)

    def download(write: Callable[[bytes], None]) -> None:
        for a, b in runs:
            read, close = open_bytes(source, f, a, b)
            try:
                left = b - a
                while left > 0:
                    chunk = read(min(left, DOWNLOAD_BLOCK))
                    if not len(chunk):
                        raise ShardFormatError(url, b - left, f"the file ends before byte {b} (truncated, or changed since it was indexed)")
                    write(chunk if isinstance(chunk, bytes) else bytes(chunk))
                    left -= len(chunk)
            finally:
                close()

    handle = source.cache.open(key, None, size, download, source.counters)
    if handle is None:
        return None
    file, lock = handle
    try:
        data = fetch_whole(_Into(file.read), url, [(0, size)])[0]
    finally:
        ShardCache.release(file, lock)
    view, out, at = memoryview(data), [], 0
    for a, b in runs:
        out.append(view[at : at + b - a])
        at += b - a
    return out


def fetch_whole(read: Any, url: str, runs: list[tuple[int, int]]) -> list[bytearray]:
    """The runs' bytes, each whole, from a read-ahead reader handing them over in blocks."""
    out = []
    for a, b in runs:
        data = bytearray(b - a)
        view = memoryview(data)
        got = 0
        while got < len(data):
            k = read.readinto(view[got:])
            if not k:
                raise ShardFormatError(url, a + got, f"the row group's bytes end at {a + got}, before byte {b}")
            got += k
        out.append(data)
    return out


def _read_runs(source: TableSource, f: int, runs: list[tuple[int, int]]) -> list[Any]:
    """The runs of file f, each whole: through the cache (``cached_runs``), else ranged reads."""
    cached = cached_runs(source, f, runs)
    if cached is not None:
        return cached
    out: list[Any] = []
    for a, b in runs:
        read, close = open_bytes(source, f, a, b)
        try:
            out.extend(fetch_whole(_Into(read), source.manifest.file_url(f), [(a, b)]))
        finally:
            close()
    return out


class _Into:
    """``readinto`` over a ``read(n)``."""

    def __init__(self, read: Any):
        self.read = read

    def readinto(self, view: memoryview) -> int:
        into = getattr(self.read, "readinto", None)
        if into is not None:
            return int(into(view))
        chunk = self.read(len(view))
        view[: len(chunk)] = chunk
        return len(chunk)


def _groups(ranges: Sequence[Range]) -> list[int]:
    """The row groups the ranges read, in order, consecutive repeats once."""
    out: list[int] = []
    for r in ranges:
        if not out or out[-1] != r.shard:
            out.append(r.shard)
    return out


def _prefetcher(source: TableSource, groups: list[int]) -> Prefetcher | None:
    """Read-ahead over ``groups`` (in the worker's budget, else one of its own), or None without read-ahead."""
    if not groups or (source.budget is None and source.readahead_bytes <= 0):
        return None
    openers = [source.opener(g) for g in groups]
    if source.budget is not None:
        return Prefetcher(openers, block_size=source.read_size, budget=source.budget)
    return Prefetcher(openers, block_size=source.read_size, max_bytes=source.readahead_bytes)


class PlannedGroups(PlannedSequence[int]):
    """One table source's read-ahead over a whole pass (``PlannedSequence``; ``pipeline.read.PlannedReads``
    for tar): one Prefetcher over the row groups of every window's planned ranges, in order (each
    window's consecutive repeats once, as ``read_groups`` reads them), in the worker's one budget.
    ``read_groups`` takes each window's row groups from it in turn."""

    noun = "row group"

    def __init__(self, source: TableSource, windows: Iterable[Sequence[Range]]):
        groups = [g for ranges in windows for g in _groups(ranges)]
        super().__init__(groups, _prefetcher(source, groups))


def read_groups(
    source: TableSource, ranges: Sequence[Range], policy: ErrorPolicy | None, planned: PlannedGroups | None = None
) -> Iterator[tuple[Range, Any, bool]]:
    """``(range, its row group as an Arrow table, new)`` per range, in order; ``new``: the first range
    of a row group read (consecutive ranges of a row group share one read). A row group that
    cannot be read goes to ``policy`` (raised, or its ranges' rows skipped and counted). With
    ``planned`` (a pass's ``PlannedGroups``, whose next row groups these ranges must read) its
    read-ahead serves them and runs on past them; else read-ahead (if any) covers these alone."""
    ranges = list(ranges)
    groups = _groups(ranges)
    base, own = 0, planned is None
    if planned is not None:
        base, prefetcher = planned.take(groups), planned.prefetcher
    else:
        prefetcher = _prefetcher(source, groups)
    m = source.manifest
    try:
        k = -1
        current: Any = None
        failed = False
        for n, rng in enumerate(ranges):
            if rng.stop > int(m.counts[rng.shard]) or rng.start < 0 or rng.start >= rng.stop:
                raise ValueError(f"range {rng} outside {m.group_name(rng.shard)} of {int(m.counts[rng.shard])} rows")
            new = k < 0 or groups[k] != rng.shard
            if new:
                k += 1
                current, failed = None, False
                if source.counters is not None:
                    source.counters.step(f"reading {m.group_name(rng.shard)}")
                try:
                    fetch: Callable[[list[tuple[int, int]]], list[Any]] | None = None
                    if prefetcher is not None:
                        fetch = functools.partial(fetch_whole, prefetcher.reader(base + k), m.file_url(int(m.group_file[rng.shard])))
                    elif source.cache is not None:
                        fetch = functools.partial(_read_runs, source, int(m.group_file[rng.shard]))

                    current = read_group(m, rng.shard, source.storage_options, config=source.config, counters=source.counters, fetch=fetch)
                except (ShardFormatError, StorageError) as exc:
                    if policy is None:
                        raise
                    failed = True
                    lost = 0
                    for later in ranges[n:]:  # this range and the ones after it in the same row group
                        if later.shard != rng.shard:
                            break
                        lost += len(later)
                    policy.failed(exc, lost=lost)
                    continue
            elif failed:
                continue
            yield rng, current, new
            if policy is not None:
                policy.ok()
    finally:
        if own and prefetcher is not None:
            prefetcher.close()


def table_rows(
    source: TableSource, ranges: Sequence[Range], *, policy: ErrorPolicy | None = None, planned: PlannedGroups | None = None
) -> Iterator[list[dict[str, Any]]]:
    """The rows of the ranges as sample dicts (``__key__`` ``FILE:ROW``, ``__url__``, one field per column), lists of at most CHUNK."""
    m = source.manifest
    for rng, table, _ in read_groups(source, ranges, policy, planned):
        f = int(m.group_file[rng.shard])
        url, path = m.file_url(f), m.files[f]
        first = int(m.group_first_row[rng.shard])
        for a in range(rng.start, rng.stop, CHUNK):
            b = min(rng.stop, a + CHUNK)
            rows = table.slice(a, b - a).to_pylist()
            for i, row in enumerate(rows, first + a):
                row["__key__"] = f"{path}:{i}"
                row["__url__"] = url
            yield rows


def _is_number(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(t) or pa.types.is_floating(t))


class Rows:
    """A batch's rows, gathered: per column a numpy array (numbers without nulls: a view of Arrow's
    memory when the rows are consecutive) or an Arrow array; ``schema`` is the table's."""

    __slots__ = ("schema", "columns", "sources", "valid")

    def __init__(self, schema: Any, columns: list[Any], sources: list[str] | None, valid: np.ndarray | None = None):
        self.schema, self.columns, self.sources, self.valid = schema, columns, sources, valid

    def to_arrow(self) -> Any:
        """The rows as a ``pyarrow.Table`` (numpy columns wrapped without a copy); in pad mode with
        a last bool column ``__valid__`` (False for the plan's repeats)."""
        import pyarrow as pa

        arrays = [pa.array(c) if isinstance(c, np.ndarray) else c for c in self.columns]
        table = pa.Table.from_arrays(arrays, schema=self.schema)
        if self.valid is not None:
            table = table.append_column(VALID, pa.array(self.valid, type=pa.bool_()))
        return table


class Held:
    """One row group a worker holds: its schema and columns (numbers without nulls as numpy views
    of Arrow's memory, the rest as Arrow arrays), and once a batch took scattered rows of it, its
    numbers packed row by row (``packed``: a numpy array of one fixed-size record per row, the
    numpy columns dropped for it, so the row group's numbers are held once)."""

    __slots__ = ("schema", "columns", "packed", "record")

    def __init__(self, schema: Any, columns: list[Any]):
        self.schema, self.columns = schema, columns
        self.packed: np.ndarray | None = None
        self.record: np.dtype | None = None  # the packed record's fields: "k" for column k

    def numbers(self) -> list[int]:
        """The columns held as numbers (numpy, or packed)."""
        if self.record is not None:
            return [int(name) for name in self.record.names or ()]
        return [k for k, c in enumerate(self.columns) if isinstance(c, np.ndarray)]

    def pack(self) -> np.ndarray:
        """The numbers as one record per row (packed once, on the first scattered gather): a
        batch's rows are then one ``np.take`` of records (one memory access per row, not one
        per column), split into columns afterwards in cache."""
        if self.packed is None:
            numbers = self.numbers()
            record = np.dtype({"names": [str(k) for k in numbers], "formats": [self.columns[k].dtype for k in numbers]})
            rows = len(self.columns[numbers[0]]) if numbers else 0
            packed = np.empty(rows, dtype=record)
            for k in numbers:
                packed[str(k)] = self.columns[k]
                self.columns[k] = None
            self.record = record
            self.packed = packed.view(np.dtype((np.void, record.itemsize)))
        return self.packed

    def column(self, k: int) -> Any:
        """Column k whole: its numpy view or Arrow array, or a strided view of the packed records."""
        c = self.columns[k]
        if c is None:
            assert self.packed is not None and self.record is not None
            return self.packed.view(self.record)[str(k)]
        return c


class Blocks:
    """The Arrow row groups a worker holds while rows of theirs wait in the shuffle buffer or the
    batch being made; ``gather(refs)`` takes a batch's rows. A row group is freed once every row
    ref of it was gathered; the last batch's stay, and once a gather repeats rows (the last
    batches refilled after skipped rows, ``batch_samples``) nothing is freed any more.

    Each row group is held as columns (``Held``): numbers without nulls as numpy views of Arrow's
    memory (a batch of consecutive rows is a slice of them: no copy), the rest as Arrow arrays
    (an Arrow take: on plain arrays, never on a chunked one, which would join its chunks first).
    A batch of scattered rows (shuffled) packs the row group's numbers row by row first, once
    (``Held.pack``): its rows are then one take of records, wherever they sit in the row groups
    held (one memory access per row instead of one per column and row: a batch of 4096 shuffled
    rows of 8 columns took 1.3 ms as per-column takes and scatters, mostly cache misses)."""

    def __init__(self, pad: bool = False) -> None:
        self.pad = pad  # pad mode: gather says which rows are the plan's repeats (Rows.valid)
        self.tables: dict[int, Held] = {}
        self.left: dict[int, int] = {}
        self.next = 0
        self.names: dict[int, str] = {}
        self._last: dict[int, Held] = {}
        self._refilling = False
        self._records = Records()

    def add(self, table: Any, rows: int, name: str = "") -> int:
        """Hold ``table`` for ``rows`` refs to come; returns its block number."""
        b = self.next
        self.next += 1
        columns = []
        for column in table.combine_chunks().columns:
            array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            if _is_number(array.type) and array.null_count == 0:
                columns.append(array.to_numpy(zero_copy_only=True))
            else:
                columns.append(array)
        self.tables[b], self.left[b], self.names[b] = Held(table.schema, columns), rows, name
        return b

    def more(self, b: int, rows: int) -> None:
        self.left[b] += rows

    def gather(self, refs: Sequence[int]) -> Rows:
        """The rows ``refs`` point at, in ref order (and each row's source name when the blocks carry names: a mix)."""
        arr = refs if isinstance(refs, np.ndarray) else np.fromiter(refs, dtype=np.int64, count=len(refs))
        valid = None
        if self.pad:
            valid = (arr & REPEAT) == 0
            arr = arr & REF_MASK
        ids, rows = arr >> BLOCK_BITS, arr & ROW_MASK
        lo, hi = int(ids.min()), int(ids.max())
        if lo == hi:
            first = lo
            used, counts = [first], [len(rows)]
            held = self._block(first)
            start = int(rows[0])
            if int(rows[-1]) - start == len(rows) - 1 and (len(rows) < 2 or bool((np.diff(rows) == 1).all())):
                columns = [_slice(held, k, start, len(rows)) for k in range(len(held.columns))]
            else:
                columns = _scattered([held], rows, [None], self._records)
            names = [self.names[first]] * len(rows) if self.names[first] else None
        else:
            present = np.bincount(ids - lo)  # a batch's rows come from a few recent blocks
            used = (np.flatnonzero(present) + lo).tolist()
            cuts = np.flatnonzero(np.diff(arr) != 1) + 1 if arr[1] - arr[0] == 1 or arr[-1] - arr[-2] == 1 else None
            if cuts is not None and len(cuts) == len(used) - 1:  # each block's rows one consecutive run (no shuffle): slices joined
                starts = [0, *cuts.tolist()]
                counts = np.diff([*starts, len(arr)]).tolist()
                used = ids[starts].tolist()
                columns = _joined([self._block(b) for b in used], rows[starts].tolist(), counts)
            else:
                main = lo + int(np.argmax(present))  # most of the batch's rows: taken for every position, the others' put over
                used = [main, *(b for b in used if b != main)]
                where = [None, *(np.flatnonzero(ids == b) for b in used[1:])]
                columns = _scattered([self._block(b) for b in used], rows, where, self._records)
                counts = [int(present[b - lo]) for b in used]
            names = [self.names[b] for b in ids.tolist()] if self.names[used[0]] else None
        schema = self._block(used[0]).schema
        if not self._refilling and any(b not in self.tables for b in used):
            self._refilling = True  # rows gathered before come again (batches refilled after skipped rows): free nothing from now on
        if not self._refilling:
            self._last = {}
        for b, n in zip(used, counts):
            self._last[b] = self._block(b)
            left = self.left.get(b)
            if left is not None:
                left -= int(n)
                if left <= 0:
                    del self.tables[b], self.left[b]
                else:
                    self.left[b] = left
        return Rows(schema, columns, names, valid)

    def _block(self, b: int) -> Held:
        found = self.tables.get(b)
        return found if found is not None else self._last[b]


def _slice(held: Held, k: int, start: int, n: int) -> Any:
    """Rows [start, start + n) of column k: a view (numpy or Arrow), a copy from packed records."""
    c = held.columns[k]
    if c is None:
        return np.ascontiguousarray(held.column(k)[start : start + n])
    return c[start : start + n] if isinstance(c, np.ndarray) else c.slice(start, n)


def _joined(helds: list[Held], starts: list[int], counts: list[int]) -> list[Any]:
    """A batch's columns from one consecutive run of rows per block, in block order (an unshuffled
    batch across row groups): the runs' slices joined."""
    import pyarrow as pa

    columns = []
    for k in range(len(helds[0].columns)):
        parts = [_slice(h, k, a, n) for h, a, n in zip(helds, starts, counts)]
        if all(isinstance(p, np.ndarray) for p in parts):
            columns.append(np.concatenate(parts))
        else:
            columns.append(pa.concat_arrays([pa.array(p) if isinstance(p, np.ndarray) else p for p in parts]))
    return columns


class Records:
    """The gathered records of the latest scattered batch, kept for the next one (the same record
    type and at most as many rows): their columns' strided views made once, so a batch's columns
    are copies out of them with no field look-up per batch (8 columns: ~6 ns a row of a batch of
    4,096 went to numpy's field views); one batch of records held, as a batch of columns."""

    __slots__ = ("record", "got", "fields")

    def __init__(self) -> None:
        self.record: np.dtype | None = None
        self.got: np.ndarray | None = None
        self.fields: dict[int, np.ndarray] = {}

    def buffer(self, record: np.dtype, void: np.dtype, n: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """Room for n records of ``void`` (``record``'s bytes) and each field's view of it."""
        if self.got is None or self.record != record or len(self.got) < n:
            self.got = np.empty(n, dtype=void)
            self.record = record
            records = self.got.view(record)
            self.fields = {int(name): records[name] for name in record.names or ()}
        return self.got[:n], self.fields


def _scattered(helds: list[Held], rows: np.ndarray, where: list[np.ndarray | None], scratch: Records) -> list[Any]:
    """A batch's columns from scattered rows: the batch's i-th row is row ``rows[i]`` of its block;
    ``helds[j]`` (j >= 1) holds the rows at the batch's positions ``where[j]``, ``helds[0]`` those
    at every other position (``where[0]`` is None). Numbers come from packed records: one take
    from ``helds[0]`` for the whole batch into ``scratch`` (positions of other blocks clipped,
    then overwritten), the other blocks' records put over theirs, each column then copied out of
    the records in cache; columns that are numbers in some blocks only, or not numbers, column
    by column."""
    import pyarrow as pa

    n = len(rows)
    columns: list[Any] = [None] * len(helds[0].columns)
    numbers = helds[0].numbers()
    if numbers and all(h.numbers() == numbers for h in helds):
        packed = [h.pack() for h in helds]
        record = helds[0].record
        if record is not None and all(h.record == record for h in helds):
            got, fields = scratch.buffer(record, packed[0].dtype, n)
            np.take(packed[0], rows, mode="clip", out=got)  # (clip: unbuffered; a ref's row is in its block, by table_refs)
            for p, w in zip(packed[1:], where[1:]):
                got[w] = np.take(p, rows[w])
            for k in numbers:
                columns[k] = fields[k][:n].copy()
    main: np.ndarray | None = None  # helds[0]'s positions, when a column needs them
    back = None
    for k in range(len(columns)):
        if columns[k] is not None:
            continue
        held = [h.column(k) for h in helds]
        if len(held) == 1:
            c = held[0]
            columns[k] = c[rows] if isinstance(c, np.ndarray) else c.take(pa.array(rows))
        elif all(isinstance(c, np.ndarray) for c in held):
            out = np.take(held[0], rows, mode="clip")
            for c, w in zip(held[1:], where[1:]):
                out[w] = c[rows[w]]
            columns[k] = out
        else:
            if main is None:
                mask = np.ones(n, dtype=bool)
                for w in where[1:]:
                    mask[w] = False
                main = np.flatnonzero(mask)
            spots: list[np.ndarray] = [main, *(w for w in where[1:] if w is not None)]
            back = pa.array(np.argsort(np.concatenate(spots))) if back is None else back
            parts = [pa.array(c[rows[w]]) if isinstance(c, np.ndarray) else c.take(pa.array(rows[w])) for c, w in zip(held, spots)]
            columns[k] = pa.concat_arrays(parts).take(back)
    return columns


def table_refs(
    source: TableSource,
    ranges: Sequence[Range],
    blocks: Blocks,
    *,
    policy: ErrorPolicy | None = None,
    name: str = "",
    planned: PlannedGroups | None = None,
) -> Iterator[np.ndarray]:
    """The rows of the ranges as row refs into ``blocks`` (one block per row group read): an int64
    array per range (the shuffle and the batches take arrays whole, see ``batch_refs``)."""
    block = -1
    for rng, table, new in read_groups(source, ranges, policy, planned):
        if new:
            block = blocks.add(table, len(rng), name)
        else:
            blocks.more(block, len(rng))
        base = block << BLOCK_BITS
        yield np.arange(base + rng.start, base + rng.stop, dtype=np.int64)


def batch_refs(
    chunks: Iterable[Any], *, batch_size: int, num_batches: int, collate: Callable[[np.ndarray], Any], stats: BatchStats, pad: bool
) -> Iterator[Any]:
    """``batch_samples`` for row refs (int64 arrays, or lists in a mix): exactly ``num_batches``
    batches of ``batch_size`` refs, each an array slice handed to ``collate``; refilled the same
    way when rows were skipped (from the last full batch and the rest, in order; in pad mode the
    copies carry the REPEAT bit, as ``batch._repeat`` marks a sample's copy)."""
    pending = np.empty(0, dtype=np.int64)
    recent = pending
    made = 0
    chunks = iter(chunks)
    for chunk in chunks:
        refs = chunk if isinstance(chunk, np.ndarray) else np.asarray(chunk, dtype=np.int64)
        pending = np.concatenate([pending, refs]) if len(pending) else refs
        start = 0
        while len(pending) - start >= batch_size:
            recent = pending[start : start + batch_size]
            yield collate(recent)
            start += batch_size
            made += 1
            if made == num_batches:
                finish_upstream(chunks, len(pending) - start)
                return
        pending = pending[start:]
    if made < num_batches:
        pool = np.concatenate([recent, pending])
        if not len(pool):
            raise TooManyErrors(
                f"no sample could be read for this worker: all of its samples failed and were skipped, "
                f"so its {num_batches} batches cannot be filled (see the warnings above for why)"
            )
        missing = (num_batches - made) * batch_size - len(pending)
        stats.refilled += missing
        logger.warning("repeating %d samples to keep %d equal batches (samples were skipped or filtered)", missing, num_batches)
        copies = pool[np.arange(missing) % len(pool)]
        every = np.concatenate([pending, copies | REPEAT if pad else copies])
        for a in range(0, len(every), batch_size):
            yield collate(every[a : a + batch_size])


_READ_ONLY_SEEN = False  # torch warned (silenced) about a read-only array once in this process


def tensor_of(array: np.ndarray) -> Any:
    """``torch.from_numpy(array)``, sharing its memory, without torch's "not writable" warning for
    Arrow's read-only buffers: torch gives that warning once per process (TORCH_WARN_ONCE), so
    the first read-only array goes through a ``catch_warnings`` that ignores it and later ones go
    straight through (every one while ``torch.set_warn_always(True)``). The user's own warning
    filters are left as they are, and no other warning is hidden."""
    import torch

    global _READ_ONLY_SEEN
    if array.flags.writeable or (_READ_ONLY_SEEN and not torch.is_warn_always_enabled()):
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        tensor = torch.from_numpy(array)
    if not array.flags.writeable:
        _READ_ONLY_SEEN = True
    return tensor


def column_value(column: Any, image: Callable[[Any], Any] | None = None) -> Any:
    """One column of a batch (an Arrow array): a tensor for fixed-width numbers without nulls
    (zero-copy from Arrow), a 2-D tensor for fixed-size lists of them (embeddings), decoded images
    (stacked when they share a shape) for image columns, else a list of Python values."""
    import pyarrow as pa
    import torch

    t = column.type
    if image is not None:
        values = [image(v) for v in column.to_pylist()]
        if values and all(isinstance(v, torch.Tensor) for v in values) and all(v.shape == values[0].shape for v in values):
            return stack_tensors(values)
        return values
    if column.null_count == 0:
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            return tensor_of(column.to_numpy(zero_copy_only=True))
        if pa.types.is_boolean(t):
            return tensor_of(column.to_numpy(zero_copy_only=False))
        if pa.types.is_fixed_size_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
            values = column.flatten()
            if values.null_count == 0:
                return tensor_of(values.to_numpy(zero_copy_only=True).reshape(len(column), t.list_size))
    return column.to_pylist()


def columnar_batch(rows: Rows, images: Mapping[str, Callable[[Any], Any]]) -> Batch:
    """A batch's rows as a Batch of columns: numbers as tensors sharing the gathered memory, the
    rest by ``column_value``; a mix's batch also says ``__source__`` per row, a pad-mode batch
    ``__valid__`` (a bool tensor, False for the plan's repeats, as per-row batches carry it).
    Tensors of consecutive rows are read-only views of Arrow's memory (``tensor_of``: torch's
    warning about that never reaches the user; a batch is read, or copied before writing)."""
    import torch

    out = Batch()
    for name, column in zip(rows.schema.names, rows.columns):
        if isinstance(column, np.ndarray):
            out[name] = tensor_of(column)
            continue
        try:
            out[name] = column_value(column, images.get(name))
        except SampleError:
            raise
        except Exception as exc:
            if name not in images:
                raise
            raise SampleError("?", "?", f"cannot decode image column {name!r}: {type(exc).__name__}: {exc}") from exc
    if rows.sources is not None:
        out["__source__"] = rows.sources
    if rows.valid is not None:
        out[VALID] = torch.from_numpy(rows.valid)  # (a fresh, writable array)
    return out
