"""How many requests an epoch makes of the store, from its plan alone (pure, no I/O).

Every (rank, worker) reads its planned ranges, and a range is one GET (``storage/retry.py``); a
range that starts or ends inside a shard needs that shard's offset sidecar too, one GET per
process (each worker is one; sidecars are cached per process). So per epoch:

    GETs of shard bytes = the ranges of all (rank, worker) slices: every shard once per lap of the
                          laid-out sequence it falls in, plus one for each slice boundary inside it
    sidecar GETs        = (process, shard) pairs with a range that starts or ends inside the shard
                          (at most: persistent workers keep their sidecars from an epoch before)

S3 serves about 5,500 GET (and HEAD) requests per second per prefix (its documented rate; above it
answers 503 SlowDown) and bills every request. The GETs of an epoch spread over its reading time:
at ``rate`` bytes per second per rank, an epoch of B bytes lasts B / (rate x ranks) seconds, and
each prefix (the directory part of a shard's URL, where ``shardstream pack --prefixes N`` spreads
them) takes its share. ``RequestCount.describe`` says it in one line, with a warning when the
busiest prefix would go past S3's rate.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

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
        names = [manifest._resolve(d) if d else (manifest.base_url or ".") for d in index]
        found = _PREFIXES[manifest] = (names, ids)
    return found


@dataclass(frozen=True)
class RequestCount:
    """The requests of one epoch over all ranks (``count_requests``)."""

    ranges: int  # GETs of shard bytes: one per planned range
    sidecars: int  # GETs of offset sidecars, at most
    bytes: int  # bytes the epoch reads, about
    world_size: int
    by_prefix: tuple[tuple[str, int], ...]  # (prefix, GETs), the busiest first

    @property
    def gets(self) -> int:
        return self.ranges + self.sidecars

    def per_second(self, rate: float = DEFAULT_RATE) -> float:
        """GETs per second over the whole job when every rank reads ``rate`` bytes per second."""
        seconds = self.bytes / (rate * self.world_size) if self.bytes else 0.0
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
            f"requests: {self.gets:,} GETs per epoch ({self.ranges:,} ranges of {_human(self.bytes / max(1, self.ranges))} "
            f"on average, one GET each, + at most {self.sidecars:,} offset sidecars); at {_human(rate)}/s per rank x "
            f"{self.world_size} ranks: {self.per_second(rate):,.0f} GET/s, {busiest:,.0f} on the busiest of {prefixes} ({name})"
        )
        warning = self.warning(rate)
        return text + (f"; WARNING: {warning}" if warning else "")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def count_requests(plan: Any, manifest: Any) -> RequestCount:
    """The requests of ``plan`` (an ``EpochPlan``) over ``manifest``'s shards, for every rank and
    worker at once (see the module docstring), in a few vectorised steps: no range is listed."""
    order = np.asarray(plan.shard_order, dtype=np.int64)
    starts = np.asarray(plan.starts, dtype=np.int64)
    n, world, workers = plan.total_samples, plan.world_size, plan.num_workers
    covered = world * plan.samples_per_rank  # positions [0, covered) of the laid-out (maybe wrapped) sequence
    laps, rest = divmod(covered, n)
    pieces = np.full(len(order), laps, dtype=np.int64)  # GETs per entry of the order
    pieces[starts < rest] += 1
    # every worker slice's first position, in (rank, worker) order: the slices tile [0, covered)
    base, extra = divmod(plan.batches_per_rank, workers)
    w = np.arange(workers, dtype=np.int64)
    before = w * base + np.minimum(w, extra)
    begins = (np.arange(world, dtype=np.int64)[:, None] * plan.samples_per_rank + before[None, :] * plan.batch_size).ravel()
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
    sidecars_per_entry = np.bincount(sidecar_pairs % len(order), minlength=len(order)) if len(order) else pieces * 0
    names, ids = shard_prefixes(manifest)
    per_prefix = np.bincount(ids[order], weights=pieces + sidecars_per_entry, minlength=len(names))
    ranked = sorted(((names[i], int(g)) for i, g in enumerate(per_prefix) if g), key=lambda kv: (-kv[1], kv[0]))
    total_bytes = int(np.asarray(manifest.sizes, dtype=np.int64)[order].sum()) if len(order) else 0
    return RequestCount(
        ranges=int(pieces.sum()),
        sidecars=int(len(sidecar_pairs)),
        bytes=int(total_bytes * covered / n) if n else 0,
        world_size=world,
        by_prefix=tuple(ranked),
    )


def with_requests(plan: Any, manifest: Any) -> Any:
    """``plan`` with its summary's request line (``EpochPlan.requests``) when its dataset is on a
    remote store; local datasets and mixes are returned as they are."""
    base = getattr(manifest, "base_url", "") or ""
    if not hasattr(plan, "requests") or not hasattr(plan, "shard_order") or "://" not in base or base.startswith("file://"):
        return plan
    return dataclasses.replace(plan, requests=count_requests(plan, manifest).describe())
