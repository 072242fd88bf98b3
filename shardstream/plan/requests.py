"""How many requests an epoch makes of the store, from its plan alone (pure, no I/O).

Every (rank, worker) reads its planned ranges, and a range is one GET (``storage/retry.py``); a
range that starts or ends inside a shard needs that shard's offset sidecar too, one GET per
process (each worker process is one; sidecars are cached per process, so a rank's thread workers
share theirs and the count is then an upper bound). So per epoch:

    GETs of shard bytes = the ranges of all (rank, worker) slices: every shard once per lap of the
                          laid-out sequence it falls in, plus one for each slice boundary inside it
    sidecar GETs        = (process, shard) pairs with a range that starts or ends inside the shard,
                          and for a shard with a member sidecar (format/members.py: it holds the
                          offsets, and the reader slices the shard with it) every (process, shard)
                          pair that reads the shard at all (at most: persistent workers keep their
                          sidecars from an epoch before)

A Parquet table (format/parquet.py) makes per (process, row group) one GET per run of adjacent
projected columns, and per (process, file) one footer GET at most: ``count_table_requests``, and
``_table_source_count`` for a table in a mix.

A mix (plan/mix.py) is counted source by source, each on its own manifest (a local source makes
no requests), and the counts add up (``RequestCount.combine``; a prefix two sources share adds
up). A source's epoch sequence is drawn pass by pass, each pass its shards in a fresh order on a
circle entered at an offset, and every (rank, worker) reads a run of it (more in pad mode, where
the mixed sequence wraps around). Its ranges break at shard starts, pass boundaries, the end of
the sequence and every worker slice's first sample; a range starts or ends inside a shard where a
slice cuts one, and where a pass is entered (or left) at an offset inside a shard.

S3 serves about 5,500 GET (and HEAD) requests per second per prefix (its documented rate; above it
answers 503 SlowDown) and bills every request. The GETs of an epoch spread over its reading time:
at ``rate`` bytes per second per rank, an epoch of B bytes lasts B / (rate x ranks) seconds, and
each prefix (the directory part of a shard's URL, where ``shardstream pack --prefixes N`` spreads
them) takes its share. ``RequestCount.describe`` says it in one line, with a warning when the
busiest prefix would go past S3's rate. A mix's epoch lasts as long as all its sources' bytes take
(a local source's too), and each source's GETs spread over it.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardstream.format.parquet import TableManifest, projected_runs

S3_GETS_PER_PREFIX = 5_500  # S3's documented GET/HEAD requests per second per prefix
DEFAULT_RATE = 1e9  # bytes per second per rank that summaries assume (a fast reader)

_PREFIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # manifest -> (names, id per shard)


def shard_prefixes(manifest: Any) -> tuple[list[str], np.ndarray]:
    """``(prefixes, ids)``: the distinct directories of the manifest's shards (as URLs) and each
    shard's index into them; computed once per manifest from its path column."""
    found = _PREFIXES.get(manifest)
    if found is None:
        index: dict[str, int] = {}
        ids = np.fromiter((index.setdefault(p.rpartition("/")[0], len(index)) for p in manifest.paths), dtype=np.int64, count=len(manifest.paths))
        names = [manifest.resolve(d) if d else (manifest.base_url or ".") for d in index]
        found = _PREFIXES[manifest] = (names, ids)
    return found


@dataclass(frozen=True)
class RequestCount:
    """The requests of one epoch over all ranks (``count_requests``; a mix's, ``count_mix_requests``)."""

    ranges: int  # GETs of shard bytes: one per planned range
    sidecars: int  # GETs of sidecars (offset or member sidecars), at most
    bytes: int  # bytes the epoch reads, about (a mix: all its sources', a local one's too)
    world_size: int
    by_prefix: tuple[tuple[str, int], ...]  # (prefix, GETs), the busiest first
    parts: tuple[tuple[str, RequestCount], ...] = ()  # a mix: each source's count, by name
    local: bool = False  # a source on local disk: its bytes take reading time, it makes no requests
    side: str = "sidecars"  # what ``sidecars`` counts: a table's are its files' footers (format/parquet.py)

    @property
    def gets(self) -> int:
        return self.ranges + self.sidecars

    @property
    def remote_bytes(self) -> int:
        """Bytes read with requests (a mix's local sources left out)."""
        if self.parts:
            return sum(p.remote_bytes for _, p in self.parts)
        return 0 if self.local else self.bytes

    @classmethod
    def combine(cls, parts: Sequence[tuple[str, RequestCount]]) -> RequestCount:
        """One count for a mix from each source's (name, count): requests and bytes add up, and so
        do the GETs of a prefix two sources share."""
        by_prefix: dict[str, int] = {}
        for _, part in parts:
            for name, gets in part.by_prefix:
                by_prefix[name] = by_prefix.get(name, 0) + gets
        sides = sorted({p.side for _, p in parts if not p.local})  # a table's are footers, a tar dataset's offset or member sidecars
        return cls(
            ranges=sum(p.ranges for _, p in parts),
            sidecars=sum(p.sidecars for _, p in parts),
            bytes=sum(p.bytes for _, p in parts),
            world_size=max((p.world_size for _, p in parts), default=1),
            by_prefix=_ranked(by_prefix.items()),
            parts=tuple(parts),
            side=" and ".join(sides) if sides else "sidecars",
        )

    def seconds(self, rate: float = DEFAULT_RATE) -> float:
        """How long the epoch reads when every rank reads ``rate`` bytes per second."""
        return self.bytes / (rate * self.world_size) if self.bytes else 0.0

    def per_second(self, rate: float = DEFAULT_RATE) -> float:
        """GETs per second over the whole job when every rank reads ``rate`` bytes per second."""
        seconds = self.seconds(rate)
        return self.gets / seconds if seconds > 0 else 0.0

    def busiest(self, rate: float = DEFAULT_RATE) -> tuple[str, float]:
        """The prefix with the most GETs and its GETs per second at ``rate``."""
        if not self.by_prefix or not self.gets:
            return "", 0.0
        name, gets = self.by_prefix[0]
        return name, self.per_second(rate) * gets / self.gets

    def warning(self, rate: float = DEFAULT_RATE) -> str | None:
        name, per_second = self.busiest(rate)
        if per_second <= S3_GETS_PER_PREFIX:
            return None
        return (
            f"{name} would get {per_second:,.0f} GET/s, above S3's {S3_GETS_PER_PREFIX:,} per prefix (503 SlowDown, "
            "and each GET is billed): use larger shards, or spread them over prefixes (shardstream pack --prefixes N)"
        )

    def describe(self, rate: float = DEFAULT_RATE) -> str:
        name, busiest = self.busiest(rate)
        prefixes = f"{len(self.by_prefix)} prefixes" if len(self.by_prefix) != 1 else "1 prefix"
        text = (
            f"requests: {self.gets:,} GETs per epoch ({self.ranges:,} ranges of {_human(self.remote_bytes / max(1, self.ranges))} "
            f"on average, one GET each, + at most {self.sidecars:,} {self.side}); at {_human(rate)}/s per rank x "
            f"{self.world_size} ranks: {self.per_second(rate):,.0f} GET/s, {busiest:,.0f} on the busiest of {prefixes} ({name})"
        )
        if self.parts:  # a mix: each source's share of them, over the same epoch
            seconds = self.seconds(rate)
            text += "; by source: " + ", ".join(
                f"{label} local (no requests)" if part.local else f"{label} {part.gets:,} GETs ({part.gets / seconds if seconds else 0.0:,.0f} GET/s)"
                for label, part in self.parts
            )
        warning = self.warning(rate)
        return text + (f"; WARNING: {warning}" if warning else "")


def _ranked(gets: Any) -> tuple[tuple[str, int], ...]:
    """(prefix, GETs) pairs with GETs, the busiest first."""
    return tuple(sorted(((name, int(n)) for name, n in gets if n), key=lambda kv: (-kv[1], kv[0])))


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def count_requests(plan: Any, manifest: Any) -> RequestCount:
    """The requests of ``plan`` (an ``EpochPlan``) over ``manifest``'s shards, for every rank and
    worker at once (see the module docstring), in a few vectorised steps: no range is listed. A
    table's (``TableManifest``): ``count_table_requests``."""
    if isinstance(manifest, TableManifest):
        return count_table_requests(plan, manifest)
    return _count_pieces(plan, manifest)


def _count_pieces(plan: Any, manifest: Any) -> RequestCount:
    """``count_requests`` for shards read as tar: a GET per piece of the plan, sidecars where a piece cuts a shard."""
    order = np.asarray(plan.shard_order, dtype=np.int64)
    starts = np.asarray(plan.starts, dtype=np.int64)
    n, world = plan.total_samples, plan.world_size
    covered = world * plan.samples_per_rank  # positions [0, covered) of the laid-out (maybe wrapped) sequence
    laps, rest = divmod(covered, n)
    pieces = np.full(len(order), laps, dtype=np.int64)  # GETs per entry of the order
    pieces[starts < rest] += 1
    begins = plan.slice_begins()
    slice_of = np.arange(len(begins), dtype=np.int64)
    cuts, cut_slices = begins[1:], slice_of[1:]  # boundaries inside the sequence, and the slice each starts
    entry = np.searchsorted(starts, cuts % n, side="right") - 1
    inside = (cuts % n) != starts[entry]
    np.add.at(pieces, entry[inside], 1)
    # sidecars: (slice, shard) pairs with a range starting or ending inside the shard
    pairs = [np.stack([cut_slices[inside], entry[inside]]), np.stack([cut_slices[inside] - 1, entry[inside]])]
    if rest:
        last = int(np.searchsorted(starts, rest, side="right") - 1)
        if rest != starts[last]:  # the epoch ends inside a shard (the dropped tail)
            pairs.append(np.array([[len(begins) - 1], [last]], dtype=np.int64))
    flat = np.concatenate(pairs, axis=1)
    sidecar_pairs = np.unique(flat[0] * len(order) + flat[1]) if flat.size else np.zeros(0, dtype=np.int64)
    members = _has_members(manifest)
    if members is not None and len(order):
        # a shard with a member sidecar: read once by every slice that reads any of it (its
        # sidecar holds the offsets: none besides): (slice, entry) of every piece's first sample
        laps_read = -(-covered // n)
        firsts = (np.arange(laps_read, dtype=np.int64)[:, None] * n + starts[None, :]).ravel()
        firsts = _distinct(np.concatenate([firsts[firsts < covered], begins[begins < covered]]))
        entries = np.searchsorted(starts, firsts % n, side="right") - 1
        read = _distinct((np.searchsorted(begins, firsts, side="right") - 1) * len(order) + entries)
        with_members = members[order]
        sidecar_pairs = np.concatenate([sidecar_pairs[~with_members[sidecar_pairs % len(order)]], read[with_members[read % len(order)]]])
    sidecars_per_entry = np.bincount(sidecar_pairs % len(order), minlength=len(order)) if len(order) else pieces * 0
    names, ids = shard_prefixes(manifest)
    per_prefix = np.bincount(ids[order], weights=pieces + sidecars_per_entry, minlength=len(names))
    ranked = _ranked(zip(names, per_prefix))
    total_bytes = int(np.asarray(manifest.sizes, dtype=np.int64)[order].sum()) if len(order) else 0
    return RequestCount(
        ranges=int(pieces.sum()),
        sidecars=int(len(sidecar_pairs)),
        bytes=int(total_bytes * covered / n) if n else 0,
        world_size=world,
        by_prefix=tuple(ranked),
    )


class _Sequence:
    """One source's epoch sequence as a mix draws it (``MixPlan.passes``): pass p is the source's
    N samples, its shards in ``order`` laid on a circle (``starts``), entered at ``offset``; its
    j-th sample is sample (offset + j - pN) mod N of the circle. Positions are numpy arrays."""

    def __init__(self, passes: Sequence[Any], counts: Sequence[int]):
        self.size = n = int(sum(counts))
        self.offsets = np.array([p.offset for p in passes], dtype=np.int64)
        self.which = np.repeat(np.arange(len(passes), dtype=np.int64), [len(p.order) for p in passes])  # the pass of each entry
        # pass p's shard starts as keys p*N + c: sorted over all passes at once
        self.keys = np.concatenate([np.asarray(p.starts, dtype=np.int64) for p in passes]) + self.which * n
        self.order = np.concatenate([np.asarray(p.order, dtype=np.int64) for p in passes])

    def _key(self, j: np.ndarray) -> np.ndarray:
        p = j // self.size
        return p * self.size + (self.offsets[p] + j - p * self.size) % self.size

    def shard(self, j: np.ndarray) -> np.ndarray:
        return self.order[np.searchsorted(self.keys, self._key(j), side="right") - 1]

    def _is_start(self, keys: np.ndarray) -> np.ndarray:
        return _member(keys, self.keys)

    def first_of_shard(self, j: np.ndarray) -> np.ndarray:
        """Whether sample j is its shard's first (a range from it needs no sidecar)."""
        return self._is_start(self._key(j))

    def last_of_shard(self, j: np.ndarray) -> np.ndarray:
        """Whether sample j is its shard's last (a range up to it needs no sidecar)."""
        after = self._key(j) + 1
        return (after % self.size == 0) | self._is_start(after)

    def cuts(self, quota: int) -> np.ndarray:
        """Where the sequence's ranges break, in (0, quota), sorted: its shards' starts in every
        pass, and the pass boundaries (where a pass stops at its offset and the next begins)."""
        n = self.size
        inside = self.which * n + (self.keys - self.which * n - self.offsets[self.which]) % n
        bounds = np.arange(1, len(self.offsets), dtype=np.int64) * n
        found = _distinct(np.concatenate([inside, bounds]))
        return found[(found > 0) & (found < quota)]


def _has_members(manifest: Any) -> np.ndarray | None:
    """Which shards have a member sidecar (``format/members.py``), or None where none has (or the
    source is a table): such a shard's sidecar is read by every process that reads the shard."""
    sizes = getattr(manifest, "member_bytes", None)
    if sizes is None or isinstance(manifest, TableManifest):
        return None
    has = np.asarray(sizes) >= 0
    return has if bool(has.any()) else None


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Whether each value is in ``sorted_set`` (sorted): np.isin for a set sorted already."""
    if not len(sorted_set):
        return np.zeros(len(values), dtype=bool)
    return sorted_set[np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)] == values


def _distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values (np.unique, without its hashing: sorting is faster here)."""
    values = np.sort(values)
    return values[np.concatenate([[True], values[1:] != values[:-1]])] if len(values) else values


def _unrolled(plan: Any, positions: np.ndarray) -> np.ndarray:
    """How far into each source's sequence each position of the laid-out mixed sequence is, its
    laps counted (pad mode wraps: lap k of source i starts at k * quota_i). Shape (positions, sources)."""
    quotas = np.asarray(plan.quotas, dtype=np.int64)
    out = np.empty((len(positions), len(quotas)), dtype=np.int64)
    used: dict[int, tuple[int, ...]] = {}
    for k, p in enumerate(positions.tolist()):
        laps, rest = divmod(p, plan.total_samples)
        if rest not in used:
            used[rest] = plan.used_before(rest)
        out[k] = laps * quotas + np.asarray(used[rest], dtype=np.int64)
    return out


def _bytes_read(manifest: Any, samples: int) -> int:
    """About the bytes of ``samples`` samples of the dataset (its mean sample, tar headers included)."""
    total = int(manifest.total_samples)
    return int(int(np.asarray(manifest.sizes, dtype=np.int64).sum()) * samples / total) if total else 0


def _source_count(plan: Any, source: int, manifest: Any, where: np.ndarray) -> RequestCount:
    """The requests of source ``source`` of ``plan`` (a ``MixPlan``) over ``manifest``'s shards, for
    every rank and worker at once (the module docstring): the ranges of its sequence, lap by lap,
    plus one per worker slice that cuts a range. ``where``: each slice's first position in the
    source's sequence, then the epoch's end (``_unrolled``)."""
    quota = int(plan.quotas[source])
    seq = _Sequence(plan.passes[source], plan.counts[source])
    starts, total = where[:-1], int(where[-1])  # each slice's first sample of the source; samples read
    names, ids = shard_prefixes(manifest)
    shards = len(ids)
    if total == 0:
        return RequestCount(ranges=0, sidecars=0, bytes=0, world_size=plan.world_size, by_prefix=())
    laps, rest = divmod(total, quota)
    cuts = seq.cuts(quota)
    firsts = np.concatenate([[0], cuts])  # where the ranges of a lap start
    ranges = laps * np.bincount(seq.shard(firsts), minlength=shards)
    if rest:
        ranges = ranges + np.bincount(seq.shard(firsts[firsts < rest]), minlength=shards)
    # a slice boundary that falls inside a range cuts it in two
    at = _distinct(starts[1:])
    at = at[(at > 0) & (at < total)]
    j = at % quota
    inside = (j != 0) & ~_member(j, cuts)  # not at a lap's start nor where a range breaks anyway
    ranges = ranges + np.bincount(seq.shard(j[inside]), minlength=shards)
    # sidecars: (slice, shard) pairs with a range starting or ending inside the shard. Only where a
    # range begins or ends off a shard boundary: at a slice boundary, a pass or lap boundary, the end
    passes = np.arange(len(seq.offsets), dtype=np.int64) * seq.size
    edges = (np.arange(laps + 1, dtype=np.int64)[:, None] * quota + passes[None, :]).ravel()
    edges = _distinct(np.concatenate([edges, at, [total]]))
    edges = edges[edges <= total]
    after = edges[edges < total]  # the first sample of the range that starts here
    after = after[~seq.first_of_shard(after % quota)]
    before = edges[edges > 0] - 1  # the last sample of the range that ends here
    before = before[~seq.last_of_shard(before % quota)]
    partial = np.concatenate([after, before])
    slice_of = np.searchsorted(starts, partial, side="right") - 1
    pairs = _distinct(slice_of * shards + seq.shard(partial % quota))
    members = _has_members(manifest)
    if members is not None:  # as in ``_count_pieces``: every (slice, shard) read, for a shard with a member sidecar
        read_laps = -(-total // quota)
        firsts_read = (np.arange(read_laps, dtype=np.int64)[:, None] * quota + firsts[None, :]).ravel()
        firsts_read = _distinct(np.concatenate([firsts_read[firsts_read < total], starts[(starts >= 0) & (starts < total)]]))
        read = _distinct((np.searchsorted(starts, firsts_read, side="right") - 1) * shards + seq.shard(firsts_read % quota))
        pairs = np.concatenate([pairs[~members[pairs % shards]], read[members[read % shards]]])
    sidecars = np.bincount(pairs % shards, minlength=shards)
    per_prefix = np.bincount(ids, weights=ranges + sidecars, minlength=len(names))
    return RequestCount(
        ranges=int(ranges.sum()),
        sidecars=int(len(pairs)),
        bytes=_bytes_read(manifest, total),
        world_size=plan.world_size,
        by_prefix=_ranked(zip(names, per_prefix)),
    )


def _table_source_count(plan: Any, source: int, m: TableManifest, where: np.ndarray) -> RequestCount:
    """``_source_count`` for a table source of a mix: each (worker slice, row group) piece of its
    sequence reads the row group's projected runs once (``projected_runs`` GETs each; a table needs
    no sidecar), and each slice (a process) reads the footer of every file it reads from once, at
    most (``count_table_requests``, for a mix). Bytes: its rows' share of the row groups' bytes,
    times the share of the columns read (about)."""
    pieces = _source_count(plan, source, m, where)
    runs = projected_runs(m)
    starts, total = where[:-1], int(where[-1])
    footers = 0
    if total:
        quota = int(plan.quotas[source])
        seq = _Sequence(plan.passes[source], plan.counts[source])
        firsts = np.concatenate([[0], seq.cuts(quota)])  # where the ranges of a lap start
        laps = -(-total // quota)
        positions = (np.arange(laps, dtype=np.int64)[:, None] * quota + firsts[None, :]).ravel()
        positions = _distinct(np.concatenate([positions[positions < total], starts[(starts >= 0) & (starts < total)]]))
        slice_of = np.searchsorted(starts, positions, side="right") - 1  # the slice each range is read by
        files = m.group_file[seq.shard(positions % quota)]
        footers = len(_distinct(slice_of * len(m.files) + files))
    return _as_table(plan, m, pieces, runs, footers)


def _as_table(plan: Any, m: TableManifest, pieces: RequestCount, runs: int, footers: int) -> RequestCount:
    """A table's count from its row groups' count as ranges (``pieces``): a GET per projected run
    of each range, a footer per worker and file, the bytes of the projected columns' share."""
    share = len(m.projection) / max(1, len(m.columns)) if m.projection is not None else 1.0
    gets = pieces.ranges * runs + footers
    return RequestCount(
        ranges=pieces.ranges * runs,
        sidecars=footers,
        bytes=int(pieces.bytes * share),
        world_size=plan.world_size,
        by_prefix=tuple((name, round(g * gets / max(1, pieces.gets))) for name, g in pieces.by_prefix),
        side="footers",
    )


def is_remote(manifest: Any) -> bool:
    """Whether a dataset's shards are read with requests (any URL but a local path or file://)."""
    base = getattr(manifest, "base_url", "") or ""
    if not base and isinstance(manifest, TableManifest) and manifest.files:
        base = manifest.file_url(0)  # a table given as a list of files: their full URLs, no common folder
    return "://" in base and not base.startswith("file://")


def count_mix_requests(plan: Any, manifests: Sequence[Any]) -> RequestCount:
    """The requests of ``plan`` (a ``MixPlan``) over its sources' manifests, one count per source
    (``parts``; a local source makes none, its bytes still take reading time) and their sum."""
    begins = plan.slice_begins()
    where = _unrolled(plan, np.append(begins, plan.world_size * plan.samples_per_rank))
    parts = []
    for i, (name, manifest) in enumerate(zip(plan.names, manifests)):
        if is_remote(manifest):
            count = _table_source_count if isinstance(manifest, TableManifest) else _source_count
            part = count(plan, i, manifest, where[:, i])
        else:
            part = RequestCount(0, 0, _bytes_read(manifest, int(where[-1, i])), plan.world_size, (), local=True)
        parts.append((name, part))
    return RequestCount.combine(parts)


def with_requests(plan: Any, manifests: Any) -> Any:
    """``plan`` with its summary's request line (``EpochPlan.requests``, ``MixPlan.requests``) when
    a dataset it reads is on a remote store: ``manifests``, one per source (a single dataset's
    manifest alone will do). Plans of local data are returned as they are. A plan counts its own
    requests (``plan.count_requests(manifests)``: ``count_requests`` for one dataset's plan,
    ``count_mix_requests`` for a mix's), so nothing here tells plan types apart."""
    if not isinstance(manifests, (list, tuple)):
        manifests = [manifests]
    if not any(is_remote(m) for m in manifests):
        return plan
    return dataclasses.replace(plan, requests=plan.count_requests(manifests).describe())


def count_table_requests(plan: Any, m: TableManifest) -> RequestCount:
    """The GETs an epoch of a table makes (``plan``: an ``EpochPlan`` over ``m``'s row groups), for
    every rank and worker at once: each (worker slice, row group) piece of the plan reads the row
    group's projected runs once (``projected_runs`` GETs: ``count_requests``
    counts the pieces), and each process reads the footer of every file it reads from once, at
    most (``footers``: a process keeps up to FOOTERS_KEPT of them, persistent workers across epochs).
    Bytes: the row groups' bytes times the share of the columns read (about)."""
    pieces = _count_pieces(plan, m)
    runs = projected_runs(m)
    order = np.asarray(plan.shard_order, dtype=np.int64)
    starts = np.asarray(plan.starts, dtype=np.int64)
    n = plan.total_samples
    begins = plan.slice_begins()
    ends = np.append(begins[1:], plan.world_size * plan.samples_per_rank)
    files_of = m.group_file[order] if len(order) else np.zeros(0, np.int64)
    footers = 0
    for b, e in zip(begins.tolist(), ends.tolist()):
        if e <= b:
            continue
        if e - b >= n:
            footers += len(np.unique(files_of))
            continue
        lo, hi = b % n, b % n + (e - b)
        first = int(np.searchsorted(starts, lo, side="right") - 1)
        if hi <= n:
            entries = np.arange(first, int(np.searchsorted(starts, hi - 1, side="right")))
        else:  # wraps around the sequence's end
            entries = np.concatenate([np.arange(first, len(order)), np.arange(0, int(np.searchsorted(starts, hi - n - 1, side="right")))])
        footers += len(np.unique(files_of[entries]))
    return _as_table(plan, m, pieces, runs, footers)
