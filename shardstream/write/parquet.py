"""Parquet tables as a pack source: a row becomes a sample, a column a field, chosen by its type.

Column -> field (the column name, lower-cased, plus an extension; a column named like an extension,
``jpg`` or ``cls``, keeps its name and is encoded for it):

    binary                          image bytes sniffed per value: ``.jpg``, ``.png``, ``.webp``; else ``.bin``
    struct {bytes, path}            a Hugging Face image: its bytes, sniffed the same way
    string                          ``.txt`` (UTF-8)
    integer                         ``.cls`` (decimal text)
    float, bool, decimal            ``.json``
    date, time, timestamp           ``.txt`` (ISO format)
    fixed-size list of numbers      ``.npy`` (nested fixed-size lists: an array of that shape)
    list, struct, map               ``.json``

A null value leaves the field out of that sample. The key is ``--key COLUMN``'s value, or by
default the file's path under the source (without ``.parquet``) and the row's number in the file:
``part-0/000000042``.

Listing reads each file's footer only (the driver, once); the items are rows. Work is split by
row group: consecutive items of one row group (cut into spans of about ``SPAN_BYTES`` of
uncompressed data, from the footer's sizes) are loaded together, one read of the row group's
selected columns (``load_group``), in a pack worker or a shard task alike. pyarrow reads the
files, through fsspec for remote storage, under the storage policy (``storage_call``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from shardstream.errors import ConfigError, SourceError
from shardstream.format.extensions import kind_of
from shardstream.format.parquet import check_columns
from shardstream.storage import fs as storage
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.fs import expand_retried, storage_call
from shardstream.write.encode import check_key, encode_value

SPAN_BYTES = 64 << 20  # uncompressed bytes of a row group loaded at once (a row group larger is read once per span)

IMAGE_SIGNATURES = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"))


def require_pyarrow() -> Any:
    """``pyarrow.parquet``, or a ConfigError saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("packing Parquet needs pyarrow: pip install 'shardstream[tables]'") from None
    return pq


def is_parquet_source(src: str) -> bool:
    """A ``.parquet`` file, or a glob or brace pattern of them."""
    return src.rstrip("/").endswith(".parquet") or src.endswith(".parquet}")


def sniff_image(data: bytes) -> str | None:
    for signature, ext in IMAGE_SIGNATURES:
        if data.startswith(signature):
            return ext
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


# -- column rules (decided once, from the schema) -------------------------------------------------
def _is_hf_image(t: Any) -> bool:
    import pyarrow as pa

    if not pa.types.is_struct(t):
        return False
    names = {t.field(i).name for i in range(t.num_fields)}
    return "bytes" in names and names <= {"bytes", "path"} and _is_binary(t.field("bytes").type)


def _is_binary(t: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) or pa.types.is_binary_view(t)


def _holds_binary(t: Any) -> bool:
    import pyarrow as pa

    if _is_binary(t):
        return True
    if pa.types.is_struct(t):
        return any(_holds_binary(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _holds_binary(t.key_type) or _holds_binary(t.item_type)
    if hasattr(t, "value_type"):
        return _holds_binary(t.value_type)
    return False


def _array_shape(t: Any) -> tuple[tuple[int, ...], str] | None:
    """(shape, numpy dtype) of a fixed-size list (nested) of numbers; None for anything else."""
    import pyarrow as pa

    shape: list[int] = []
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = t.value_type
    if not shape or not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        return None
    return tuple(shape), str(t.to_pandas_dtype().__name__)


def column_rule(name: str, t: Any) -> tuple[str, str, Any]:
    """(field, rule, detail) for column ``name`` of arrow type ``t``; a SourceError (its ``what``)
    for a type no field fits. Rules: image, hfimage, txt, cls, json, str (text of the value), npy."""
    import pyarrow as pa

    field = name.lower()
    if not field or "/" in field or field.startswith("_"):
        raise SourceError(name, f"column name {name!r} cannot name a field (empty, '/' or a leading '_')")
    if pa.types.is_dictionary(t):
        t = t.value_type
    if kind_of(field) is not None and "." not in field:  # a column named like an extension: encoded for it
        return field, ("bytes" if _is_binary(t) else "hfbytes" if _is_hf_image(t) else "named"), None
    if _is_binary(t):
        return field, "image", None
    if _is_hf_image(t):
        return field, "hfimage", None
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return f"{field}.txt", "txt", None
    if pa.types.is_integer(t):
        return f"{field}.cls", "cls", None
    if pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t):
        return f"{field}.json", "json", None
    if pa.types.is_decimal(t):
        return f"{field}.json", "decimal", None
    if pa.types.is_temporal(t):
        return f"{field}.txt", "str", None
    shape = _array_shape(t)
    if shape is not None:
        return f"{field}.npy", "npy", shape
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_struct(t) or pa.types.is_map(t):
        if _holds_binary(t):
            raise SourceError(
                name, f"column {name!r} ({t}) holds binary data inside a list or struct, which JSON cannot carry: leave it out with --columns"
            )
        return f"{field}.json", "json", None
    raise SourceError(name, f"column {name!r} has type {t}, which no field fits: leave it out with --columns")


# -- listing -----------------------------------------------------------------------------------------
def parquet_files(src: str, storage_options: Mapping[str, Any] | None, config: StorageConfig) -> tuple[list[str], str]:
    """The .parquet files of ``src`` (one file, a glob or brace pattern, or a directory tree;
    sorted) and the folder their default keys are relative to."""
    if any(c in src for c in "*?[{"):
        urls = [u for u in expand_retried(src, storage_options, config) if u.endswith(".parquet")]
        if not urls:
            raise SourceError(src, "no .parquet files match")
        return urls, src[: min(src.find(c) for c in "*?[{" if c in src)].rsplit("/", 1)[0]

    def find(fs, path: str) -> list[str] | None:
        if fs.isdir(path):
            root = path.rstrip("/")
            return sorted(p for p in fs.find(root) if p.endswith(".parquet") and not _hidden(p[len(root) :]))
        return None

    found = storage_call(src, find, storage_options, config)
    if found is None:
        return [src], src.rsplit("/", 1)[0] if "/" in src else ""
    if not found:
        raise SourceError(src, "no .parquet files in this directory")
    fs, root = storage.get_fs(src, storage_options, config)
    return [storage.full_url(fs, p) for p in found], storage.full_url(fs, root.rstrip("/"))


def _hidden(rel: str) -> bool:
    return any(part.startswith((".", "_")) for part in rel.split("/") if part)


def _footer(url: str, storage_options, config: StorageConfig) -> Any:
    pq = require_pyarrow()
    import pyarrow as pa

    def read(fs, path: str) -> Any:
        if storage.is_local(fs):
            return pq.ParquetFile(path).metadata
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).metadata

    try:
        return storage_call(url, read, storage_options, config)
    except FileNotFoundError:
        raise SourceError(url, "file not found") from None
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(url, f"not a readable Parquet file: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def list_parquet(
    src: str,
    *,
    columns: Sequence[str] | None = None,
    key: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    config: StorageConfig = DEFAULT_STORAGE,
) -> list[tuple[str, tuple]]:
    """The items of a Parquet source, one per row, in file and row order (see the module docstring)."""
    require_pyarrow()
    files, base = parquet_files(src, storage_options, config)
    items: list[tuple[str, tuple]] = []
    spec: tuple | None = None
    first_schema = None
    for url in files:
        meta = _footer(url, storage_options, config)
        schema = meta.schema.to_arrow_schema()
        names = list(schema.names)
        wanted = list(columns) if columns else [n for n in names if n != key]
        check_columns(url, names, [*wanted, *([key] if key else [])])
        for name in [*wanted, *([key] if key else [])]:
            if name not in names:
                raise SourceError(url, f"no column {name!r} (columns: {', '.join(names)})")
        if key is not None:
            kt = schema.field(key).type
            import pyarrow as pa

            if not (pa.types.is_integer(kt) or pa.types.is_string(kt) or pa.types.is_large_string(kt)):
                raise SourceError(url, f"key column {key!r} has type {kt}: give a string or integer column")
        rules = []
        for name in wanted:
            try:
                field, rule, detail = column_rule(name, schema.field(name).type)
            except SourceError as exc:
                raise SourceError(url, exc.what) from None
            rules.append((name, field, rule, detail))
        fields = [r[1] for r in rules]
        if len(set(fields)) != len(fields):
            dup = next(f for f in fields if fields.count(f) > 1)
            raise SourceError(url, f"two columns would make the same field {dup!r}: select one with --columns")
        this = (tuple(rules), key)
        if spec is None:
            spec, first_schema = this, url
        elif this != spec:
            raise SourceError(url, f"its columns map to other fields than those of {first_schema}: {this[0]} against {spec[0]}")
        name = url[len(base) :].lstrip("/") if base and url.startswith(base + "/") else url.rsplit("/", 1)[-1]
        stem = name[: -len(".parquet")] if name.endswith(".parquet") else name
        stem = stem.replace(".", "_") or "table"
        first = 0
        for rg in range(meta.num_row_groups):
            group = meta.row_group(rg)
            rows = group.num_rows
            per_span = max(1, math.ceil(rows * SPAN_BYTES / max(1, group.total_byte_size))) if group.total_byte_size > SPAN_BYTES else rows
            for i in range(rows):
                items.append((f"{url} row {first + i}", ("parquet", url, stem, rg, first, i, i // max(1, per_span), spec)))
            first += rows
    return items


# -- loading (a worker loads a row group's span at once) ------------------------------------------------
def group_of(payload: tuple) -> tuple | None:
    """Items with the same group are loaded together (one read): a row group's span."""
    return (payload[1], payload[3], payload[6]) if payload[0] == "parquet" else None


def load_group(items: Sequence[tuple[str, tuple]], storage_options, config: StorageConfig) -> list[tuple[bool, str, Any]]:
    """Consecutive items of one group -> per item ``(True, key, fields)`` or ``(False, where, what)``."""
    pq = require_pyarrow()
    import pyarrow as pa

    _, url, stem, rg, first, _, _, spec = items[0][1]
    rules, key = spec
    wanted = [r[0] for r in rules] + ([key] if key is not None and key not in [r[0] for r in rules] else [])

    def read(fs, path: str) -> Any:
        if storage.is_local(fs):
            return pq.ParquetFile(path).read_row_group(rg, columns=wanted)
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).read_row_group(rg, columns=wanted)

    try:
        table = storage_call(url, read, storage_options, config)
        rows = table.take(pa.array([item[1][5] for item in items], pa.int64()))
        values = {name: rows.column(name).to_pylist() for name in wanted}
    except SourceError:
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        what = f"cannot read row group {rg}: {_first_line(exc)}"
        return [(False, where, what) for where, _ in items]
    out: list[tuple[bool, str, Any]] = []
    for n, (where, payload) in enumerate(items):
        try:
            sample_key = _key(values, key, n, stem, first + payload[5], where)
            fields = {}
            for name, field, rule, detail in rules:
                value = values[name][n]
                if value is None:
                    continue
                encoded = _encode(field, rule, detail, value)
                if encoded is not None:
                    fields[encoded[0]] = encoded[1]
            if not fields:
                raise SourceError(where, "every selected column is null in this row: no fields")
            out.append((True, sample_key, fields))
        except SourceError as exc:
            out.append((False, exc.where, exc.what))
        except (TypeError, ValueError) as exc:
            out.append((False, where, f"{type(exc).__name__}: {exc}"))
    return out


def _key(values: dict[str, list], key: str | None, n: int, stem: str, row: int, where: str) -> str:
    if key is None:
        return f"{stem}/{row:09d}"
    value = values[key][n]
    if value is None:
        raise SourceError(where, f"key column {key!r} is null")
    text = str(value)
    check_key(text, where)
    return text


def _encode(field: str, rule: str, detail: Any, value: Any) -> tuple[str, bytes] | None:
    if rule == "image":
        return f"{field}.{sniff_image(value) or 'bin'}", bytes(value)
    if rule == "hfimage":
        data = value.get("bytes")
        if data is None:
            return None  # an image stored by path only: nothing to pack
        return f"{field}.{sniff_image(data) or 'bin'}", bytes(data)
    if rule == "txt":
        return field, value.encode("utf-8")
    if rule == "cls":
        return field, str(value).encode("ascii")
    if rule == "json":
        return field, json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")
    if rule == "decimal":
        return field, str(value).encode("ascii")
    if rule == "str":
        return field, (value.isoformat() if hasattr(value, "isoformat") else str(value)).encode("utf-8")
    if rule == "npy":
        import numpy as np

        shape, dtype = detail
        return field, encode_value("npy", np.asarray(value, dtype=dtype).reshape(shape))
    if rule == "bytes":
        return field, bytes(value)
    if rule == "hfbytes":
        data = value.get("bytes")
        return None if data is None else (field, bytes(data))
    return field, encode_value(field, value)  # "named": the field's own encoding
