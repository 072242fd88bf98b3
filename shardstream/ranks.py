"""The slowest rank, named: each rank's data wait, gathered on a schedule of batches, and what the
rank that waited most was waiting on.

In DDP the slowest rank's data wait is every rank's step time: the others wait for it in the
gradient all-reduce, where their own data wait does not show. So each rank measures only its own
waits (``WaitMeter``: how long the training loop waited for each batch, and the time from one
batch to the next), and ``gather`` puts every rank's figures side by side.

The cost does not grow with steps or waits: a rank's figures since the last report are a fixed
row of numbers (sums, the largest wait, a histogram of waits in log-spaced bins, the deltas of its
stream counters), and a report is one ``all_gather`` of that row. Every rank gathers at the same
batch count (``WaitMeter.due``), never by wall time, so no rank waits in a collective the others
never join. The next report's batch count follows from the gathered rows alone (the slowest
rank's mean step time and the wanted interval in seconds), which every rank has, so ranks agree on
it without another message.

What a rank waited on is read from its workers' counters over the same batches
(``shardstream.stats``): time reading storage (``storage_wait_us``), decoding (``decode_us``),
in the user's transform (``transform_us``). Summed over a rank's workers and divided by their
number, that is how long each worker spent in each; the largest names the cause. Where those
explain less than a quarter of the wait, the rank waited on its workers themselves (starting,
handing batches over, collating, or one of them stalled): ``"worker"``.

A process group is used only where the stream's rank and world are the default group's
(``torch.distributed`` initialised with the same rank and size): a loader made on one rank alone
(``world=World(0, 1)`` for evaluation on rank 0) never calls a collective. Otherwise the report
has the one rank's figures.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

CAUSES = ("storage", "decode", "transform", "worker")
_STAGES = {"storage": "storage_wait_us", "decode": "decode_us", "transform": "transform_us"}
# The rank's stream counters a report carries (deltas since the last report).
REPORTED = ("storage_wait_us", "decode_us", "transform_us", "requests", "bytes_read", "retries", "throttles", "cache_hits", "cache_misses")
QUIET = 0.05  # a slowest rank waiting less than this share of its step time: no rank waits on data
EXPLAINED = 0.25  # the workers' stage times must explain this share of the wait to be its cause

# Wait histogram: 10 bins a decade from 10 µs to 1,000 s (each bin's upper edge 26% above its
# lower), one below and one above: a percentile is read to within a bin, clamped to the largest.
_LOW, _PER_DECADE, _DECADES = 1e-5, 10, 8
BINS = _PER_DECADE * _DECADES + 2
_HEAD = ("batches", "waited", "stepped", "longest", "workers")
# The rank's host name travels in its row (no collective of its own): 6 bytes a number, exact in a
# float64's 53-bit mantissa, 66 bytes in all (a Linux host name has at most 64).
_HOST_BYTES, _HOST_SLOTS = 6, 11
ROW = len(_HEAD) + len(REPORTED) + BINS + _HOST_SLOTS


def _host_numbers(name: str) -> list[float]:
    data = name.encode("utf-8", "replace")[: _HOST_BYTES * _HOST_SLOTS].ljust(_HOST_BYTES * _HOST_SLOTS, b"\0")
    return [float(int.from_bytes(data[i : i + _HOST_BYTES], "big")) for i in range(0, len(data), _HOST_BYTES)]


def _host_name(numbers: list[float]) -> str:
    data = b"".join(int(n).to_bytes(_HOST_BYTES, "big") for n in numbers)
    return data.rstrip(b"\0").decode("utf-8", "replace")


FIRST_REPORT = 20  # batches before the first report, where the interval is given in seconds
MAX_EVERY = 100_000


def _bin(seconds: float) -> int:
    if seconds < _LOW:
        return 0
    return min(BINS - 1, 1 + int(math.log10(seconds / _LOW) * _PER_DECADE))


def _quantile(hist: list[float], q: float, longest: float) -> float:
    """The ``q`` quantile of the waits in ``hist``: the geometric middle of its bin, at most the
    longest wait seen."""
    total = sum(hist)
    if total <= 0:
        return 0.0
    want, seen = q * total, 0.0
    for i, n in enumerate(hist):
        seen += n
        if seen >= want and n:
            if i == 0:
                return min(_LOW / 2, longest)
            low = _LOW * 10 ** ((i - 1) / _PER_DECADE)
            return min(low * 10 ** (0.5 / _PER_DECADE), longest)
    return longest


class WaitMeter:
    """One rank's data waits since its last report: ``record(wait_s, step_s)`` for each batch (the
    seconds the loop waited for it, and since the batch before it), ``due()`` at each batch.

    ``every``: a report every so many batches (0: never); None (the default) sets it after each
    report from ``interval_s`` (seconds between reports, 60 if not given) and the slowest rank's
    step time, starting with a report at batch ``FIRST_REPORT``. Every rank must be given the same.

    A loop feeds it with ``begin()`` as a pass starts, ``arrived()`` as each batch arrives and
    ``ask()`` as the loop asks for the next one, or with ``record`` directly."""

    def __init__(self, every: int | None = None, interval_s: float | None = None):
        if every is not None and (not isinstance(every, int) or every < 0):
            raise ValueError(f"every must be a whole number of batches >= 0 (0: no reports), got {every!r}")
        self.every = every
        self.interval_s = interval_s if interval_s else 60.0
        self.batches = 0  # batches recorded since the meter was made, on every pass
        self.next_due = every if every is not None else FIRST_REPORT
        self.host = socket.gethostname()
        self.held: Any = None  # the last collective's tensors: they outlive it (see _all_rows)
        self.last_counters: dict[str, int] | None = None
        self._asked: float | None = None
        self._last: float | None = None
        self._clear()

    def _clear(self) -> None:
        self.window = 0
        self.waited = 0.0
        self.stepped = 0.0
        self.longest = 0.0
        self.hist = [0.0] * BINS

    def record(self, wait_s: float, step_s: float) -> None:
        """One batch: the loop waited ``wait_s`` seconds for it, ``step_s`` since the batch before."""
        wait_s = max(0.0, wait_s)
        self.batches += 1
        self.window += 1
        self.waited += wait_s
        self.stepped += max(wait_s, step_s)
        self.longest = max(self.longest, wait_s)
        self.hist[_bin(wait_s)] += 1

    def begin(self) -> None:
        """A pass starts: its first batch's step is its wait (the time between passes is no step)."""
        self._last = None
        self.ask()

    def ask(self) -> None:
        """The loop asks for the next batch now."""
        self._asked = time.perf_counter()

    def arrived(self) -> None:
        """The batch the loop asked for arrived now."""
        now = time.perf_counter()
        asked = self._asked if self._asked is not None else now
        self.record(now - asked, now - (self._last if self._last is not None else asked))
        self._last = now

    def due(self, batches: int | None = None) -> bool:
        """Whether a report is due after ``batches`` batches (default: those recorded): the same
        answer on every rank at the same count."""
        count = self.batches if batches is None else batches
        return self.every != 0 and count >= self.next_due

    def row(self, counters: Mapping[str, int], workers: int) -> list[float]:
        """This rank's figures since the last report, as the fixed row ``gather`` sends."""
        last = self.last_counters or {}
        deltas = [float(counters.get(name, 0) - last.get(name, 0)) for name in REPORTED]
        return [float(self.window), self.waited, self.stepped, self.longest, float(workers), *deltas, *self.hist, *_host_numbers(self.host)]

    def reported(self, rows: list[list[float]], counters: Mapping[str, int]) -> None:
        """After a report: start the next window, and set when it is due (from ``rows``, the
        same on every rank)."""
        self.last_counters = dict(counters)
        self._clear()
        if self.every is not None:
            self.next_due = self.batches + self.every if self.every else self.next_due
            return
        step = max((r[2] / r[0] for r in rows if r[0] > 0), default=0.0)
        every = MAX_EVERY if step <= 0 else int(min(MAX_EVERY, max(1, round(self.interval_s / step))))
        self.next_due = self.batches + every


def _group(world: Any) -> bool:
    """Whether ranks gather through the default process group: it exists, with more than one rank,
    and it is the stream's ``world`` (a ``plan.topology.World``; None: taken as the group's)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    if world is None:
        return True
    return world.world_size == dist.get_world_size() and world.rank == dist.get_rank()


def _all_rows(meter: WaitMeter, row: list[float]) -> list[list[float]]:
    """Every rank's row, by one all_gather. Its tensors stay referenced by ``meter`` until the next
    report: gloo's thread drops its own references a moment after the call returns, and where that
    is the last reference as the interpreter exits, the rank aborts (docs/training.md, "Collectives
    just before exit")."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # nccl gathers device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    meter.held = (mine, rows)
    return [r.cpu().tolist() for r in rows]


def gather(meter: WaitMeter, counters: Mapping[str, int], world: Any = None, workers: int = 0, *, log: bool = False) -> dict[str, Any]:
    """Every rank's figures since the last report, side by side: a collective where the stream's
    ``world`` is the default process group's (every rank calls it at the same batch count:
    ``meter.due()``), else this rank's alone. ``counters``: the rank's stream counters now (its
    ``stats()``), ``workers``: its DataLoader workers. Returns the report (``report``'s dict) on
    every rank; with ``log``, rank 0 logs the slowest rank at INFO level."""
    mine = meter.row(counters, workers)
    rank = 0
    if _group(world):
        import torch.distributed as dist

        rows = _all_rows(meter, mine)
        rank = dist.get_rank()
    else:
        rows = [mine]
    meter.reported(rows, counters)
    out = report(rows, meter.batches)
    if log and rank == 0:
        logger.info("shardstream: %s", describe(out))
    return out


def _cause(stage_s: dict[str, float], waited: float, workers: int) -> str | None:
    if waited <= 0:
        return None
    per_worker = {name: s / max(workers, 1) for name, s in stage_s.items()}
    name = max(CAUSES[:3], key=lambda n: per_worker[n])  # (ties: storage first)
    if per_worker[name] <= 0 or sum(per_worker.values()) < EXPLAINED * waited:
        return "worker"
    return name


def report(rows: list[list[float]], batches: int = 0) -> dict[str, Any]:
    """The report from every rank's row (``WaitMeter.row``), rank by rank: a plain dict of numbers
    and strings, to log as it is.

    ``ranks``: per rank ``rank``, ``host``, ``batches`` (in this report), ``wait_p50_s``,
    ``wait_p99_s``, ``wait_max_s``, ``wait_s`` (their sum), ``step_s`` (mean step), ``wait_share``
    (of its step time, 0-1), ``cause`` (``"storage"``, ``"decode"``, ``"transform"``, ``"worker"``;
    None if it never waited), ``storage_s``/``decode_s``/``transform_s`` (its workers' time in each,
    summed), ``requests``, ``bytes_read``, ``retries``, ``throttles``, ``cache_hits``,
    ``cache_misses``. ``slowest``: the entry of the rank that waited longest. Beside them, for a
    logger that takes flat scalars: ``slowest_rank``, ``slowest_cause``, ``slowest_wait_share``,
    ``slowest_wait_p99_s``, ``wait_share_max``, ``wait_share_mean``; ``world``, ``batches`` (recorded
    by each rank so far)."""
    ranks: list[dict[str, Any]] = []
    head = len(_HEAD)
    for r, row in enumerate(rows):
        n, waited, stepped, longest, workers = row[:head]
        deltas = dict(zip(REPORTED, row[head : head + len(REPORTED)]))
        hist = row[head + len(REPORTED) : head + len(REPORTED) + BINS]
        stage_s = {name: deltas[key] / 1e6 for name, key in _STAGES.items()}
        ranks.append(
            {
                "rank": r,
                "host": _host_name(row[head + len(REPORTED) + BINS :]),
                "batches": int(n),
                "wait_p50_s": _quantile(hist, 0.5, longest),
                "wait_p99_s": _quantile(hist, 0.99, longest),
                "wait_max_s": longest,
                "wait_s": waited,
                "step_s": stepped / n if n else 0.0,
                "wait_share": waited / stepped if stepped > 0 else 0.0,
                "cause": _cause(stage_s, waited, int(workers)),
                **{f"{name}_s": s for name, s in stage_s.items()},
                **{key: int(deltas[key]) for key in REPORTED if not key.endswith("_us")},
            }
        )
    slowest = max(ranks, key=lambda e: (e["wait_s"], -e["rank"])) if ranks else None
    shares = [e["wait_share"] for e in ranks]
    return {
        "world": len(ranks),
        "batches": batches,
        "ranks": ranks,
        "slowest": slowest,
        "slowest_rank": slowest["rank"] if slowest else None,
        "slowest_cause": slowest["cause"] if slowest else None,
        "slowest_wait_share": slowest["wait_share"] if slowest else 0.0,
        "slowest_wait_p99_s": slowest["wait_p99_s"] if slowest else 0.0,
        "wait_share_max": max(shares, default=0.0),
        "wait_share_mean": sum(shares) / len(shares) if shares else 0.0,
    }


_SAID = {
    "storage": "storage (GETs)",
    "decode": "decoding",
    "transform": "the transform",
    "worker": "its workers (starting, handing over batches, or stalled)",
}


def describe(out: Mapping[str, Any]) -> str:
    """One line naming the slowest rank of a report and what it waited on."""
    s = out.get("slowest")
    if not s:
        return "no batches to report"
    where = f" on {s['host']}" if s["host"] else ""
    if s["wait_share"] < QUIET:
        return (
            f"no rank waits on data: the slowest, rank {s['rank']}{where} of {out['world']}, "
            f"{s['wait_share']:.0%} of its step time (p99 {s['wait_p99_s']:.3g} s)"
        )
    line = (
        f"slowest rank {s['rank']}{where} of {out['world']} waited {s['wait_share']:.0%} of its step time for data "
        f"(p50 {s['wait_p50_s']:.3g} s, p99 {s['wait_p99_s']:.3g} s over {s['batches']} batches)"
    )
    if s["cause"] is not None:
        line += f", mostly on {_SAID[s['cause']]}"
        if s["cause"] == "storage":
            line += f": {s['requests']} requests, {s['storage_s']:.3g} s in its workers"
    if out["world"] > 1:
        line += f"; the ranks' mean wait share {out['wait_share_mean']:.0%}"
    return line
