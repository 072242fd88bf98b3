"""ShardStream's rare options as small frozen values, each knob documented once, here.

The common call stays one line, ``ShardStream(root, batch_size=64)``; a group of related knobs
travels as one value (as httpx passes ``Timeout(...)`` and ``Limits(...)``):

    Shuffle(buffer=1000, initial=None, documents=False)    sample shuffle buffer (and a token corpus's documents)
    Decode(decoders=None, image="tensor", draft_size=None, required=(), defaults=True, alias=None, size=None)
    OnError(policy="raise", tolerance=16)                  bad samples and broken ranges
    Store(options=None, config=StorageConfig(), read=Read(), cache=None)   where the shards are, how they are read
    Read(read_size=4 MiB, readahead_bytes=None, verify_stream=False, readahead_threads=1)
    Cache(dir, limit, verify=True)                         local copies of remote shards
    Schedule(steps=None, samples_per_epoch=None, per_batch="spread", tokens=None)   a pass's length, a mix's interleave

Every value checks itself when built, so a bad option is a ConfigError at the call that made it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec.utils

from shardstream.errors import ConfigError
from shardstream.format.tar import DEFAULT_READ_SIZE
from shardstream.pipeline.decode import IMAGE_MODES, image_size
from shardstream.plan.mix import PER_BATCH
from shardstream.plan.run import check_length
from shardstream.policy import ON_ERROR
from shardstream.redact import masked_repr
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig

DEFAULT_READAHEAD = 64 << 20
LOCAL_PROTOCOLS = ("file", "local")


@dataclass(frozen=True)
class Shuffle:
    """Buffered sample shuffle within each worker (the shard order is shuffled by the plan).

    ``buffer``: samples held for shuffling (the memory bound; 1 or 0 turns the buffer off).
    ``initial``: samples held before the first one comes out (default ``buffer // 10``, at least 1):
    smaller starts sooner, larger mixes the first batches better.
    ``documents``: token corpora only (``Tokens`` sources): every epoch also lays each shard's
    documents in a fresh order of (seed, epoch, source, shard) before the shard is cut into
    sequences, so sequences hold other documents side by side every epoch. A shard's tokens keep
    their place in the stream, so the plan, resume and mixes count sequences as before
    (docs/tokens.md, "Shuffle documents").
    """

    buffer: int = 1000
    initial: int | None = None
    documents: bool = False

    def __post_init__(self) -> None:
        if self.buffer < 0:
            raise ConfigError(f"Shuffle(buffer=...) must be >= 0, got {self.buffer}")
        if self.initial is not None and self.initial < 1:
            raise ConfigError(f"Shuffle(initial=...) must be >= 1, got {self.initial}")
        if not isinstance(self.documents, bool):
            raise ConfigError(f"Shuffle(documents=...) must be True or False, got {self.documents!r}")

    @property
    def initial_fill(self) -> int:
        return self.initial if self.initial is not None else max(1, self.buffer // 10)


@dataclass(frozen=True)
class Decode:
    """How sample fields are decoded, by extension.

    ``defaults``: start from the default decoders (images, npy, json, txt, cls, pth, gunzip of
    ``.gz``); False keeps every field as stored (``.gz`` ones compressed too) except those in
    ``decoders``. ``decoders``: ``{ext: fn(bytes)}`` added to (or overriding) the defaults.
    ``image``: ``"tensor"`` (uint8 CHW), ``"numpy"`` (HWC) or ``"pil"``. ``draft_size``: ``(w, h)``,
    decode JPEGs at the smallest 1/2..1/8 scale still covering it. ``required``: extensions every
    sample must have; a sample without one is a SampleError (raised, or skipped and counted under
    ``OnError("skip")``). ``alias``: ``{name: "jpg;png;webp"}`` (or a list of extensions), one
    field ``name`` for whichever of them a sample has: once decoded, the first of them present (in
    the order given) is renamed ``name`` and the others present are dropped, as webdataset's
    ``rename(image="jpg;png")``; an ImageFolder of .jpg and .png files then batches as one field.
    ``required`` may name an alias (any of its extensions meets it). ``size``: an int (a square)
    or ``(w, h)``; every image is scaled to cover it, aspect kept, and centre-cropped to it, so an
    ImageFolder of mixed sizes batches as one ``uint8 [B, 3, h, w]`` tensor (JPEGs are drafted at
    that size unless ``draft_size`` is given). None (the default) keeps each image's own size.
    """

    decoders: Mapping[str, Callable[[bytes], Any]] | None = None
    image: str = "tensor"
    draft_size: tuple[int, int] | None = None
    required: tuple[str, ...] = ()
    defaults: bool = True
    alias: Mapping[str, str | Sequence[str]] | None = None
    size: int | tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", image_size(self.size))
        if self.image not in IMAGE_MODES:
            raise ConfigError(f"Decode(image=...) must be one of {IMAGE_MODES}, got {self.image!r}")
        if isinstance(self.required, str):
            object.__setattr__(self, "required", (self.required,))
        else:
            object.__setattr__(self, "required", tuple(self.required))
        if self.decoders is not None:
            if not isinstance(self.decoders, Mapping):
                raise ConfigError(f"Decode(decoders=...) must map extensions to functions, got {type(self.decoders).__name__}")
            object.__setattr__(self, "decoders", dict(self.decoders))
        if self.alias is not None:
            object.__setattr__(self, "alias", _check_alias(self.alias))

    @classmethod
    def of(cls, value: bool | Mapping[str, Callable[[bytes], Any]] | Decode) -> Decode:
        """The ``decode=`` convenience: True (defaults), False (bytes), a dict (added decoders), or a Decode."""
        if isinstance(value, Decode):
            return value
        if isinstance(value, bool):
            return cls(defaults=value)
        if isinstance(value, Mapping):
            return cls(decoders=value)
        raise ConfigError(f"decode must be True, False, a dict {{ext: fn}} or a Decode(...), got {type(value).__name__}")


def _check_alias(alias: Any) -> dict[str, tuple[str, ...]]:
    """``{name: "jpg;png"}`` or ``{name: ["jpg", "png"]}`` -> ``{name: ("jpg", "png")}``, checked."""
    if not isinstance(alias, Mapping):
        raise ConfigError(f'Decode(alias=...) maps a field name to its alternatives, e.g. {{"image": "jpg;png"}}, got {type(alias).__name__}')
    out: dict[str, tuple[str, ...]] = {}
    owner: dict[str, str] = {}
    for name, alts in alias.items():
        if not isinstance(name, str) or not name or name.startswith("__"):
            raise ConfigError(f"Decode(alias=...): {name!r} is not a field name (a non-empty string not starting with '__')")
        parts = alts.split(";") if isinstance(alts, str) else list(alts) if isinstance(alts, Sequence) else None
        if not parts or not all(isinstance(p, str) and p and p.strip() == p and not p.startswith("__") for p in parts):
            raise ConfigError(f'Decode(alias={{{name!r}: ...}}) lists the extensions it stands for, e.g. "jpg;png;webp", got {alts!r}')
        for ext in parts:
            if ext in owner and owner[ext] != name:
                raise ConfigError(f"Decode(alias=...): extension {ext!r} is an alternative of both {owner[ext]!r} and {name!r}")
            owner[ext] = name
        out[name] = tuple(dict.fromkeys(parts))
    return out


@dataclass(frozen=True)
class OnError:
    """What a bad sample or a broken shard range does.

    ``policy="raise"`` stops at the first failure with its error; ``"skip"`` drops it (counted,
    logged, batches kept equal by repeating recent samples) and still raises after ``tolerance``
    consecutive failures.
    """

    policy: str = "raise"
    tolerance: int = 16

    def __post_init__(self) -> None:
        if self.policy not in ON_ERROR:
            raise ConfigError(f"on_error must be one of {ON_ERROR}, got {self.policy!r}")
        if self.tolerance < 0:
            raise ConfigError(f"OnError(tolerance=...) must be >= 0, got {self.tolerance}")

    @classmethod
    def of(cls, value: str | OnError) -> OnError:
        return value if isinstance(value, OnError) else cls(value)


@dataclass(frozen=True)
class Read:
    """How shard ranges are read.

    ``read_size``: bytes per read (one ranged GET on S3). ``readahead_bytes``: background threads
    fetch up to this many bytes ahead of the parser, across ranges and a pass's windows, for the
    whole worker (a mix's sources share it; plus the one block the parser waits on; a Parquet
    table source has one of its own); ``None`` (the default) means
    64 MiB when any of the dataset's shards is on remote storage (an fsspec URL other than a local
    path or ``file://``) and 0 when all are on local disk, where the page cache already reads ahead. ``verify_stream``: hash every
    whole-shard range as it streams (no cache) and compare with the manifest's sha256. ``readahead_threads``:
    ranges fetched at once by the read-ahead: more lets small shards on a high-latency store cost a
    round trip per N shards rather than each (on the loopback moto server 4 measured slower than 1).
    """

    read_size: int = DEFAULT_READ_SIZE
    readahead_bytes: int | None = None
    verify_stream: bool = False
    readahead_threads: int = 1

    def __post_init__(self) -> None:
        if self.read_size < 1:
            raise ConfigError(f"Read(read_size=...) must be >= 1 byte, got {self.read_size}")
        if self.readahead_bytes is not None and self.readahead_bytes < 0:
            raise ConfigError(f"Read(readahead_bytes=...) must be >= 0, got {self.readahead_bytes}")
        if self.readahead_threads < 1:
            raise ConfigError(f"Read(readahead_threads=...) must be >= 1, got {self.readahead_threads}")

    def readahead_for(self, shard_urls: Iterable[str]) -> int:
        """The read-ahead for a dataset of these shards: the explicit value, else the documented
        default by where the shards are."""
        if self.readahead_bytes is not None:
            return self.readahead_bytes
        remote = any(fsspec.utils.get_protocol(u) not in LOCAL_PROTOCOLS for u in shard_urls)
        return DEFAULT_READAHEAD if remote else 0


@dataclass(frozen=True)
class Cache:
    """Keep remote shards on local disk for later epochs (LRU, shared by a node's workers and ranks).

    ``dir``: where; ``limit``: bytes of local disk it may use (at least the largest shard; give it
    room for several per worker); ``verify``: check each fill against the manifest's sha256, and each
    hit against the CRC-32 recorded at its fill (a damaged copy is dropped and fetched again).
    """

    dir: str
    limit: int
    verify: bool = True

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ConfigError(f"Cache(limit=...) is bytes of local disk the cache may use, got {self.limit}")


@dataclass(frozen=True)
class Store:
    """Where the shards are and how they are read: one value for the store.

    ``options``: fsspec storage options, e.g. ``{"endpoint_url": ..., "profile": ...}`` for S3 (a
    mix's ``Source`` may give its own). ``config``: ``StorageConfig``, one policy for every storage
    request (timeouts, retries, deadline, allowed roots, the S3 client). ``read``: ``Read(...)``,
    how ranges are read. ``cache``: ``Cache(dir, limit)``, local copies of remote shards, or None.
    """

    options: Mapping[str, Any] | None = None
    config: StorageConfig = DEFAULT_STORAGE
    read: Read = field(default_factory=Read)
    cache: Cache | None = None

    __repr__ = masked_repr  # (credentials in ``options`` shown masked)

    def __post_init__(self) -> None:
        if self.options is not None and not isinstance(self.options, Mapping):
            raise ConfigError(f"Store(options=...) is a mapping of fsspec storage options, got {type(self.options).__name__}")
        for name, kind in (("config", StorageConfig), ("read", Read), ("cache", Cache)):
            value = getattr(self, name)
            if not isinstance(value, kind) and not (name == "cache" and value is None):
                raise ConfigError(f"Store({name}=...) must be a {kind.__name__}(...), got {type(value).__name__}")


@dataclass(frozen=True)
class Schedule:
    """How long a pass is, and how a mix interleaves its sources (plan/run.py, docs/mixing.md).

    ``steps``: batches every rank yields per loader epoch (``len(loader)``), drawn from data epochs
    laid back to back (None: a pass is one whole data epoch). ``samples_per_epoch``: the same,
    counted in samples over all ranks (steps = samples_per_epoch // (world_size * batch_size)).
    ``tokens``: the same for token corpora (``Tokens`` sources), counted in tokens trained on over
    all ranks, seq_len a sequence (steps = tokens // (world_size * batch_size * seq_len)): a run
    budgeted at 2e9 tokens is ``Schedule(tokens=2_000_000_000)`` and one pass over the loader.
    ``per_batch``: a mix's interleave, ``"spread"`` (every batch close to each source's share) or
    ``"exact"`` (the same count of each source in every batch).
    """

    steps: int | None = None
    samples_per_epoch: int | None = None
    per_batch: str = "spread"
    tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tokens, float) and self.tokens.is_integer():  # Schedule(tokens=2e9)
            object.__setattr__(self, "tokens", int(self.tokens))
        check_length(self.steps, self.samples_per_epoch, self.tokens)
        if self.per_batch not in PER_BATCH:
            raise ConfigError(f"Schedule(per_batch=...) must be one of {PER_BATCH}, got {self.per_batch!r}")


# Keywords ShardStream took before they were grouped, and where they live now.
MOVED = {
    "storage_options": "store=Store(options={...})",
    "storage": "store=Store(config=StorageConfig(...))",
    "read": "store=Store(read=Read(...))",
    "cache": "store=Store(cache=Cache(...))",
    "steps": "schedule=Schedule(steps=N)",
    "samples_per_epoch": "schedule=Schedule(samples_per_epoch=S)",
    "per_batch": "schedule=Schedule(per_batch=...)",
}


def refuse_moved(where: str, given: Mapping[str, Any]) -> None:
    """A ConfigError naming the new spelling of a keyword that moved; TypeError for an unknown one."""
    for name in given:
        if name in MOVED:
            raise ConfigError(f"{where}({name}=...) moved: pass {MOVED[name]}")
        raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")


__all__ = ["Shuffle", "Decode", "OnError", "Read", "Cache", "Store", "Schedule", "DEFAULT_READAHEAD"]
