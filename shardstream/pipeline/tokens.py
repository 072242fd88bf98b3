"""A worker's token sequences: planned sequence ranges in, batches of ``input_ids`` and
``position_ids`` out (format/tokens.py says what a sequence is).

Record shape: the plan's ranges of a source become sequence refs (int64 arrays, one per range:
the source's index in the high bits, the sequence's number below), which the shuffle and
``batch_refs`` move as they move a table's row refs; ``TokenReader.gather`` turns a batch's refs
into ``{"input_ids": int64 [B, W], "position_ids": int64 [B, W]}`` (W = seq_len + 1), plus
``__source__`` in a mix; ``Tokens(boundaries=...)`` swaps ``position_ids`` for ``document_ids``,
for ``cu_seqlens`` and ``max_seqlen``, or for nothing (``boundary_tensors``). Shards are read whole, through the stream's own range reads (retries,
cache, checksums), when a batch needs their tokens, and let go once no sequence waiting in the
shuffle buffer can need them; a shard let go too early is only read again, never wrong.

Shuffled documents (``Shuffle(documents=True)``, ``documents`` here: the stream's seed): a
shard's documents are laid in ``document_order(seed, epoch, source, shard)`` when it is read, so
the shard's tokens keep their span of the stream and only their order within it changes. A ref
then also carries its data epoch's low bits (``EPOCH_SHIFT``), and a shard is held per epoch.

Position ids count from 0 at each document's first token and at the sequence's first token, so
a model with learned or rotary positions of length W never sees a larger one, and attention can
keep documents apart (a document starts where the position id is 0 after the first column).
With ids alone a sequence is a slice of its shard's tokens (two where it spans shards) and no
more is computed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from shardstream.errors import ShardFormatError
from shardstream.format.parquet import TableManifest
from shardstream.format.tokens import TokenManifest, check_ids, document_order
from shardstream.pipeline.decode import load_npy
from shardstream.pipeline.read import RangeSource, read_ranges
from shardstream.pipeline.table import TableSource, read_groups
from shardstream.plan.mix import Range
from shardstream.policy import ErrorPolicy

SOURCE_SHIFT = 48  # a ref: epoch tag << 56 | source << 48 | sequence (2**48 sequences of a source at most)
SEQUENCE_MASK = (1 << SOURCE_SHIFT) - 1
EPOCH_SHIFT = 56  # shuffled documents: the ref's data epoch, mod 128 (refs of two epochs 128 apart are never in flight together)
SOURCE_MASK = (1 << (EPOCH_SHIFT - SOURCE_SHIFT)) - 1
EPOCH_TAGS = 1 << (63 - EPOCH_SHIFT)
MAX_SOURCES = SOURCE_MASK + 1  # token sources of a mix


# The header np.save writes for a 1-D array (format 1.0): its dtype and length, padded to 64 bytes.
_VECTOR_HEADER = re.compile(rb"\{'descr': '([<>|][iu][1248])', 'fortran_order': False, 'shape': \((\d+),\), \} *\n")


def token_vector(data: bytes | memoryview) -> np.ndarray | None:
    """A document's ``.npy`` as ``np.save`` writes a 1-D integer array: a view of its ids, its
    header matched by one regular expression (``load_npy`` caches parsed headers, but documents
    differ in length, so theirs are never alike and each would be parsed with ``ast``); None for
    any other ``.npy``, which ``load_npy`` reads. The caller copies (the shard's concatenation)."""
    if bytes(data[:8]) != b"\x93NUMPY\x01\x00":
        return None
    offset = 10 + int.from_bytes(bytes(data[8:10]), "little")
    found = _VECTOR_HEADER.fullmatch(bytes(data[10:offset]))
    if found is None:
        return None
    dtype, count = np.dtype(found.group(1).decode()), int(found.group(2))
    if memoryview(data).nbytes - offset < count * dtype.itemsize:
        raise ValueError(f"EOF: .npy data holds {memoryview(data).nbytes - offset} bytes, its header needs {count * dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset)


class _Shard:
    __slots__ = ("doc_starts", "tokens")

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray):
        self.tokens, self.doc_starts = tokens, doc_starts  # the shard's tokens; its documents' starts in the stream


class TokenReader:
    """The sequences of a worker's sources (``TokenManifest`` each, read through ``sources``)."""

    def __init__(
        self,
        manifests: Sequence[TokenManifest],
        sources: Sequence[RangeSource | TableSource],
        names: Sequence[str] | None,
        policy: ErrorPolicy,
        documents: int | None = None,
    ):
        self.manifests, self.sources, self.names, self.policy = list(manifests), list(sources), names, policy
        self.documents = documents  # the seed of the documents' order, or None: the corpus's order
        self.epochs: dict[int, int] = {}  # a ref's epoch tag -> the data epoch it stands for
        self.held: dict[tuple[int, int, int], _Shard] = {}  # (source, shard, epoch tag)
        self.waiting = [np.zeros(len(m.paths), dtype=np.int64) for m in self.manifests]  # refs not yet gathered, by the shard they start in
        # reach[i][s]: the first shard whose sequences may run into shard s
        self.reach = [np.searchsorted(m.token_starts[1:], m.token_starts[:-1] - m.window + 1, side="right") for m in self.manifests]
        self.shards_read = 0

    def refs(self, i: int, ranges: Sequence[Range], epoch: int = 0) -> Iterator[np.ndarray]:
        """Source i's planned ranges (of data epoch ``epoch``) as sequence refs, one array per range."""
        m = self.manifests[i]
        tag = 0
        if self.documents is not None:
            tag = epoch % EPOCH_TAGS
            self.epochs[tag] = epoch
        for rng in ranges:
            first = int(m.first[rng.shard])
            self.waiting[i][rng.shard] += len(rng)
            yield np.arange(first + rng.start, first + rng.stop, dtype=np.int64) | (i << SOURCE_SHIFT) | (tag << EPOCH_SHIFT)

    def gather(self, refs: np.ndarray) -> dict[str, Any]:
        """A batch: each ref's sequence of W tokens, and what ``boundaries`` asks of where its
        documents start (see the module docstring)."""
        import torch

        refs = np.asarray(refs, dtype=np.int64)
        first = self.manifests[int((refs[0] >> SOURCE_SHIFT) & SOURCE_MASK)]
        width, boundaries = first.window, first.boundaries
        ids = np.empty((len(refs), width), dtype=np.int64)
        marks = np.zeros((len(refs), width), dtype=np.int64) if boundaries is not None else None  # 1 where a document starts (column 0 too)
        sources = ((refs >> SOURCE_SHIFT) & SOURCE_MASK).tolist()
        tags = (refs >> EPOCH_SHIFT).tolist()
        for row, (i, seq, tag) in enumerate(zip(sources, (refs & SEQUENCE_MASK).tolist(), tags)):
            self._window(i, seq, tag, ids[row], marks[row] if marks is not None else None)
        self._release(sources, refs & SEQUENCE_MASK)
        batch: dict[str, Any] = {"input_ids": torch.from_numpy(ids)}
        if marks is not None and boundaries is not None:
            batch.update(boundary_tensors(marks, boundaries))
        if self.names:
            batch["__source__"] = [self.names[i] for i in sources]
        return batch

    def _window(self, i: int, seq: int, tag: int, ids: np.ndarray, marks: np.ndarray | None) -> None:
        """Sequence ``seq``'s tokens into ``ids`` (a slice per shard it spans), and 1 into
        ``marks`` where one of its documents starts (None: ids alone)."""
        m = self.manifests[i]
        a = seq * m.window
        b = a + m.window
        starts = []
        for s in m.shards_of(a, b):
            shard = self._shard(i, s, tag)
            lo, hi = max(a, int(m.token_starts[s])), min(b, int(m.token_starts[s + 1]))
            base = int(m.token_starts[s])
            ids[lo - a : hi - a] = shard.tokens[lo - base : hi - base]
            starts.append(shard.doc_starts)
        if marks is None:
            return
        doc_starts = np.concatenate(starts) if len(starts) > 1 else starts[0]
        # The documents starting inside the window (O(W) at most, no search per token).
        marks[doc_starts[np.searchsorted(doc_starts, a, side="left") : np.searchsorted(doc_starts, b, side="left")] - a] = 1
        marks[0] = 1

    def _shard(self, i: int, s: int, tag: int = 0) -> _Shard:
        held = self.held.get((i, s, tag))
        if held is not None:
            return held
        m = self.manifests[i]
        docs = m.docs
        source = self.sources[i]
        tokens, lengths = self._table_shard(m, s, source) if isinstance(source, TableSource) else self._tar_shard(m, s, source)
        if len(tokens) != int(docs.tokens[s]):  # type: ignore[index]
            raise ShardFormatError(f"{self._name(m, s)}: holds {len(tokens)} tokens, the manifest says {int(docs.tokens[s])}")  # type: ignore[index]
        if self.documents is not None and len(lengths) > 1:
            order = document_order(len(lengths), seed=self.documents, epoch=self.epochs[tag], source=i, shard=s)
            tokens, lengths = self._reorder(tokens, lengths, order)
        doc_starts = (
            int(m.token_starts[s]) + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else m.token_starts[s : s + 1]
        )
        held = self.held[(i, s, tag)] = _Shard(tokens, np.asarray(doc_starts, dtype=np.int64))
        self.shards_read += 1
        return held

    @staticmethod
    def _reorder(tokens: np.ndarray, lengths: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A shard's documents laid end to end in ``order`` (its tokens and their lengths): one
        copy of the shard, a slice per document."""
        ends = np.cumsum(lengths)
        starts = (ends - lengths).tolist()
        ends_list = ends.tolist()
        parts = [tokens[starts[k] : ends_list[k]] for k in order.tolist()]
        return np.concatenate(parts), lengths[order]

    @staticmethod
    def _name(m: TokenManifest, s: int) -> str:
        docs = m.docs
        return docs.group_name(s) if isinstance(docs, TableManifest) else docs.shard_url(s)

    def _tar_shard(self, m: TokenManifest, s: int, source: RangeSource) -> tuple[np.ndarray, np.ndarray]:
        """Shard s's documents (one ``.npy`` member each, ``m.field``) end to end, in the corpus's dtype."""
        docs, field = m.docs, m.field
        parts, lengths = [], []
        for chunk in read_ranges(source, [Range(s, 0, int(docs.counts[s]))], policy=self.policy):
            for sample in chunk:
                data = sample.get(field)
                where = f"{docs.shard_url(s)}: sample {sample.get('__key__')!r}"
                if data is None:
                    raise ShardFormatError(f"{where} has no {field} (not a token corpus's shard)")
                try:
                    array = token_vector(data)
                    if array is None:
                        array = load_npy(data)
                except ValueError as exc:
                    raise ShardFormatError(f"{where}: {field} is not a .npy array ({exc})") from exc
                if array.ndim != 1:
                    raise ShardFormatError(f"{where}: {field} is {array.dtype}{list(array.shape)}, not a 1-D array of token ids")
                # (ids of the corpus's own unsigned dtype below 64 bits, what pack_tokens writes, are all valid)
                unchecked = array.dtype == m.dtype and m.dtype.kind == "u" and m.dtype.itemsize < 8
                wrong = None if unchecked else check_ids(array, m.dtype)
                if wrong is not None:
                    raise ShardFormatError(f"{where}: {field}: {wrong}")
                parts.append(array)
                lengths.append(len(array))
        tokens = np.concatenate(parts).astype(m.dtype, copy=False) if parts else np.empty(0, dtype=m.dtype)
        return tokens, np.asarray(lengths, dtype=np.int64)

    def _table_shard(self, m: TokenManifest, s: int, source: TableSource) -> tuple[np.ndarray, np.ndarray]:
        """Row group s's rows of token ids (a ``list<int>`` column): its values and its lists'
        lengths straight from Arrow's buffers, no loop per row."""
        import pyarrow as pa

        tokens, lengths = np.empty(0, dtype=m.dtype), np.empty(0, dtype=np.int64)
        for _, table, _ in read_groups(source, [Range(s, 0, int(m.docs.counts[s]))], self.policy):
            lists = table.column(0).combine_chunks()
            values = lists.flatten()  # the ids of its rows, in order (null rows hold none)
            if values.null_count:
                raise ShardFormatError(f"{self._name(m, s)}: column {m.field!r} holds a null token id")
            tokens = values.to_numpy(zero_copy_only=False)
            lengths = lists.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            if not pa.types.is_integer(values.type):
                raise ShardFormatError(f"{self._name(m, s)}: column {m.field!r} holds {values.type}, not integer token ids")
        wrong = check_ids(tokens, m.dtype)
        if wrong is not None:
            raise ShardFormatError(f"{self._name(m, s)}: column {m.field!r}: {wrong}")
        return tokens.astype(m.dtype, copy=False), lengths

    def _release(self, sources: list[int], seqs: np.ndarray) -> None:
        """Refs gathered: shards no waiting sequence can reach are let go."""
        for i in set(sources):
            m = self.manifests[i]
            mine = seqs[np.asarray(sources) == i]
            shards = np.searchsorted(m.first, mine, side="right") - 1
            np.subtract.at(self.waiting[i], shards, 1)
            np.maximum(self.waiting[i], 0, out=self.waiting[i])  # a refilled batch gathers refs twice
        for i, s, tag in list(self.held):
            lo = int(self.reach[i][s])
            if not self.waiting[i][lo : s + 1].any():
                del self.held[(i, s, tag)]


def boundary_tensors(marks: np.ndarray, boundaries: str) -> dict[str, Any]:
    """A batch's document boundaries as ``boundaries`` asks (format/tokens.py, ``Tokens``), from
    ``marks`` (int64 [B, W], 1 where a document starts in a row, column 0 always): numpy over
    the whole batch, nothing per token in Python."""
    import torch

    rows, width = marks.shape
    if boundaries == "documents":  # each row's documents numbered from 0
        return {"document_ids": torch.from_numpy(np.cumsum(marks, axis=1) - 1)}
    flat = np.flatnonzero(marks)  # where each document starts in the batch flattened to B * W
    if boundaries == "offsets":
        cu = np.append(flat, rows * width).astype(np.int32)
        return {"cu_seqlens": torch.from_numpy(cu), "max_seqlen": int(np.diff(cu).max())}
    # positions: the column minus the column of the last document start at or before it
    columns = np.arange(width, dtype=np.int64)
    last = marks * columns
    np.maximum.accumulate(last, axis=1, out=last)
    return {"position_ids": torch.from_numpy(columns - last)}
