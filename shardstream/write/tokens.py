"""pack_tokens(): text documents -> a token corpus (one sample per document, its ids as ``tokens.npy``).

    documents (JSONL lines, a Parquet string column, or strings) -> tokenizer, in chunks
        (here or in spawned processes, results taken in order) -> ShardWriter -> shards + index.json

Each document becomes one sample ``{"__key__": "000000000042", "tokens.npy": ids}``: a 1-D array
in the smallest unsigned dtype that holds the vocabulary (``uint16`` up to 65,536 ids, else
``uint32``), with the end-of-document id appended when asked. The manifest counts every shard's
tokens (``Manifest.tokens``) and says what they are (``Manifest.token_info``: dtype, vocabulary
size, EOS id, tokenizer), which is what ``Tokens(root, seq_len)`` plans by (format/tokens.py).
Documents are taken in their order and tokenized in chunks whose results are written in order,
so the output is byte-identical for any ``workers``.

With an ``executor`` (Dask's ``Client.get_executor()``, a process pool) a JSONL corpus packs as
shard tasks (write/tasks.py): the driver reads the file once to find where its lines start (no
parsing, no tokenizing), cuts the documents into shards of ``max_count``, and each task reads its
shard's byte range, tokenizes it and writes the shard; the driver adopts them in order and writes
the manifest last. Tokens are deterministic, so the shards and manifest are byte-identical to
``workers=1`` wherever ``max_size`` cuts no shard there (under an executor only ``max_count``
cuts, as for samples). Parquet and iterable sources are not split into tasks yet.

A tokenizer is a Hugging Face ``tokenizer.json`` file (read with the ``tokenizers`` library), a
``tokenizers.Tokenizer``, or ``"module:function"``, a function of no arguments that returns a
tokenizer: any object with ``encode_batch(list[str])`` (returning ``Encoding``s or id lists) and
``get_vocab_size()``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor
from typing import Any

import numpy as np

from shardstream.errors import ConfigError, SourceError
from shardstream.format.manifest import check_dataset_root
from shardstream.format.parquet import is_table_url, list_table_files
from shardstream.format.tokens import FIELD, npy_header_size, token_dtype
from shardstream.storage import fs as storage
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.write.pack import PackResult
from shardstream.write.procs import map_in_order
from shardstream.write.tasks import ShardTask, adopt, run_tasks
from shardstream.write.writer import DEFAULT_MAX_COUNT, DEFAULT_MAX_SIZE, ShardWriter, shard_name

logger = logging.getLogger(__name__)

CHUNK = 256  # documents per tokenizer call (and per task of a worker)
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]", "[SEP]")


def load_tokenizer(spec: Any) -> Any:
    """The tokenizer ``spec`` names (see the module docstring); ConfigError when it cannot be had."""
    if not isinstance(spec, str):
        _check_tokenizer(spec, repr(spec))
        return spec
    if spec.count(":") == 1 and not spec.endswith(".json") and "/" not in spec.partition(":")[0]:
        from shardstream.sources import import_transform

        try:
            factory: Any = import_transform(spec)
        except ConfigError as exc:
            raise ConfigError(f"tokenizer {exc}") from exc
        tokenizer = factory()
        _check_tokenizer(tokenizer, spec)
        return tokenizer
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ConfigError("a tokenizer.json file is read with Hugging Face's tokenizers: pip install 'shardstream[tokens]'") from exc
    try:
        text = storage.storage_call(spec, lambda fs, path: fs.cat_file(path), None, DEFAULT_STORAGE)
    except Exception as exc:
        raise ConfigError(f"tokenizer {spec!r}: cannot read it ({exc})") from exc
    try:
        return Tokenizer.from_str(text.decode("utf-8"))
    except Exception as exc:  # the library raises plain Exceptions for a bad file
        raise ConfigError(f"tokenizer {spec!r}: not a Hugging Face tokenizer.json ({exc})") from exc


def _check_tokenizer(tokenizer: Any, where: str) -> None:
    if not (callable(getattr(tokenizer, "encode_batch", None)) and callable(getattr(tokenizer, "get_vocab_size", None))):
        raise ConfigError(f"tokenizer {where}: needs encode_batch(texts) and get_vocab_size() (a tokenizers.Tokenizer has both)")


def eos_id(tokenizer: Any, eos: bool | str | int) -> int | None:
    """The id appended to every document: None (``eos=False``), the given id, the given token's, or
    (``eos=True``) the first of the usual end-of-text tokens the vocabulary has."""
    if eos is False or eos is None:
        return None
    if isinstance(eos, int) and not isinstance(eos, bool):
        found: int | None = eos
    else:
        lookup = getattr(tokenizer, "token_to_id", None)
        if lookup is None:
            raise ConfigError("eos=True/'TOKEN' needs a tokenizer with token_to_id(); give the id as an integer")
        names = EOS_NAMES if eos is True else (str(eos),)
        found = next((lookup(n) for n in names if lookup(n) is not None), None)
        if found is None:
            raise ConfigError(f"the tokenizer's vocabulary has no end-of-document token among {', '.join(names)}: give --eos TOKEN")
    if found is None or not 0 <= found < tokenizer.get_vocab_size():
        raise ConfigError(f"EOS id {found} is outside the vocabulary of {tokenizer.get_vocab_size()}")
    return found


class _Encoder:
    """Texts -> id arrays (picklable: a worker process builds its tokenizer once from ``spec``)."""

    def __init__(self, spec: Any, eos: bool | str | int):
        self.spec, self.eos = spec, eos
        self._tokenizer: Any = None

    def setup(self) -> tuple[Any, int | None, np.dtype]:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.spec)
            self._eos = eos_id(self._tokenizer, self.eos)
            self._vocab = int(self._tokenizer.get_vocab_size())
            self._dtype = np.dtype(token_dtype(self._vocab))
        return self._tokenizer, self._eos, self._dtype

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "eos": self.eos}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(d["spec"], d["eos"])  # type: ignore[misc]

    def __call__(self, chunk: list[tuple[str, str]]) -> list[bytes]:
        tokenizer, eos, dtype = self.setup()
        encoded = tokenizer.encode_batch([text for _, text in chunk])
        out = []
        for (where, _), e in zip(chunk, encoded):
            ids = np.asarray(getattr(e, "ids", e), dtype=np.int64)
            if eos is not None:
                ids = np.append(ids, eos)
            if len(ids) and (ids.min() < 0 or ids.max() >= self._vocab):
                raise SourceError(where, f"the tokenizer gave id {int(ids.max())}, outside its vocabulary of {self._vocab}")
            buf = io.BytesIO()
            np.save(buf, ids.astype(dtype), allow_pickle=False)
            out.append(buf.getvalue())
        return out


def read_documents(
    src: str | Iterable[str], text_field: str, storage_options: Mapping[str, Any] | None = None, config: StorageConfig = DEFAULT_STORAGE
) -> Iterator[tuple[str, str]]:
    """``(where, text)`` for each document: JSONL lines (``where`` is ``file:line``), a Parquet
    column's rows (``file:row``) or the strings of an iterable (``document N``)."""
    if not isinstance(src, str):
        for n, text in enumerate(src):
            if not isinstance(text, str):
                raise SourceError(f"document {n}", f"expected a string, got {type(text).__name__}")
            yield f"document {n}", text
        return
    if not is_jsonl(src):
        yield from _parquet_documents(src, text_field, storage_options, config)
        return
    fs, path = storage.get_fs(src, storage_options, config)
    with fs.open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield _jsonl_text(raw, f"{src}:{n}", text_field)


def _jsonl_text(raw: bytes, where: str, text_field: str) -> tuple[str, str]:
    """One JSONL line's document: ``(where, its text_field)``; a SourceError naming the line."""
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SourceError(where, f"not valid JSON ({exc})") from None
    value = doc.get(text_field) if isinstance(doc, dict) else None
    if not isinstance(value, str):
        raise SourceError(where, f"no string field {text_field!r} (--text-field)")
    return where, value


def is_jsonl(src: Any) -> bool:
    """Whether ``read_documents`` reads ``src`` as one JSONL file (else Parquet, or an iterable)."""
    return isinstance(src, str) and not (
        is_table_url(src) or any(c in src for c in "*?[") or not src.rstrip("/").endswith((".jsonl", ".json", ".ndjson"))
    )


def _parquet_documents(src: str, text_field: str, storage_options: Mapping[str, Any] | None, config: StorageConfig) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError("reading Parquet documents needs pyarrow: pip install 'shardstream[tables]'") from exc
    _, files = list_table_files(src, storage_options, config)
    for url, _ in files:
        fs, path = storage.get_fs(url, storage_options, config)
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            if text_field not in pf.schema_arrow.names:
                raise SourceError(url, f"no column {text_field!r} (--text-field); columns: {', '.join(pf.schema_arrow.names)}")
            row = 0
            for g in range(pf.num_row_groups):
                for text in pf.read_row_group(g, columns=[text_field]).column(0).to_pylist():
                    if not isinstance(text, str):
                        raise SourceError(f"{url}:{row}", f"column {text_field!r} holds {type(text).__name__}, not a string")
                    yield f"{url}:{row}", text
                    row += 1


def _chunks(documents: Iterator[tuple[str, str]], size: int) -> Iterator[list[tuple[str, str]]]:
    chunk: list[tuple[str, str]] = []
    for doc in documents:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def pack_tokens(
    src: str | Iterable[str],
    dest: str,
    *,
    tokenizer: Any,
    text_field: str = "text",
    eos: bool | str | int = False,
    workers: int = 1,
    max_count: int = DEFAULT_MAX_COUNT,
    max_size: int = DEFAULT_MAX_SIZE,
    prefix: str = "shard",
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    config: StorageConfig = DEFAULT_STORAGE,
    executor: Executor | None = None,
) -> PackResult:
    """Tokenize ``src``'s documents into a token corpus at ``dest`` (see the module docstring).
    ``src``: a ``.jsonl`` file (``text_field`` of each line's object), Parquet files (a file, a
    glob, a folder: the ``text_field`` column) or an iterable of strings. ``workers`` processes
    tokenize (spawned: ``tokenizer`` is rebuilt in each from its file or ``module:function``, or
    pickled); the output is the same for any number. A bad line or row is a SourceError naming it.
    ``executor``: one task per shard on it (a ``.jsonl`` source only; see the module docstring)."""
    check_dataset_root(dest)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"workers must be an integer >= 1, got {workers!r}")
    started = time.perf_counter()
    encoder = _Encoder(tokenizer, eos)
    tok, eos_token, dtype = encoder.setup()  # a bad tokenizer or EOS fails here, before anything is written
    info = {
        "dtype": dtype.name,
        "vocab_size": int(tok.get_vocab_size()),
        "eos_id": eos_token,
        "field": FIELD,
        "tokenizer": tokenizer if isinstance(tokenizer, str) else type(tokenizer).__name__,
        "text_field": text_field if isinstance(src, str) else None,
    }
    if executor is not None:
        if not is_jsonl(src):
            raise ConfigError(
                "token packing as shard tasks (--dask, executor=) reads a .jsonl corpus only so far: "
                "pack Parquet files or an iterable of strings with workers=N (--workers N)"
            )
        assert isinstance(src, str)
        return _pack_token_tasks(
            src, dest, encoder, info, dtype, executor=executor, text_field=text_field, max_count=max_count, max_size=max_size,
            prefix=prefix, overwrite=overwrite, storage_options=storage_options, progress=progress, config=config, started=started,
        )  # fmt: skip
    documents = read_documents(src, text_field, storage_options, config)
    with contextlib.ExitStack() as stack:
        mapped: Iterator[list[bytes]]
        chunks = _chunks(documents, CHUNK)
        if workers > 1:  # in order: the same shards for any workers; two chunks a worker in flight
            mapped = stack.enter_context(
                contextlib.closing(
                    map_in_order(encoder, chunks, workers=workers, ahead=2 * workers, describe=_describe_chunk, name="tokenizer worker")
                )
            )
        else:
            mapped = map(encoder, chunks)
        writer = stack.enter_context(
            ShardWriter(
                dest,
                max_count=max_count,
                max_size=max_size,
                prefix=prefix,
                storage_options=storage_options,
                overwrite=overwrite,
                check_unique_keys=False,  # keys are document numbers
                config=config,
                token_info=info,
            )
        )
        itemsize = dtype.itemsize
        n = 0
        for arrays in mapped:
            for data in arrays:
                tokens = (len(data) - npy_header_size(data)) // itemsize
                writer.write_encoded(f"{n:012d}", {FIELD: data}, tokens=tokens)
                n += 1
                if progress is not None:
                    progress(writer.samples_written, writer.bytes_written)
        if n == 0:
            raise SourceError(src if isinstance(src, str) else "documents", "no documents to pack")
    return PackResult.of(writer, started, tokens=writer.tokens_written)


class _LineRange:
    """A shard's documents in a JSONL file: bytes ``[start, stop)``, which begin at line ``line``
    with document number ``document`` (a task's one unit: small, picklable)."""

    __slots__ = ("document", "line", "src", "start", "stop")

    def __init__(self, src: str, start: int, stop: int, line: int, document: int):
        self.src, self.start, self.stop, self.line, self.document = src, start, stop, line, document

    def __getstate__(self) -> tuple[str, int, int, int, int]:
        return self.src, self.start, self.stop, self.line, self.document

    def __setstate__(self, state: tuple[str, int, int, int, int]) -> None:
        self.src, self.start, self.stop, self.line, self.document = state

    def __repr__(self) -> str:
        return f"{self.src} from line {self.line}"


def line_ranges(src: str, max_count: int, storage_options: Mapping[str, Any] | None, config: StorageConfig) -> list[_LineRange]:
    """A JSONL file's documents (its non-blank lines) cut into shards of ``max_count``, as byte
    ranges: one read of the file, nothing parsed."""
    fs, path = storage.get_fs(src, storage_options, config)
    bounds: list[list[int]] = []  # [start, line, document] of each shard
    offset = count = 0
    with fs.open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                if count % max_count == 0:
                    bounds.append([offset, n, count])
                count += 1
            offset += len(raw)
    stops = [b[0] for b in bounds[1:]] + [offset]
    return [_LineRange(src, start, stop, line, document) for (start, line, document), stop in zip(bounds, stops)]


class _ShardDocuments:
    """A shard task's function (write/tasks.py): its ``_LineRange`` -> its documents' samples,
    tokenized as ``pack_tokens`` tokenizes in order (picklable: the encoder rebuilds its tokenizer)."""

    def __init__(self, encoder: _Encoder, text_field: str, storage_options: Mapping[str, Any], config: StorageConfig):
        self.encoder, self.text_field, self.storage_options, self.config = encoder, text_field, dict(storage_options), config

    def __call__(self, unit: _LineRange) -> list[dict[str, Any]]:
        fs, path = storage.get_fs(unit.src, self.storage_options, self.config)
        with fs.open(path, "rb") as f:
            f.seek(unit.start)
            data = f.read(unit.stop - unit.start)
        try:
            docs = [_jsonl_text(raw, f"{unit.src}:{unit.line + k}", self.text_field) for k, raw in enumerate(data.split(b"\n")) if raw.strip()]
            arrays = [a for chunk in _chunks(iter(docs), CHUNK) for a in self.encoder(chunk)]
        except SourceError as exc:  # the task names its unit; the line goes in the message
            raise SourceError(exc.where, f"{exc.where}: {exc.what}") from None
        return [{"__key__": f"{unit.document + n:012d}", FIELD: a} for n, a in enumerate(arrays)]


def _pack_token_tasks(
    src: str,
    dest: str,
    encoder: _Encoder,
    info: dict[str, Any],
    dtype: np.dtype,
    *,
    executor: Executor,
    text_field: str,
    max_count: int,
    max_size: int,
    prefix: str,
    overwrite: bool,
    storage_options: Mapping[str, Any] | None,
    progress: Callable[[int, int], None] | None,
    config: StorageConfig,
    started: float,
) -> PackResult:
    """A JSONL corpus packed as one task a shard on ``executor``; the manifest written last."""
    ranges = line_ranges(src, max_count, storage_options, config)
    if not ranges:
        raise SourceError(src, "no documents to pack")
    options = dict(storage_options or {})
    fn = _ShardDocuments(encoder, text_field, options, config)
    tokens = 0
    with ShardWriter(
        dest, max_count=max_count, max_size=max_size, prefix=prefix, storage_options=options, overwrite=overwrite,
        check_unique_keys=False, config=config, token_info=info,
    ) as writer:  # fmt: skip
        tasks = (
            ShardTask(dest=writer.dest, name=shard_name(prefix, i), index=i, first=i, units=[r], fn=fn, storage_options=options,
                      config=config, token_itemsize=dtype.itemsize)
            for i, r in enumerate(ranges)
        )  # fmt: skip
        results = run_tasks(executor, tasks)
        with contextlib.closing(results):
            for result in results:
                adopt(writer, result, max_size, progress)
                tokens += int(result.info.tokens or 0)
        writer.remove_partials()  # left by attempts the engine killed and retried elsewhere
    return PackResult.of(writer, started, tokens=tokens)


def _describe_chunk(chunk: list[tuple[str, str]]) -> str:
    return f"tokenizing {len(chunk)} documents, {chunk[0][0]} to {chunk[-1][0]}"
