"""Parquet tables as sources: a table manifest built from the files' footers alone, and the rows of
one row group read as an Arrow table, fetching only the projected columns' chunks.

Planning needs counts per "shard"; a table gives them per row group, so **a row group is planned
like a shard and a row like a sample** (``TableManifest`` is a ``Manifest`` whose shards are row
groups: ``counts`` are rows per row group, ``sizes`` their compressed bytes, ``paths`` their
files' paths). Nothing else of the plan, the shuffle or resume changes.

The manifest comes from footers only: per file one ranged read of its last ``TAIL_READ`` bytes (a
second one when the footer is larger), never a data page. It can be written once as JSON
(``kind: "parquet"``, docs/manifest.md) by ``shardstream index``, so a large table is not
re-footered at every start; a footer is then read once per file per process, when its first row
group is read, and checked against the manifest (a file whose rows changed is a ShardFormatError).

Reading row group g of a file fetches the byte runs of its selected column chunks (adjacent chunks
merged: one ranged request per run) through ``storage.ranges.open_range`` (retries, deadline,
counters), and pyarrow decodes them from a sparse file that serves only those runs
(``SparseFile``); a read outside them (a writer whose chunk sizes are off) is fetched on demand.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardstream.errors import ConfigError, ManifestError, ShardFormatError, SourceError, StorageError, StorageNotFound
from shardstream.format.manifest import FORMAT_NAME, FORMAT_VERSION, Manifest
from shardstream.storage import fs as storage
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.ranges import open_range
from shardstream.version import __version__

SUFFIXES = (".parquet", ".pq", ".parq")
KIND = "parquet"
MAGIC = b"PAR1"
TAIL_READ = 64 << 10  # a file's last bytes read at once: the footer of most files, in one request
FOOTERS_KEPT = 256  # parsed footers kept per process (one per file being read is all a worker needs)
INDEX_THREADS = 8


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``, or a ConfigError saying how to install it (an optional extra)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError("reading Parquet tables needs pyarrow: pip install 'shardstream[tables]'") from exc
    return pq


def is_table_url(url: str) -> bool:
    """A Parquet file or a pattern of them, by its name (``.parquet``, ``.pq``, ``.parq``)."""
    return url.rstrip("/").lower().endswith(SUFFIXES)


@dataclass(frozen=True)
class Table:
    """A Parquet table as a source, wherever a dataset URL is accepted (``ShardStream(Table(...))``,
    ``Source(Table(...), weight=...)``).

    ``url``: a ``.parquet`` file, a folder or prefix holding ``.parquet`` files (``s3://b/table/``,
    its files listed once, not recursively), a glob (``s3://b/t/part-*.parquet``), a list of them,
    ``hf://datasets/ORG/NAME/...``, or a table manifest written by ``shardstream index`` (the
    folder it is in). ``columns``: the columns to read (None: all); only their bytes are fetched.
    A plain URL ending in ``.parquet`` (or a folder of them without ``index.json``) is a Table
    with all its columns."""

    url: str | Sequence[str]
    columns: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.columns is not None:
            if isinstance(self.columns, str) or not all(isinstance(c, str) for c in self.columns):
                raise ConfigError(f"Table(columns=...) is a list of column names, got {self.columns!r}")
            object.__setattr__(self, "columns", tuple(self.columns))
            if not self.columns:
                raise ConfigError("Table(columns=...) names at least one column (None reads them all)")

    @property
    def label(self) -> str:
        return self.url if isinstance(self.url, str) else ",".join(self.url)


class TableManifest(Manifest):
    """A Parquet table's manifest: its files, and per row group (a "shard" to the planner) its
    file, its index in that file and its rows (``counts``). ``columns`` lists the table's
    top-level columns as ``(name, arrow type)``; ``projection`` the columns a stream reads (None:
    all). ``file_url(f)`` is file f's URL; ``group_file``/``group_index`` map a row group to its
    file and its index there, ``group_first_row`` to its first row's number in its file."""

    kind = KIND

    def __init__(
        self,
        files: Sequence[str],
        file_sizes: Sequence[int] | np.ndarray,
        footer_sizes: Sequence[int] | np.ndarray,
        group_rows: Sequence[Sequence[int]],
        group_spans: Sequence[Sequence[tuple[int, int]]],
        columns: Sequence[tuple[str, str]],
        *,
        base_url: str = "",
        created: str = "",
        shardstream_version: str = "",
        footer_sha256: Sequence[str] | None = None,
    ):
        super().__init__(base_url=base_url, created=created, shardstream_version=shardstream_version)
        self.files = list(files)
        # per file, the sha256 of its footer's bytes when indexed ("": an index written before it was recorded)
        self.footer_sha256 = [str(d) for d in footer_sha256] if footer_sha256 is not None else [""] * len(self.files)
        self.file_sizes = np.asarray(file_sizes, dtype=np.int64).reshape(len(self.files))
        self.footer_sizes = np.asarray(footer_sizes, dtype=np.int64).reshape(len(self.files))
        self.columns = [(str(n), str(t)) for n, t in columns]
        self.projection: tuple[str, ...] | None = None
        self.group_rows = [list(map(int, r)) for r in group_rows]
        per_file = [len(r) for r in self.group_rows]
        self.group_file = np.repeat(np.arange(len(self.files), dtype=np.int64), per_file)
        self.group_index = np.concatenate([np.arange(n, dtype=np.int64) for n in per_file]) if per_file else np.zeros(0, np.int64)
        counts = np.array([n for r in self.group_rows for n in r], dtype=np.int64)
        firsts = [np.concatenate([[0], np.cumsum(r, dtype=np.int64)[:-1]]) if r else np.zeros(0, np.int64) for r in self.group_rows]
        self.group_first_row = np.concatenate(firsts).astype(np.int64) if firsts else np.zeros(0, np.int64)
        spans = np.array([s for f in group_spans for s in f], dtype=np.int64).reshape(len(counts), 2)
        paths = [self.files[f] for f in self.group_file.tolist()]
        self._set_arrays(paths, counts, spans[:, 1] - spans[:, 0], [None] * len(counts), spans, None, {})

    def file_url(self, f: int) -> str:
        return self.resolve(self.files[f])

    def group_name(self, g: int) -> str:
        return f"{self.file_url(int(self.group_file[g]))} row group {int(self.group_index[g])}"

    @property
    def column_names(self) -> list[str]:
        return [n for n, _ in self.columns]

    def select(self, columns: Sequence[str] | None) -> TableManifest:
        """This table reading only ``columns`` (None: all); ConfigError names an unknown one."""
        out = _copy(self)
        if columns is None:
            out.projection = None
            return out
        known = self.column_names
        missing = [c for c in columns if c not in known]
        if missing:
            raise ConfigError(f"{self.base_url or self.file_url(0) if self.files else 'table'}: no column {missing[0]!r}; the table has {known}")
        out.projection = tuple(columns)
        return out

    # -- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        spans = self.spans.tolist()
        k = 0
        starts, sizes = [], []
        for rows in self.group_rows:
            starts.append([s[0] for s in spans[k : k + len(rows)]])
            sizes.append([s[1] - s[0] for s in spans[k : k + len(rows)]])
            k += len(rows)
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "kind": KIND,
            "shardstream_version": self.shardstream_version or __version__,
            "created": self.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "total_samples": self.total_samples,
            "total_bytes": int(self.file_sizes.sum()),
            "columns": [{"name": n, "type": t} for n, t in self.columns],
            "files": {
                "path": self.files,
                "bytes": self.file_sizes.tolist(),
                "footer_bytes": self.footer_sizes.tolist(),
                **({"footer_sha256": self.footer_sha256} if any(self.footer_sha256) else {}),
                "group_rows": self.group_rows,
                "group_start": starts,
                "group_bytes": sizes,
            },
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), separators=(",", ":")) + "\n").encode()

    @classmethod
    def from_json(cls, doc: Any, where: str) -> TableManifest:
        """A ``kind: "parquet"`` manifest, checked; ManifestError names ``where`` and what is wrong."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME or doc.get("kind") != KIND:
            raise ManifestError(f'{where}: not a shardstream table manifest (no "format": "{FORMAT_NAME}", "kind": "{KIND}")')
        files, columns = doc.get("files"), doc.get("columns")
        names = ("path", "bytes", "footer_bytes", "group_rows", "group_start", "group_bytes")
        if not isinstance(files, dict) or not all(isinstance(files.get(n), list) for n in names):
            raise ManifestError(f"{where}: 'files' must hold the lists {', '.join(names)}")
        n = len(files["path"])
        if any(len(files[name]) != n for name in names):
            raise ManifestError(f"{where}: 'files' lists must have {n} entries, one per file")
        if not isinstance(columns, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in columns):
            raise ManifestError(f"{where}: 'columns' must list {{'name', 'type'}} objects")
        try:
            paths = files["path"]
            if not all(isinstance(p, str) and p for p in paths) or len(set(paths)) != n:
                raise ValueError("'files.path' must list distinct paths")
            ints = {name: [int(x) for x in files[name]] for name in ("bytes", "footer_bytes")}
            rows = [[_count(x) for x in r] for r in files["group_rows"]]
            spans = [
                [(_count(a), _count(a) + _count(b)) for a, b in zip(s, z, strict=True)]
                for s, z in zip(files["group_start"], files["group_bytes"], strict=True)
            ]
            if any(len(r) != len(s) for r, s in zip(rows, spans)):
                raise ValueError("'group_rows', 'group_start' and 'group_bytes' must have one entry per row group")
            digests = files.get("footer_sha256")  # (absent from indexes written before shardstream recorded it)
            if digests is not None and (not isinstance(digests, list) or len(digests) != n or not all(isinstance(d, str) for d in digests)):
                raise ValueError(f"'files.footer_sha256' must list {n} hex strings, one per file")
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: {exc}") from exc
        manifest = cls(
            paths,
            ints["bytes"],
            ints["footer_bytes"],
            rows,
            spans,
            [(c["name"], str(c.get("type", ""))) for c in columns],
            created=doc.get("created", ""),
            shardstream_version=doc.get("shardstream_version", ""),
            footer_sha256=digests,
        )
        total = doc.get("total_samples")
        if total is not None and total != manifest.total_samples:
            raise ManifestError(f"{where}: total_samples says {total} but the row groups add up to {manifest.total_samples}")
        return manifest


def _count(x: Any) -> int:
    if type(x) is not int or x < 0:
        raise ValueError(f"{x!r} is not a non-negative integer")
    return x


def _copy(m: TableManifest) -> TableManifest:
    out = TableManifest.__new__(TableManifest)
    out.__dict__.update(m.__dict__)
    return out


# -- footers ---------------------------------------------------------------------------------------
class _Footers:
    """Parsed footers of this process, by (url, file size, footer size): a bounded LRU, thread-safe."""

    def __init__(self, limit: int):
        self._limit = limit
        self._items: OrderedDict[tuple[str, int, int], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.loading = threading.Lock()  # held while a footer is read

    def get(self, key: tuple[str, int, int]) -> Any:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def put(self, key: tuple[str, int, int], metadata: Any) -> None:
        with self._lock:
            self._items[key] = metadata
            self._items.move_to_end(key)
            while len(self._items) > self._limit:
                self._items.popitem(last=False)


FOOTERS = _Footers(FOOTERS_KEPT)


def read_bytes(
    url: str, start: int, end: int, storage_options: Mapping[str, Any] | None, *, config: StorageConfig, counters: Any = None
) -> bytes | bytearray:
    """Bytes [start, end) of ``url`` through the storage layer (one ranged request on S3)."""
    read, close = open_range(url, start, end, storage_options, counters, config=config, hint="")
    try:
        out = bytearray(end - start)
        view = memoryview(out)
        got = 0
        into = getattr(read, "readinto", None)
        while got < len(out):
            if into is not None:
                n = into(view[got:])
            else:
                chunk = read(len(out) - got)
                n = len(chunk)
                view[got : got + n] = chunk
            if not n:
                what = f"the file ends at byte {start + got}, before byte {end} (truncated, or changed since it was indexed)"
                raise ShardFormatError(url, start + got, what)
            got += n
        return bytes(out) if len(out) < 4096 else out
    finally:
        close()


def parse_footer(url: str, tail: bytes, size: int) -> tuple[Any, int]:
    """``(FileMetaData, footer bytes + 8)`` from a file's last bytes; ShardFormatError if they are not a Parquet footer."""
    pa_parquet = pyarrow_parquet()
    import pyarrow as pa

    if size < 12 or tail[-4:] != MAGIC:
        raise ShardFormatError(url, size - 4, f"not a Parquet file: its {size} bytes do not end in {MAGIC!r} (corrupt or truncated)")
    length = int.from_bytes(tail[-8:-4], "little") + 8
    if length > size - 4:
        raise ShardFormatError(url, size - 8, f"the Parquet footer says it is {length - 8} bytes, more than the file's {size} (corrupt or truncated)")
    try:
        return pa_parquet.read_metadata(pa.BufferReader(tail[-length:])), length
    except (pa.ArrowException, OSError) as exc:
        raise ShardFormatError(url, size - length, f"cannot parse the Parquet footer ({str(exc).splitlines()[0]})") from exc


def footer_digest(tail: bytes | bytearray, length: int) -> str:
    """The sha256 of a file's last ``length`` bytes (its footer, length and magic): with its size,
    the cheap identity of a Parquet file a table index records (``check_table_files``)."""
    return hashlib.sha256(memoryview(tail)[len(tail) - length :]).hexdigest()


def read_footer(url: str, size: int, storage_options: Mapping[str, Any] | None, *, config: StorageConfig, counters: Any = None) -> tuple[Any, int]:
    """A file's parsed footer: its last TAIL_READ bytes (and the rest of the footer when it is larger)."""
    metadata, length, _ = read_footer_digest(url, size, storage_options, config=config, counters=counters)
    return metadata, length


def read_footer_digest(
    url: str, size: int, storage_options: Mapping[str, Any] | None, *, config: StorageConfig, counters: Any = None
) -> tuple[Any, int, str]:
    """``read_footer`` and the footer's ``footer_digest``."""
    first = min(size, TAIL_READ)
    tail = read_bytes(url, size - first, size, storage_options, config=config, counters=counters)
    if len(tail) >= 8 and tail[-4:] == MAGIC:
        length = int.from_bytes(tail[-8:-4], "little") + 8
        if first < length <= size - 4:
            tail = read_bytes(url, size - length, size - first, storage_options, config=config, counters=counters) + bytes(tail)
    metadata, length = parse_footer(url, bytes(tail), size)
    return metadata, length, footer_digest(tail, length)


def footer_for(m: TableManifest, f: int, storage_options: Mapping[str, Any] | None, *, config: StorageConfig, counters: Any = None) -> Any:
    """File f's footer (cached per process), checked against the manifest: a file whose size or row
    groups changed since it was indexed is a ShardFormatError."""
    url, size, length = m.file_url(f), int(m.file_sizes[f]), int(m.footer_sizes[f])
    key = (url, size, length)
    metadata = FOOTERS.get(key)
    if metadata is not None:
        return metadata
    with FOOTERS.loading:  # one read per footer: the read-ahead thread and the reader may both want it
        metadata = FOOTERS.get(key)
        if metadata is not None:
            return metadata
        return _load_footer(m, f, storage_options, config=config, counters=counters)


def _load_footer(m: TableManifest, f: int, storage_options: Mapping[str, Any] | None, *, config: StorageConfig, counters: Any) -> Any:
    url, size, length = m.file_url(f), int(m.file_sizes[f]), int(m.footer_sizes[f])
    stale = "changed since the table was indexed: index it again (`shardstream index`), or pass the files themselves"
    try:
        tail = read_bytes(url, size - length, size, storage_options, config=config, counters=counters)
        metadata, found = parse_footer(url, tail, size)
    except ShardFormatError as exc:
        raise ShardFormatError(url, exc.offset, f"{exc.what}; the file {stale}") from exc
    if found != length:
        raise ShardFormatError(url, size - length, f"its footer is {found - 8} bytes, the manifest says {length - 8}: the file {stale}")
    rows = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    if rows != m.group_rows[f]:
        raise ShardFormatError(url, size - length, f"it has row groups of {rows} rows, the manifest says {m.group_rows[f]}: the file {stale}")
    FOOTERS.put((url, size, length), metadata)
    return metadata


def check_table_files(
    m: TableManifest, storage_options: Mapping[str, Any] | None, *, config: StorageConfig = DEFAULT_STORAGE, threads: int = INDEX_THREADS
) -> None:
    """Check a table index against its files (``threads`` at once): each file's footer, read at the
    size and footer length the index recorded (one ranged read of the footer alone, no data page),
    must hash to the recorded ``footer_sha256`` (when recorded: older indexes lack it) and hold
    the index's row groups and columns. A ManifestError names the first file that changed and
    what changed: rows the index does not know are never dropped, a replaced file never read."""
    pyarrow_parquet()
    todo = list(range(len(m.files)))
    if len(todo) > 1 and threads > 1:
        with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="shardstream-footers") as pool:
            list(pool.map(lambda f: _check_file(m, f, storage_options, config), todo))
    else:
        for f in todo:
            _check_file(m, f, storage_options, config)


def _check_file(m: TableManifest, f: int, storage_options: Mapping[str, Any] | None, config: StorageConfig) -> None:
    url, size, length = m.file_url(f), int(m.file_sizes[f]), int(m.footer_sizes[f])
    again = "changed since the table was indexed: index it again (`shardstream index`)"
    try:
        tail = read_bytes(url, max(0, size - length), size, storage_options, config=config)
        metadata, found = parse_footer(url, bytes(tail), size)
        if found != length:
            raise ShardFormatError(url, size - found, "its footer's length differs")
    except StorageNotFound as exc:
        raise ManifestError(f"{url}: listed in the table index but cannot be read ({exc})") from exc
    except ShardFormatError as exc:
        now = _size_now(url, storage_options, config)
        what = (
            f"it is {now} bytes, the index says {size}"
            if now is not None and now != size
            else f"its last {length} bytes are not the footer the index recorded"
        )
        raise ManifestError(f"{url}: {what}: the file {again}") from exc
    digest = m.footer_sha256[f]
    if digest and footer_digest(tail, length) != digest:
        raise ManifestError(
            f"{url}: its footer's sha256 is {footer_digest(tail, length)}, the index recorded {digest} (same size, other bytes): the file {again}"
        )
    rows = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    if rows != m.group_rows[f]:
        raise ManifestError(
            f"{url}: its footer says {sum(rows)} rows in row groups of {rows}, "
            f"the index says {sum(m.group_rows[f])} in {m.group_rows[f]}: the file {again}"
        )
    columns = [(field.name, str(field.type)) for field in metadata.schema.to_arrow_schema()]
    if columns != m.columns:
        known = dict(m.columns)
        changed = [f"column {n!r} is {t} in the file, {known[n]} in the index" for n, t in columns if n in known and known[n] != t]
        changed += [f"column {n!r} is not in the index" for n, _ in columns if n not in known]
        changed += [f"the index's column {n!r} is not in the file" for n in known if n not in dict(columns)]
        raise ManifestError(f"{url}: {'; '.join(changed) or 'its columns are in another order'}: the file {again}")
    FOOTERS.put((url, size, length), metadata)  # read once: the first row group's read takes it from here


def _size_now(url: str, storage_options: Mapping[str, Any] | None, config: StorageConfig) -> int | None:
    try:
        return int(storage.storage_call(url, lambda fs, path: fs.size(path), storage_options, config))
    except (StorageError, OSError):
        return None


# -- building the manifest -----------------------------------------------------------------------
def list_table_files(url: str | Sequence[str], storage_options: Mapping[str, Any] | None, config: StorageConfig) -> tuple[str, list[tuple[str, int]]]:
    """``(base, [(url, size), ...])``: the Parquet files a table URL names (a file, a glob, a folder
    or prefix of .parquet files, or a list of those), sorted within each pattern, with their sizes.
    ``base`` is the folder they are under when the table is one folder or glob, else ''."""
    patterns = [url] if isinstance(url, str) else list(url)
    found: list[tuple[str, int]] = []
    base = ""
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            files = storage.storage_call(pattern, _glob, storage_options, config)
            if len(patterns) == 1:
                base = pattern.rsplit("/", 1)[0]
        elif is_table_url(pattern):
            files = [(pattern, storage.storage_call(pattern, lambda fs, path: int(fs.size(path)), storage_options, config))]
        else:
            files = storage.storage_call(pattern, _folder, storage_options, config)
            if len(patterns) == 1:
                base = pattern.rstrip("/")
        if not files:
            raise ConfigError(f"no Parquet files (.parquet, .pq, .parq) at {pattern!r}: name the files, a glob, or the folder that holds them")
        found += files
    urls = [u for u, _ in found]
    if len(set(urls)) != len(urls):
        raise ConfigError(f"a Parquet file is named twice in {url!r}")
    return base, found


def _glob(fs: Any, path: str) -> list[tuple[str, int]]:
    found = sorted(fs.glob(path, detail=True).items())
    return [(storage.full_url(fs, p), int(info["size"])) for p, info in found if info.get("type") != "directory"]


def _folder(fs: Any, path: str) -> list[tuple[str, int]]:
    entries = sorted(fs.ls(path, detail=True), key=lambda e: e["name"])
    return [(storage.full_url(fs, e["name"]), int(e["size"])) for e in entries if is_table_url(e["name"]) and e.get("type") != "directory"]


def index_table(
    url: str | Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    config: StorageConfig = DEFAULT_STORAGE,
    threads: int = INDEX_THREADS,
    counters: Any = None,
) -> TableManifest:
    """A table's manifest from its files' footers (``threads`` files at once; no data page read).
    The footers stay parsed in this process (and in DataLoader workers forked from it)."""
    pyarrow_parquet()
    base, files = list_table_files(url, storage_options, config)

    def footer(item: tuple[str, int]) -> tuple[Any, int, str]:
        file_url, size = item
        try:
            return read_footer_digest(file_url, size, storage_options, config=config, counters=counters)
        except StorageNotFound as exc:
            raise ManifestError(f"{file_url}: listed but cannot be read ({exc})") from exc

    if len(files) > 1 and threads > 1:
        with ThreadPoolExecutor(min(threads, len(files)), thread_name_prefix="shardstream-footers") as pool:
            footers = list(pool.map(footer, files))
    else:
        footers = [footer(f) for f in files]
    schema = None
    rows, spans = [], []
    for (file_url, size), (metadata, length, _) in zip(files, footers):
        arrow = metadata.schema.to_arrow_schema()
        if schema is None:
            schema = arrow
        elif not arrow.equals(schema, check_metadata=False):
            raise ManifestError(f"{file_url}: its schema differs from the first file's ({files[0][0]}): {arrow} vs {schema}")
        rows.append([metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)])
        spans.append([group_span(metadata.row_group(i)) for i in range(metadata.num_row_groups)])
        FOOTERS.put((file_url, size, length), metadata)
    paths = [u[len(base) + 1 :] if base and u.startswith(base + "/") else u for u, _ in files]
    assert schema is not None
    return TableManifest(
        paths,
        [s for _, s in files],
        [length for _, length, _ in footers],
        rows,
        spans,
        [(f.name, str(f.type)) for f in schema],
        base_url=base,
        footer_sha256=[digest for _, _, digest in footers],
    )


def chunk_span(column: Any) -> tuple[int, int]:
    """Bytes [start, end) of a column chunk: its dictionary page (if any) through its last data page."""
    start = column.data_page_offset
    if column.has_dictionary_page and column.dictionary_page_offset is not None and 0 < column.dictionary_page_offset < start:
        start = column.dictionary_page_offset
    return int(start), int(start + column.total_compressed_size)


def group_span(group: Any) -> tuple[int, int]:
    spans = [chunk_span(group.column(c)) for c in range(group.num_columns)]
    return (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0, 0)


# -- reading a row group ---------------------------------------------------------------------------
def leaf_counts(schema: Any) -> list[int]:
    """How many Parquet leaf columns each top-level Arrow field has (a struct: its fields' leaves)."""
    import pyarrow as pa

    def leaves(t: Any) -> int:
        if pa.types.is_struct(t):
            return sum(leaves(t.field(i).type) for i in range(t.num_fields))
        if pa.types.is_map(t):
            return leaves(t.key_type) + leaves(t.item_type)
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            return leaves(t.value_type)
        return 1

    return [leaves(f.type) for f in schema]


def group_runs(metadata: Any, index: int, columns: Sequence[str] | None) -> list[tuple[int, int]]:
    """Byte runs [a, b) holding row group ``index``'s chunks of ``columns`` (None: all), adjacent ones merged."""
    schema = metadata.schema.to_arrow_schema()
    counts = leaf_counts(schema)
    wanted = set(schema.names if columns is None else columns)
    group = metadata.row_group(index)
    spans = []
    leaf = 0
    for field, n in zip(schema, counts):
        if field.name in wanted:
            spans += [chunk_span(group.column(c)) for c in range(leaf, leaf + n)]
        leaf += n
    runs: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if runs and a <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(b, runs[-1][1]))
        else:
            runs.append((a, b))
    return runs


class SparseFile(io.RawIOBase):
    """A read-only file of ``size`` bytes that holds only some runs of them (``{start: bytes}``);
    a read outside them asks ``fetch(a, b)`` (counted like any read) and keeps what it got."""

    def __init__(self, size: int, runs: dict[int, Any], fetch: Callable[[int, int], Any]):
        super().__init__()
        self._size = size
        self._runs = sorted(runs.items())
        self._fetch = fetch
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        return self._size

    def read(self, n: int = -1) -> Any:
        a = self._pos
        b = self._size if n is None or n < 0 else min(self._size, a + n)
        if b <= a:
            return b""
        for start, data in self._runs:
            if start <= a and b <= start + len(data):
                self._pos = b
                return memoryview(data)[a - start : b - start]
        data = self._fetch(a, b)
        self._runs.append((a, data))
        self._pos = a + len(data)
        return data

    def readall(self) -> bytes:
        return bytes(self.read(-1))


def read_group(
    m: TableManifest,
    g: int,
    storage_options: Mapping[str, Any] | None,
    *,
    config: StorageConfig = DEFAULT_STORAGE,
    counters: Any = None,
    fetch: Callable[[list[tuple[int, int]]], list[Any]] | None = None,
) -> Any:
    """Row group ``g`` (a manifest shard) as an Arrow table of the projected columns. ``fetch(runs)``
    returns the runs' bytes (read-ahead); by default each run is one ranged read."""
    pq = pyarrow_parquet()
    import pyarrow as pa

    f, index = int(m.group_file[g]), int(m.group_index[g])
    url = m.file_url(f)
    metadata = footer_for(m, f, storage_options, config=config, counters=counters)
    runs = group_runs(metadata, index, m.projection)

    def one(a: int, b: int) -> Any:
        return read_bytes(url, a, b, storage_options, config=config, counters=counters)

    got = fetch(runs) if fetch is not None else [one(a, b) for a, b in runs]
    sparse = SparseFile(int(m.file_sizes[f]), {a: data for (a, _), data in zip(runs, got)}, one)
    try:
        # One thread: a DataLoader worker is one process per core already.
        table = pq.ParquetFile(sparse, metadata=metadata, pre_buffer=False).read_row_group(
            index, columns=list(m.projection) if m.projection is not None else None, use_threads=False
        )
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, StorageError):
            raise
        raise ShardFormatError(url, runs[0][0] if runs else 0, f"cannot decode row group {index} ({str(exc).splitlines()[0]})") from exc
    if table.num_rows != int(m.counts[g]):
        raise ShardFormatError(url, runs[0][0] if runs else 0, f"row group {index} holds {table.num_rows} rows, the manifest says {int(m.counts[g])}")
    return table


def rebased(m: TableManifest, base: str) -> TableManifest:
    """The same table with its file paths relative to ``base`` where they are under it (else as full URLs)."""
    urls = [m.file_url(f) for f in range(len(m.files))]
    prefix = base.rstrip("/") + "/"
    files = [u[len(prefix) :] if u.startswith(prefix) else u for u in urls]
    spans, k = [], 0
    for rows in m.group_rows:
        spans.append([(int(a), int(b)) for a, b in m.spans[k : k + len(rows)].tolist()])
        k += len(rows)
    out = TableManifest(files, m.file_sizes, m.footer_sizes, m.group_rows, spans, m.columns, base_url=base.rstrip("/"), footer_sha256=m.footer_sha256)
    out.storage_options = dict(m.storage_options)
    return out


def reserved_column(name: str) -> bool:
    """Names of the form ``__name__`` are shardstream's own in a sample or batch (``__key__``,
    ``__url__``, ``__valid__``, ``__present__``, ...): a table's column may not take one."""
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def check_columns(where: str, names: Sequence[str], wanted: Sequence[str] | None = None) -> None:
    """A SourceError naming the first column of ``wanted`` (default: all) that ``names`` (a file's
    columns) holds twice, or whose name is reserved (``reserved_column``): either would be read as
    something else than the column (a pad mask, a key) or not at all."""
    for name in names if wanted is None else wanted:
        if names.count(name) > 1:
            raise SourceError(
                where, f"column {name!r} appears {names.count(name)} times in the table's schema: rename one (or leave it out of columns=)"
            )
        if reserved_column(name):
            raise SourceError(
                where,
                f"column {name!r} has a reserved name (__name__ is shardstream's, as in __key__, __valid__, __present__): "
                "rename it (or leave it out of columns=)",
            )


def refuse_table(manifest: Manifest, what: str) -> None:
    """A ConfigError when ``manifest`` is a Parquet table's: ``what`` works on tar datasets only."""
    if isinstance(manifest, TableManifest):
        raise ConfigError(
            f"{manifest.base_url or 'this dataset'} is a Parquet table: {what} works on tar datasets (stream the table with ShardStream)"
        )


def open_table(
    source: Table | str | Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    config: StorageConfig = DEFAULT_STORAGE,
    load: Callable[[str], Manifest] | None = None,
) -> TableManifest:
    """A Table's manifest, projected: a table manifest written by ``shardstream index`` when
    ``load(url)`` finds one (a folder URL), else indexed from the files' footers now."""
    table = source if isinstance(source, Table) else Table(source)
    url = table.url
    manifest: Manifest | None = None
    if load is not None and isinstance(url, str) and not is_table_url(url) and not any(c in url for c in "*?["):
        try:
            manifest = load(url)
        except ManifestError as exc:
            if not isinstance(exc.__cause__, StorageNotFound):
                raise
    if manifest is not None and not isinstance(manifest, TableManifest):
        raise ConfigError(f"{url}: holds a tar dataset (its index.json), not a Parquet table; pass it without Table(...)")
    if manifest is None:
        manifest = index_table(url, storage_options, config=config)
        manifest.storage_options = dict(storage_options or {})
    else:
        check_table_files(manifest, manifest.storage_options or storage_options, config=config)
    out = manifest.select(table.columns)
    check_columns(out.base_url or (out.file_url(0) if out.files else table.label), out.column_names, out.projection)
    return out


# -- the requests an epoch makes ------------------------------------------------------------------
def projected_runs(m: TableManifest) -> int:
    """How many byte runs a row group's projected columns make (one ranged GET each): the selected
    top-level columns that sit next to each other in the schema (writers lay a row group's column
    chunks out in schema order) share one."""
    if m.projection is None:
        return 1
    wanted = set(m.projection)
    runs, inside = 0, False
    for name, _ in m.columns:
        if name in wanted and not inside:
            runs += 1
        inside = name in wanted
    return max(1, runs)
