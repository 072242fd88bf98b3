"""A stream's sources as users give them, resolved to one manifest per source: a dataset root (a
single source), ``Source`` values or a mix file (JSON, or YAML when pyyaml is installed). What
planning needs of them is ``plan_sources`` (``plan.run.Sources``); the planning itself is
``plan/mix.py`` and ``plan/run.py``.

A mix file::

    sources:
      - url: s3://bucket/web/train       # a dataset root, index.json URL or shard pattern
        weight: 0.7                      # or repeat: 2.0, or samples: 100000
        name: web                        # what batches say in __source__ (default: the url)
        storage_options: {endpoint_url: "http://127.0.0.1:9000"}
      - url: ../curated                  # relative to the mix file's directory
        weight: 0.3
        transform: mypackage.data:to_common   # this source's samples, mapped before the stream's transform

A plain list of such entries is accepted too. A ``.yaml``/``.yml`` URL, or a ``.json`` URL other
than ``index.json`` whose document has ``sources``, is read as a mix file wherever a dataset URL
is accepted.

A source's ``transform`` (a function, or ``"module:function"`` imported when the stream is built)
maps that source's decoded samples to the mix's common shape before the stream's own transform:
``source_transforms`` wraps them, by ``__source__``, in one picklable callable.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import posixpath
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardstream.errors import ConfigError, ManifestError, ShardFormatError, StorageError, StorageNotFound, restated
from shardstream.format.manifest import MANIFEST_NAME, Manifest, load_manifest
from shardstream.format.parquet import (
    Table,
    TableManifest,
    check_columns,
    check_table_files,
    footer_for,
    is_table_url,
    list_table_files,
    open_table,
    read_group,
)
from shardstream.format.scan import scan_shards, scan_url
from shardstream.format.tokens import FIELD, TABLE_FIELD, TokenManifest, Tokens
from shardstream.plan.epoch import EpochPlan
from shardstream.plan.mix import Ask, MixPlan
from shardstream.plan.requests import is_remote
from shardstream.plan.run import RunPlan, RunSettings, Sources
from shardstream.plan.state import dataset_digest
from shardstream.redact import get_logger, masked_repr
from shardstream.storage import fs as storage
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.urls import expand_urls, is_shard_pattern

logger = get_logger(__name__)

MIX_KEYS = ("url", "weight", "repeat", "samples", "name", "storage_options", "transform")


@dataclass(frozen=True, eq=False)
class Source:
    """One dataset of a mix and what it asks of every epoch: ``weight`` (share among the weighted
    sources), ``repeat`` (passes per epoch, fractional allowed) or ``samples`` (per epoch); with
    none of them, ``repeat=1``. ``storage_options`` default to the stream's.

    ``transform``: a function of one decoded sample of this source (a dict with ``__source__``),
    applied before the stream's ``transform``, to give unlike sources one shape (rename fields,
    fill in missing ones); None drops the sample, as the stream's transform does. A dict it returns
    keeps ``__source__``. Given as ``"module:function"`` (what a mix file writes) it is imported
    when the stream is built. A lambda or a notebook's function reaches workers too (by value,
    ``shardstream.portable``).
    """

    url: str | Sequence[str] | Manifest | Table | Tokens
    weight: float | None = None
    repeat: float | None = None
    samples: int | None = None
    storage_options: Mapping[str, Any] | None = None

    __repr__ = masked_repr  # (credentials in ``storage_options`` shown masked)
    name: str | None = None
    transform: Callable[[dict[str, Any]], Any] | str | None = None

    def __post_init__(self) -> None:
        if self.transform is not None and not callable(self.transform) and not _is_spec(self.transform):
            raise ConfigError(f"Source(transform=...) is a function or a 'module:function' string, got {self.transform!r}")

    def ask(self) -> Ask:
        if self.weight is None and self.repeat is None and self.samples is None:
            return Ask(repeat=1.0)
        return Ask(weight=self.weight, repeat=self.repeat, samples=self.samples)

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        if isinstance(self.url, str):
            return self.url
        if isinstance(self.url, Manifest):
            return self.url.base_url or "manifest"
        if isinstance(self.url, (Table, Tokens)):
            return self.url.label
        return ",".join(self.url)


def _is_spec(value: Any) -> bool:
    return isinstance(value, str) and value.count(":") == 1 and all(part.strip() for part in value.split(":"))


def import_transform(spec: str) -> Callable[[Any], Any]:
    """The function ``"module:function"`` names (``function`` may be dotted: ``"pkg.mod:Class.method"``)."""
    module_name, _, attr = spec.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"transform {spec!r}: cannot import {module_name!r} ({exc}); is it on the Python path (PYTHONPATH)?") from exc
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ConfigError(f"transform {spec!r}: module {module_name!r} has no {attr!r}") from None
    if not callable(found):
        raise ConfigError(f"transform {spec!r} names a {type(found).__name__}, not a function")
    return found


class SourceTransforms:
    """Each sample through its source's transform (by ``__source__``), then the stream's.

    A class, not a closure, so it pickles for spawned and forkserver workers (with the functions it
    holds). ``bind`` reaches every function that has one (seeded augmentation)."""

    def __init__(self, by_source: Mapping[str, Callable[[Any], Any]], then: Callable[[Any], Any] | None = None):
        self.by_source = dict(by_source)
        self.then = then

    def __call__(self, sample: Any) -> Any:
        fn = self.by_source.get(sample.get("__source__"))
        if fn is not None:
            source = sample["__source__"]
            sample = fn(sample)
            if sample is None:
                return None
            if isinstance(sample, dict) and "__source__" not in sample:
                sample["__source__"] = source
        return sample if self.then is None else self.then(sample)

    def _functions(self) -> list[Any]:
        return [*self.by_source.values(), *([self.then] if self.then is not None else [])]

    def bind(self, epoch: int, rank: int, worker: int) -> None:
        for fn in self._functions():
            if hasattr(fn, "bind"):
                fn.bind(epoch, rank, worker)


class KeyedSourceTransforms(SourceTransforms):
    """SourceTransforms of which some function takes ``bind_sample`` (per-sample seeding)."""

    def bind_sample(self, name: str) -> None:
        for fn in self._functions():
            if hasattr(fn, "bind_sample"):
                fn.bind_sample(name)


def source_transforms(mix: Mix, then: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """The transform a stream applies to each decoded sample: ``then`` (the stream's) alone when no
    source has its own, else a SourceTransforms (``"module:function"`` specs imported here)."""
    by_source = {}
    for name, s in zip(mix.names, mix.sources):
        if s.transform is None:
            continue
        try:
            by_source[name] = import_transform(s.transform) if isinstance(s.transform, str) else s.transform
        except ConfigError as exc:
            raise ConfigError(f"mix source {name!r}: {exc}") from exc
    if not by_source:
        return then
    keyed = any(hasattr(fn, "bind_sample") for fn in [*by_source.values(), then])
    return (KeyedSourceTransforms if keyed else SourceTransforms)(by_source, then)


@dataclass
class Mix:
    """Resolved sources: their manifests and storage options, and the plan of any epoch."""

    sources: list[Source]
    manifests: list[Manifest]
    storage_options: list[dict[str, Any]]
    names: list[str] = field(default_factory=list)
    mixed: bool = True  # False: a single dataset, given as a root or manifest (no names, no __source__; planned alike)

    __repr__ = masked_repr  # (credentials in ``storage_options`` shown masked)

    def remote_urls(self) -> list[tuple[str, dict[str, Any]]]:
        """(a URL, its storage options) of each source on object storage: what its readers connect to."""
        return [
            (m.base_url or (m.file_url(0) if isinstance(m, TableManifest) else m.shard_url(0)), options)
            for m, options in zip(self.manifests, self.storage_options)
            if is_remote(m)
        ]

    def report(
        self,
        *,
        world_size: int = 1,
        num_workers: int = 1,
        batch_size: int = 1,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        per_batch: str = "spread",
        mode: str = "drop",
        steps: int | None = None,
        samples_per_epoch: int | None = None,
    ) -> EpochPlan | MixPlan:
        """Data epoch ``epoch``'s plan as ``ShardStream.plan()`` makes it: through the stream's own
        planner (``plan.run.RunPlan``, the same ``mode``, run length and worker check), for the CLI
        tools that plan without a stream (``shardstream ls``)."""
        settings = RunSettings(seed, shuffle, mode, per_batch, world_size, batch_size, 0, 0, steps, samples_per_epoch)
        return RunPlan(plan_sources(self), settings).report(epoch, num_workers)


def is_mix_url(url: str) -> bool:
    """A mix file by its name: .yaml/.yml, or .json other than a manifest (confirmed by its content)."""
    name = url.rstrip("/").rsplit("/", 1)[-1].lower()
    return name.endswith((".yaml", ".yml")) or (name.endswith(".json") and name != MANIFEST_NAME)


def parse_mix(text: str | bytes, url: str) -> list[Source] | None:
    """The sources of a mix file's text; None for a JSON document that is not a mix (a manifest)."""
    name = url.rstrip("/").rsplit("/", 1)[-1].lower()
    if name.endswith((".yaml", ".yml")):
        try:
            # Imported by name: pyyaml is optional, and whether its type stubs are installed must not matter.
            yaml: Any = importlib.import_module("yaml")
        except ImportError as exc:
            raise ConfigError(f"{url}: reading a YAML mix file needs pyyaml (pip install pyyaml), or write the mix as JSON") from exc
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{url}: not valid YAML ({exc})") from exc
    else:
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{url}: not valid JSON ({exc})") from exc
        if isinstance(doc, dict) and "sources" not in doc:
            return None
    entries = doc.get("sources") if isinstance(doc, dict) else doc
    if isinstance(doc, dict) and set(doc) - {"sources"}:
        raise ConfigError(f"{url}: unknown top-level keys {sorted(set(doc) - {'sources'})}; a mix file has 'sources'")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{url}: a mix file lists its sources (a non-empty list under 'sources')")
    base = url.rsplit("/", 1)[0] if "/" in url else "."
    sources = []
    for n, entry in enumerate(entries):
        where = f"{url}: source {n + 1}"
        if isinstance(entry, str):
            entry = {"url": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ConfigError(f"{where}: each source is a mapping with a 'url' string, got {entry!r}")
        unknown = set(entry) - set(MIX_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (known: {', '.join(MIX_KEYS)})")
        options = entry.get("storage_options")
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"{where}: storage_options must be a mapping, got {options!r}")
        transform = entry.get("transform")
        if transform is not None and not _is_spec(transform):
            raise ConfigError(f"{where}: transform names a function as 'module:function', got {transform!r}")
        source_url = entry["url"]
        if "://" not in source_url and not source_url.startswith("/"):
            source_url = _relative_to(base, source_url)
        try:
            source = Source(
                source_url,
                weight=entry.get("weight"),
                repeat=entry.get("repeat"),
                samples=entry.get("samples"),
                storage_options=options,
                name=entry.get("name"),
                transform=transform,
            )
            source.ask()
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        sources.append(source)
    return sources


def _relative_to(base: str, path: str) -> str:
    """``path`` relative to the mix file's directory ``base`` ('..' resolved, the protocol kept)."""
    protocol, sep, rest = base.partition("://")
    if not sep:
        return posixpath.normpath(storage.join(base, path))
    return f"{protocol}://{posixpath.normpath(posixpath.join(rest, path))}"


def read_mix_file(url: str, storage_options: Mapping[str, Any] | None = None, config: StorageConfig = DEFAULT_STORAGE) -> list[Source] | None:
    """The sources a mix file lists (None: the file is not a mix), read under ``config``."""
    try:
        raw = storage.storage_call(url, lambda fs, path: fs.cat_file(path), storage_options, config)
    except StorageError as exc:
        raise restated(exc, f"{url}: cannot read the mix file ({exc})", ConfigError) from exc  # also its storage class
    return parse_mix(raw, url)


def open_mix(source: Any, storage_options: Mapping[str, Any] | None, resolve: Any, config: StorageConfig = DEFAULT_STORAGE) -> Mix | None:
    """A Mix when ``source`` is a Source, a list of Sources or a mix file URL; None otherwise.

    ``resolve(url, storage_options)`` turns one source's URL into its manifest (the stream's own
    resolver, so shard patterns work in mixes too).
    """
    if isinstance(source, Source):
        sources = [source]
    elif isinstance(source, Sequence) and not isinstance(source, str) and source and all(isinstance(s, Source) for s in source):
        sources = list(source)
    elif isinstance(source, Sequence) and not isinstance(source, str) and any(isinstance(s, Source) for s in source):
        raise ConfigError("a mix is a list of Source values only; wrap every dataset in Source(...)")
    elif isinstance(source, str) and is_mix_url(source):
        found = read_mix_file(source, storage_options, config)
        if found is None:
            return None
        sources = found
    else:
        return None
    options = [dict(storage_options or {}) if s.storage_options is None else dict(s.storage_options) for s in sources]
    manifests = []
    for s, opts in zip(sources, options):
        try:
            manifests.append(resolve(s.url, opts))
        except (ConfigError, ManifestError) as exc:
            if isinstance(exc, StorageError):  # keep both classes (ManifestAccessDenied, ...) and the url
                raise restated(exc, f"mix source {s.label!r}: {exc}", ManifestError if isinstance(exc, ManifestError) else ConfigError) from exc
            raise type(exc)(f"mix source {s.label!r}: {exc}") from exc
    names = [s.label for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"two mix sources share a name ({names}); give each a distinct name=")
    return Mix(sources, manifests, options, names)


def resolve_manifest(
    source: str | Sequence[str] | Manifest, storage_options: Mapping[str, Any] | None, config: StorageConfig = DEFAULT_STORAGE
) -> Manifest:
    """A manifest, a dataset root / index.json URL, or shard URLs (brace pattern, glob, list): the
    resolver of a mix's ``Source`` values (an explicit value per source, so a pattern there is a
    request to index it). Shard URLs are indexed here: every shard is read end to end (8 in
    parallel) to count its samples and find their offsets."""
    if isinstance(source, Manifest):
        return source
    if isinstance(source, Tokens):
        return load_tokens(source, storage_options, config)
    table = load_table(source, storage_options, config)
    if table is not None:
        return table
    if isinstance(source, str) and not is_shard_pattern(source):
        return load_root(source, storage_options, config)
    patterns = [source] if isinstance(source, str) else list(source)
    urls = [u for p in patterns for u in expand_urls(p, storage_options)]
    if not urls:
        raise ConfigError(f"no shards match {source!r}")
    logger.info("no manifest given: indexing %d shards (one full read each)", len(urls))
    return scan_shards(urls, storage_options, config=config)


def load_source(source: Any, storage_options: Mapping[str, Any] | None, config: StorageConfig = DEFAULT_STORAGE) -> Manifest:
    """A Manifest as is, or the manifest of a dataset root / index.json URL. Shard URLs are refused
    here: indexing them reads every shard, which ``ShardStream.from_urls`` does on request."""
    if isinstance(source, Manifest):
        return source
    if isinstance(source, Tokens):
        return load_tokens(source, storage_options, config)
    table = load_table(source, storage_options, config)
    if table is not None:
        return table
    if not isinstance(source, str) or is_shard_pattern(source):
        shown = source if isinstance(source, str) else "[...]"
        raise ConfigError(
            f"{source!r} names shard files, not a packed dataset (a folder or URL with index.json): use "
            f"ShardStream.from_urls({shown!r}, ...) to index them at start-up (one full read of every shard), "
            f"or write their manifest once with `shardstream index '{shown}' DEST` and pass DEST"
        )
    return load_root(source, storage_options, config)


def load_tokens(source: Tokens, storage_options: Mapping[str, Any] | None, config: StorageConfig = DEFAULT_STORAGE) -> TokenManifest:
    """A token corpus's manifest with its sequences of ``seq_len + 1`` tokens as samples
    (format/tokens.py): a corpus packed with a tokenizer (its manifest counts the tokens), a Parquet
    table with a ``list<int>`` column (counted from the footers), or tar shards of ``.npy`` token
    arrays written by others (shard URLs, or a root indexed without tokens, given ``field=``:
    every shard read once here to count them; ``shardstream index --tokens FIELD`` writes the
    counts once)."""
    url = source.url
    docs: Manifest | None
    if isinstance(url, Manifest):
        docs = url
    else:
        docs = load_table(url, storage_options, config)
        if docs is None and isinstance(url, str) and not is_shard_pattern(url):
            docs = load_root(url, storage_options, config)
    if isinstance(docs, TableManifest):
        return TokenManifest(
            table_tokens(docs, source.field or TABLE_FIELD, storage_options, config),
            source.seq_len,
            field=source.field or TABLE_FIELD,
            boundaries=source.boundaries,
        )
    known = (docs.token_info or {}).get("field") if docs is not None else None  # what `index --tokens` counted
    field = source.field or known or FIELD
    if docs is None or (docs.tokens is None and source.field is not None):
        if docs is None:
            patterns = [url] if isinstance(url, str) else list(url)  # type: ignore[arg-type]  # (a Manifest is docs)
            urls = [u for p in patterns for u in expand_urls(p, storage_options)]
        else:
            urls = [docs.shard_url(i) for i in range(len(docs.paths))]
        if not urls:
            raise ConfigError(f"no shards match {url!r}")
        logger.info("counting the tokens of %d shards (one full read each)", len(urls))
        docs = index_token_shards(urls, field, storage_options, config=config)
    return TokenManifest(docs, source.seq_len, field=field, boundaries=source.boundaries)


def list_int_dtype(arrow_type: str) -> str | None:
    """The integer dtype of a ``list<int>`` column's values, from its Arrow type's name
    (``list<element: int32>``, ``large_list<item: uint16>``); None for any other type."""
    match = re.fullmatch(r"(?:large_)?list<[^:<>]+: (u?int(?:8|16|32|64))(?: not null)?>", arrow_type)
    return match.group(1) if match else None


def table_tokens(table: TableManifest, column: str, storage_options: Mapping[str, Any] | None, config: StorageConfig) -> TableManifest:
    """``table`` reading ``column`` alone, with the tokens of each row group (a shard to the
    planner) counted from the files' footers: a list column's leaf values less its nulls (which
    Parquet counts for every empty or null list). A row group whose footer has no null count is
    read to count them; the reader checks every count against the ids it reads."""
    where = table.base_url or (table.file_url(0) if table.files else "table")
    types = dict(table.columns)
    if column not in types:
        raise ConfigError(f"{where}: no column {column!r} of token ids; the table has {list(types)} (Tokens(..., field=COLUMN) names it)")
    dtype = list_int_dtype(types[column])
    if dtype is None:
        raise ConfigError(f"{where}: column {column!r} is {types[column]}, not a list of integer token ids (list<int>): Tokens cannot read it")
    docs = table.select([column])
    counts = np.zeros(len(docs.counts), dtype=np.int64)
    for g in range(len(docs.counts)):
        f, index = int(docs.group_file[g]), int(docs.group_index[g])
        metadata = footer_for(docs, f, storage_options, config=config)
        group = metadata.row_group(index)
        leaf = next(j for j in range(group.num_columns) if group.column(j).path_in_schema.split(".")[0] == column)
        chunk = group.column(leaf)
        stats = chunk.statistics
        if stats is not None and stats.has_null_count:
            counts[g] = chunk.num_values - stats.null_count
        else:  # no count in the footer: read the column's offsets
            lists = read_group(docs, g, storage_options, config=config).column(0)
            counts[g] = sum(len(c.flatten()) for c in lists.chunks)
    docs.tokens = counts
    docs.token_info = {"dtype": dtype, "field": column}
    return docs


def npy_header(data: bytes | memoryview) -> tuple[tuple[int, ...], np.dtype]:
    """A ``.npy`` member's shape and dtype, from its header alone; ValueError if it is not one."""
    stream = io.BytesIO(memoryview(data)[:4096].tobytes())
    version = np.lib.format.read_magic(stream)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(stream)
    return tuple(shape), np.dtype(dtype)


def index_token_shards(
    urls: Sequence[str], field: str, storage_options: Mapping[str, Any] | None, *, config: StorageConfig = DEFAULT_STORAGE, threads: int = 8
) -> Manifest:
    """Tar shards with one 1-D integer ``.npy`` array of token ids per sample (member ``field``),
    written by anyone (``webdataset.TarWriter``, numpy's ``np.save``), indexed with their tokens
    counted: each shard read end to end once, its samples' offsets found and their arrays' headers
    read. The corpus's dtype is the one every array's fits (``np.result_type`` of theirs)."""

    def one(url: str) -> tuple[Any, int, set[str]]:
        tokens, dtypes = [0], set()

        def on_sample(key: str, start: int, end: int, fields: dict[str, bytes]) -> None:
            data = fields.get(field)
            if data is None:
                raise ShardFormatError(
                    url, start, f"sample {key!r} has no {field!r} member of token ids (it has {sorted(fields)}; Tokens(field=...) names one)"
                )
            try:
                shape, dtype = npy_header(data)
            except ValueError as exc:
                raise ShardFormatError(url, start, f"sample {key!r}: {field} is not a .npy array ({exc})") from exc
            if len(shape) != 1 or dtype.kind not in "iu":
                raise ShardFormatError(url, start, f"sample {key!r}: {field} is {dtype}{list(shape)}, not a 1-D array of integer token ids")
            tokens[0] += shape[0]
            dtypes.add(dtype.name)

        return scan_url(url, storage_options, config=config, on_sample=on_sample), tokens[0], dtypes

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(urls)))) as pool:
        results = list(pool.map(one, urls))
    dtypes = {d for _, _, seen in results for d in seen}
    dtype = np.result_type(*dtypes) if dtypes else np.dtype("int64")
    if dtype.kind not in "iu":  # uint64 and a signed dtype: no integer holds both
        raise ConfigError(f"{urls[0]}: token arrays of {sorted(dtypes)}: no one integer dtype holds them all")
    extensions: dict[str, int] = {}
    for scan, _, _ in results:
        for ext, n in scan.extensions.items():
            extensions[ext] = extensions.get(ext, 0) + n
    shards = [dataclasses.replace(scan.info(), tokens=n) for scan, n, _ in results]
    return Manifest(shards=shards, extensions=extensions, token_info={"dtype": dtype.name, "field": field})


def load_table(source: Any, storage_options: Mapping[str, Any] | None, config: StorageConfig = DEFAULT_STORAGE) -> Manifest | None:
    """A Parquet table's manifest when ``source`` is a ``Table`` or names Parquet files (a
    ``.parquet`` URL or glob, or a list of them); None otherwise (format/parquet.py)."""
    if isinstance(source, Table):
        return open_table(source, storage_options, config=config, load=lambda url: load_manifest(url, storage_options, config=config))
    urls = [source] if isinstance(source, str) else list(source) if isinstance(source, Sequence) else []
    if not all(isinstance(u, str) for u in urls):
        return None
    if urls and all(is_table_url(u) for u in urls):
        return open_table(Table(source), storage_options, config=config)
    return None


def load_root(url: str, storage_options: Mapping[str, Any] | None, config: StorageConfig = DEFAULT_STORAGE) -> Manifest:
    """A dataset root's manifest (its index.json: a tar dataset, or a table indexed by
    ``shardstream index``); a folder without one that holds Parquet files is read as a table."""
    try:
        manifest = load_manifest(url, storage_options, config=config)
    except ManifestError as exc:
        if not isinstance(exc.__cause__, StorageNotFound) or url.rstrip("/").endswith(".json"):
            raise
        try:
            list_table_files(url, storage_options, config)
        except (ConfigError, StorageError, OSError):  # no Parquet files there either: the manifest's error
            raise exc from exc.__cause__
        return open_table(Table(url), storage_options, config=config)
    if isinstance(manifest, TableManifest):  # a table index: checked against its files' footers, as open_table does
        check_table_files(manifest, manifest.storage_options or storage_options, config=config)
        check_columns(url, manifest.column_names)
    return manifest


def open_sources(source: Any, storage_options: Mapping[str, Any] | None, config: StorageConfig = DEFAULT_STORAGE) -> Mix:
    """Every stream's sources as a Mix: a mix as given, or a single dataset as a mix of one."""
    mix = open_mix(source, storage_options, lambda src, options: resolve_manifest(src, options, config), config)
    if mix is not None:
        return mix
    manifest = load_source(source, storage_options, config)
    return Mix([Source(manifest)], [manifest], [dict(storage_options or {})], [""], mixed=False)


def manifest_digest(m: Manifest) -> str:
    """What a resume state names a dataset by: its shards' paths, sizes and hashes (not where it is stored)."""
    return dataset_digest(zip(m.paths, m.counts.tolist(), m.sizes.tolist(), (m.sha256(i) for i in range(len(m.paths)))))


def plan_sources(mix: Mix, *, documents: bool = False) -> Sources:
    """What planning knows of the sources, and what a resume state names them by (``Sources.of``:
    one source by its manifest alone, given as a root or as a mix of one). ``documents``: token
    corpora whose documents are shuffled (``Shuffle(documents=True)``), which their sequences'
    tokens depend on, so a state names it."""
    return Sources.of(
        [m.counts for m in mix.manifests],
        [manifest_digest(m) for m in mix.manifests],
        mix.names if mix.mixed else (),
        [s.ask() for s in mix.sources],
        0 if mix.mixed else int(mix.manifests[0].compressed.sum()),
        documents=documents,
    )
