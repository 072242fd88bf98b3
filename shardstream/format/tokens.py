"""A token corpus read as fixed-length sequences: ``Tokens(url, seq_len)`` and its ``TokenManifest``.

A token corpus is a dataset packed with a tokenizer (write/tokens.py): one sample per document,
its token ids as ``tokens.npy`` (uint16 or uint32, by the vocabulary's size), and a manifest that
counts each shard's tokens (``Manifest.tokens``). Its documents laid end to end in shard order
are one stream of T tokens; sequence j is tokens ``[j * W, (j + 1) * W)`` of it, W = seq_len + 1
(the inputs and their shifted targets), so the corpus holds ``T // W`` sequences and no token
is in two of them. What is left at the end (under W tokens) is in no sequence.

Planning needs only a count per shard, so a ``TokenManifest`` is the corpus's manifest with
sequences as its samples: shard i "holds" the sequences that start inside it (a sequence may run
on into the next shards). The plan, the shuffle, the resume state and a mix's weights then work
on sequences, that is on tokens, exactly as they do on samples (plan/run.py). Pure: no I/O.

Token corpora written by others are sources too (sources.py counts their tokens): a Parquet table
with a ``list<int>`` column (``field``, "input_ids" by default: Hugging Face datasets' name),
whose row groups are the shards and rows the documents, and tar shards with one 1-D integer
``.npy`` array per sample (``field``, the member's extension: "npy", "input_ids.npy", ...). Any
integer dtype is kept as it is (``INT_DTYPES``); ``check_ids`` refuses ids that are negative or
beyond the corpus's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardstream.errors import ConfigError, ManifestError
from shardstream.format.manifest import Manifest

FIELD = "tokens.npy"  # each document's member: its token ids
TABLE_FIELD = "input_ids"  # a Parquet table's column of token ids by default (as Hugging Face datasets name it)
DTYPES = ("uint16", "uint32")  # what pack_tokens writes
INT_DTYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")  # what a corpus may hold
INT64_MAX = np.iinfo(np.int64).max
BOUNDARIES = ("positions", "documents", "offsets", None)  # what a batch says of where its documents start
DOCUMENTS_TAG = 0x646F63  # "doc": keeps the documents' random streams apart from the plan's


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id of a vocabulary of ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class Tokens:
    """A token corpus (``url``: its root, index.json URL or Manifest) streamed as sequences of
    ``seq_len + 1`` tokens, packed across documents: ``ShardStream(Tokens(root, seq_len=2048),
    batch_size=8)`` yields ``input_ids`` and ``position_ids``, int64 ``[8, 2049]`` (docs/tokens.md).
    A mix takes it as any source: ``Source(Tokens(root, seq_len=2048), weight=0.7)``.

    Token ids written by others too: ``url`` a Parquet table (a ``.parquet`` file, glob or
    folder) whose ``field`` column (default ``"input_ids"``) is ``list<int>``, one row per
    document; or tar shards (URLs, a pattern, or a root indexed by ``shardstream index --tokens
    FIELD``) with one 1-D integer ``.npy`` member ``field`` per sample (``"npy"`` as
    ``webdataset.TarWriter`` names it). ``field`` defaults to ``"tokens.npy"`` for tar shards,
    what ``pack_tokens`` writes, or to what the manifest says.

    ``boundaries``: what a batch says of where documents start, for attention to keep them apart:
    ``"positions"`` (default) ``position_ids`` counting from 0 at each document; ``"documents"``
    ``document_ids``, each row's documents numbered from 0 (a document mask); ``"offsets"``
    ``cu_seqlens`` (int32, the starts of the documents in the batch flattened to ``B * W``, and its
    end) and ``max_seqlen`` (flash attention's varlen kernels); ``None``: ``input_ids`` alone. The
    sequences, the plan and the resume state are the same for every setting."""

    url: str | Sequence[str] | Manifest
    seq_len: int
    field: str | None = None  # where each document's ids are: a tar member's extension, or a Parquet column
    boundaries: str | None = "positions"  # BOUNDARIES: what a batch carries beside input_ids

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ConfigError(f"Tokens(seq_len=...) must be a positive integer, got {self.seq_len!r}")
        if self.field is not None and (not isinstance(self.field, str) or not self.field):
            raise ConfigError(f"Tokens(field=...) must be a non-empty string (a .npy member's extension or a Parquet column), got {self.field!r}")
        if self.boundaries not in BOUNDARIES:
            raise ConfigError(f"Tokens(boundaries=...) must be one of {', '.join(map(repr, BOUNDARIES))}, got {self.boundaries!r}")

    @property
    def label(self) -> str:
        if isinstance(self.url, Manifest):
            return self.url.base_url or "tokens"
        return self.url if isinstance(self.url, str) else (self.url[0] if self.url else "tokens")


def document_order(count: int, *, seed: int, epoch: int, source: int, shard: int) -> np.ndarray:
    """The order of a shard's ``count`` documents in data epoch ``epoch`` under
    ``Shuffle(documents=True)``: a permutation of (seed, epoch, source, shard), the same in every
    rank, worker and resumed run, so a sequence's tokens are a function of the plan alone."""
    return np.random.default_rng([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, epoch, DOCUMENTS_TAG, source, shard]).permutation(count)


def npy_header_size(data: bytes) -> int:
    """Bytes before a ``.npy`` file's data (version 1: 10 + header length; 2 and 3: 12 + it): a
    document's token count is ``(len(data) - npy_header_size(data)) // itemsize``."""
    if data[6] == 1:
        return 10 + int.from_bytes(data[8:10], "little")
    return 12 + int.from_bytes(data[8:12], "little")


def check_ids(array: np.ndarray, dtype: np.dtype) -> str | None:
    """What is wrong with a document's token ids for a corpus of ``dtype`` (None: nothing): an id
    below 0, or beyond ``dtype`` (an array of a wider dtype than the corpus's), or beyond int64
    (the batches' dtype). O(n), once per document read."""
    if array.dtype.kind not in "iu":
        return f"token ids must be integers, got {array.dtype}"
    if not len(array):
        return None
    low, high = int(array.min()), int(array.max())
    if low < 0:
        return f"token id {low} is negative"
    top = min(int(np.iinfo(dtype).max), INT64_MAX)
    if high > top:
        return f"token id {high} is beyond {'int64' if top == INT64_MAX else dtype} (at most {top})"
    return None


class TokenManifest(Manifest):
    """A token corpus's manifest (``docs``) with its sequences as samples (see the module docstring).

    ``token_starts[i]``: where shard i's tokens start in the corpus's stream (``token_starts[-1]``
    is T); ``first[i]``: the first sequence that starts in shard i; ``sequences``: T // W. Paths,
    sizes and digests are the corpus's shards'; ``counts`` are sequences. ``boundaries``:
    ``Tokens.boundaries``, what the batches carry (not what they hold)."""

    def __init__(self, docs: Manifest, seq_len: int, field: str = FIELD, boundaries: str | None = "positions"):
        super().__init__(extensions=docs.extensions, base_url=docs.base_url, token_info=docs.token_info)
        if docs.tokens is None or docs.token_info is None:
            where = docs.base_url or "this dataset"
            raise ManifestError(
                f"{where}: not a token corpus (its manifest counts no tokens): pack it with a tokenizer, "
                "`shardstream pack corpus.jsonl DEST --tokenizer tokenizer.json` (docs/tokens.md)"
            )
        dtype = docs.token_info.get("dtype")
        if dtype not in INT_DTYPES:
            raise ManifestError(f"{docs.base_url or 'manifest'}: token dtype {dtype!r} is not one of {', '.join(INT_DTYPES)}")
        self.docs, self.seq_len, self.window, self.field = docs, seq_len, seq_len + 1, field
        self.boundaries = boundaries  # what a batch carries beside input_ids (Tokens.boundaries); no part of the plan or its digest
        self.dtype = np.dtype(dtype)
        self.token_starts = np.concatenate([[0], np.cumsum(docs.tokens)]).astype(np.int64)
        total = int(self.token_starts[-1])
        self.sequences = total // self.window
        self.first = np.minimum(-(-self.token_starts // self.window), self.sequences)
        counts = np.diff(self.first)
        n = len(docs.paths)
        self._set_arrays(
            list(docs.paths), counts, docs.sizes, [docs.sha256(i) for i in range(n)], docs.spans, [docs.sidecar_path(i) for i in range(n)], {}
        )
        self.storage_options = dict(docs.storage_options)
        if self.sequences == 0:
            raise ConfigError(f"{docs.base_url or 'token corpus'}: {total} tokens hold no sequence of seq_len + 1 = {self.window} tokens")

    @property
    def left_over(self) -> int:
        """Tokens after the last whole sequence (fewer than seq_len + 1): in no sequence."""
        return int(self.token_starts[-1]) - self.sequences * self.window

    def shards_of(self, first_token: int, end_token: int) -> range:
        """The shards holding tokens [first_token, end_token) of the stream."""
        a = int(np.searchsorted(self.token_starts, first_token, side="right")) - 1
        b = int(np.searchsorted(self.token_starts, end_token - 1, side="right")) - 1
        return range(a, b + 1)

    def describe(self) -> dict[str, Any]:
        return {"tokens": int(self.token_starts[-1]), "sequences": self.sequences, "seq_len": self.seq_len, "left_over": self.left_over}
