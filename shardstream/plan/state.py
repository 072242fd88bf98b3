"""The resume state: a position in a run's sequence of data epochs, as one small versioned JSON dict.

Every kind of run writes the same format (``"format": "shardstream-resume"``, version 3): one
dataset or a mix, by epochs or by steps. It names what it was saved for (each source's manifest
digest and size, and for a mix its name and ask; the seed, shuffle, mode, interleave and the
run's length) and where the run stood: the loader epoch of the pass in progress, the data epoch
in progress, and that epoch's *segments*. A segment is a stretch of the data epoch laid out over
one topology (world size, workers, batch size, shuffle buffer): segment 0 is the epoch as
planned, each later one what the earlier ones left unconsumed, laid out again by an elastic
resume. For each segment the state says how the pass that consumed it ran (on the run's
timeline of steps: where the segment's first batch is, where that pass started and ends) and
how many of that pass's batches the loop received.

Version 3 names a lone source, given as a root or as a mix of one, by its manifest alone
(``Sources.of`` in plan/run.py): one planner orders it as a single dataset whichever way it was
given, so its states are interchangeable. Otherwise it is version 2's format, and states of
versions 1 and 2 keep loading (version 1: ``shardstream-resume`` for one dataset and
``shardstream-mix-resume`` for a mix, both runs by epochs), except one kind: before version 3 a
mix of one source was drawn as a mix, in another order, and named by its name and ask; such a
state cannot continue and is refused, saying what to do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from shardstream.errors import StateError
from shardstream.plan.mix import MODES, PER_BATCH
from shardstream.plan.topology import Topology

FORMAT = "shardstream-resume"
VERSION = 3
_V1_MIX = "shardstream-mix-resume"
_TOPOLOGY = ("world_size", "num_workers", "batch_size", "shuffle_buffer", "shuffle_initial")


def dataset_digest(shards: Iterable[tuple[str, int, int, str | None]]) -> str:
    """A short fingerprint of (path, samples, bytes, sha256) of every shard, in manifest order."""
    text = json.dumps([list(s) for s in shards], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Segment:
    """A stretch of a data epoch laid out over one topology, and how a pass consumed it."""

    topology: Topology
    start: int = 0  # timeline position of the segment's first batch
    pass_start: int = 0  # where the pass that consumed it started
    pass_end: int | None = None  # where that pass ends; None: with the data epoch (a run by epochs)
    batches: int = 0  # batches every rank received in that pass
    # What each source asked when this segment was laid out, where that was not what the state's
    # sources ask now (a mix whose weights changed at a checkpoint: a curriculum); None: theirs.
    asks: tuple[str, ...] | None = None

    @property
    def position(self) -> int:
        """The timeline position the loop had reached in this segment's pass."""
        return self.pass_start + self.batches

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            **self.topology.to_json(),
            "start": self.start,
            "pass_start": self.pass_start,
            "pass_end": self.pass_end,
            "batches": self.batches,
        }
        if self.asks is not None:
            doc["asks"] = list(self.asks)
        return doc


@dataclass(frozen=True)
class State:
    sources: tuple[dict[str, Any], ...]  # what it was saved for, per source (see ``source_identity``)
    seed: int
    shuffle: bool
    mode: str
    per_batch: str
    run: dict[str, int]  # {"steps": N}, {"samples_per_epoch": S}, {"tokens": T}, or {} for a run by epochs
    loader_epoch: int  # the pass in progress follows this loader epoch (set_epoch)
    epoch: int  # the data epoch in progress
    segments: tuple[Segment, ...]

    @property
    def last(self) -> Segment:
        return self.segments[-1]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "sources": [dict(s) for s in self.sources],
            "seed": self.seed,
            "shuffle": self.shuffle,
            "mode": self.mode,
            "per_batch": self.per_batch,
            "run": dict(self.run),
            "loader_epoch": self.loader_epoch,
            "epoch": self.epoch,
            "segments": [s.to_json() for s in self.segments],
        }

    def asks_changed(self, sources: Sequence[Mapping[str, Any]]) -> bool:
        """A mix's state whose sources ``sources`` are the same but ask other shares now (a curriculum)."""
        mine, theirs = [dict(s) for s in self.sources], [dict(s) for s in sources]
        if len(mine) < 2 or len(mine) != len(theirs) or mine == theirs:
            return False
        return all({k: v for k, v in a.items() if k != "ask"} == {k: v for k, v in b.items() if k != "ask"} for a, b in zip(mine, theirs))

    def asked_now(self, sources: Sequence[Mapping[str, Any]]) -> State:
        """This state for a stream of the same sources asking other shares (``asks_changed``): its
        segments keep the asks they were laid out with, the sources say what is asked now."""
        asked = tuple(str(s["ask"]) for s in self.sources)
        segments = tuple(seg if seg.asks is not None else replace(seg, asks=asked) for seg in self.segments)
        return replace(self, sources=tuple(dict(s) for s in sources), segments=segments)

    def with_last(self, segment: Segment) -> State:
        return replace(self, segments=self.segments[:-1] + (segment,))

    @classmethod
    def from_json(cls, doc: Any) -> State:
        """Read a state of any version this shardstream knows; StateError naming what is wrong."""
        if not isinstance(doc, Mapping) or doc.get("format") not in (FORMAT, _V1_MIX):
            raise StateError(
                f'not a shardstream resume state (no "format": "{FORMAT}"); pass what loader.state_dict() or ShardStream.state_dict() returned'
            )
        version = doc.get("version")
        known = (1,) if doc["format"] == _V1_MIX else (1, 2, VERSION)
        if version not in known:
            raise StateError(
                f"resume state version {version!r} is unknown to this shardstream (it reads versions "
                f"{', '.join(map(str, known))} of {doc['format']!r}); resume with the shardstream version that saved it"
            )
        try:
            state = _read(dict(doc), version if isinstance(version, int) else 0)
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"resume state is missing or mistypes a field ({exc}); it was not written by state_dict()") from exc
        lone = state.sources[0] if len(state.sources) == 1 else {}
        if "name" in lone and (version != VERSION or doc["format"] == _V1_MIX):
            raise StateError(
                f"resume state version {version} of a mix of one source ({lone['name']!r}): before version {VERSION} a lone "
                f"source was drawn as a mix, in another order than today's, so its epoch {state.epoch} cannot continue; "
                f"resume it with the shardstream that saved it, or start loader epoch {state.loader_epoch + 1} afresh "
                f"(set_epoch({state.loader_epoch + 1}) instead of load_state_dict)"
            )
        state.validate()
        return state

    def validate(self) -> None:
        if self.mode not in MODES or self.per_batch not in PER_BATCH or not self.segments or not self.sources:
            raise StateError(
                f"resume state holds impossible values: mode {self.mode!r}, per_batch {self.per_batch!r}, "
                f"{len(self.segments)} segments, {len(self.sources)} sources"
            )
        for i, s in enumerate(self.segments):
            t = s.topology
            if (
                t.world_size < 1
                or t.num_workers < 1
                or t.batch_size < 1
                or t.shuffle_buffer < 0
                or t.shuffle_initial < 1
                or s.batches < 0
                or (s.pass_end is not None and s.pass_end < s.pass_start)
            ):
                raise StateError(f"resume state holds impossible values in segment {i}: {s.to_json()}")
            if i and s.start != self.segments[i - 1].position:
                raise StateError(
                    f"resume state segment {i} starts at {s.start}, not where segment {i - 1} stopped "
                    f"({self.segments[i - 1].position}); it was not written by state_dict()"
                )
        if self.last.position < self.last.start:
            raise StateError(f"resume state stops before its segment starts ({self.last.to_json()})")

    def check(self, *, sources: Sequence[Mapping[str, Any]], seed: int, shuffle: bool, mode: str, per_batch: str, run: Mapping[str, int]) -> None:
        """Refuse a state saved for other data, another order or another run, naming what differs."""
        mine = [dict(s) for s in self.sources]
        theirs = [dict(s) for s in sources]
        then, now_shuffled = (any("documents" in s for s in side) for side in (mine, theirs))
        if then is not now_shuffled:  # the same sequences hold other tokens with the documents shuffled
            raise StateError(
                f"the resume state was saved with Shuffle(documents={then}) but this ShardStream has "
                f"Shuffle(documents={now_shuffled}): its sequences hold other tokens; construct it with "
                f"Shuffle(documents={then}) to resume"
            )
        if mine != theirs and not self.asks_changed(sources):  # (new asks of a mix: a curriculum, asked_now)
            same = len(mine) == len(theirs) == 1 and all(mine[0].get(k) == theirs[0].get(k) for k in ("manifest", "samples"))
            if same:  # the same dataset, asked for another share of it per epoch
                raise StateError(
                    f"the resume state was saved for this dataset asking {mine[0].get('ask', 'repeat 1')} per epoch, but this "
                    f"stream's source asks {theirs[0].get('ask', 'repeat 1')}; resume with the ask the checkpoint was trained on"
                )
            if len(mine) == len(theirs) == 1:
                raise StateError(
                    f"the resume state was saved for another dataset ({mine[0].get('samples')} samples, manifest "
                    f"digest {mine[0].get('manifest')}) than this one ({theirs[0].get('samples')} samples, digest "
                    f"{theirs[0].get('manifest')}); resume with the manifest the checkpoint was trained on"
                )
            raise StateError(
                f"the resume state was saved for another mix ({mine}) than this one ({theirs}); resume with "
                "the sources, manifests and asks it was trained on"
            )
        fields = [("seed", self.seed, seed), ("shuffle", self.shuffle, shuffle), ("mode", self.mode, mode)]
        if len(theirs) > 1:  # a lone source has nothing to interleave
            fields.append(("per_batch", self.per_batch, per_batch))
        for name, saved, now in fields:
            if saved != now:
                how = f"schedule=Schedule(per_batch={saved!r})" if name == "per_batch" else f"{name}={saved!r}"
                raise StateError(
                    f"the resume state was saved with {name}={saved!r} but this ShardStream has {name}={now!r}; "
                    f"construct it with {how} to resume this epoch"
                )
        if dict(self.run) != dict(run):
            raise StateError(
                f"the resume state was saved for a run {_describe_run(self.run)} but this ShardStream runs "
                f"{_describe_run(run)}; construct it with schedule=Schedule({_run_args(self.run)}) to resume"
            )


def _describe_run(run: Mapping[str, int]) -> str:
    if "tokens" in run:
        return f"by tokens (tokens={run['tokens']} per loader epoch)"
    if "steps" in run:
        return f"by steps (steps={run['steps']} per loader epoch)"
    if "samples_per_epoch" in run:
        return f"by samples (samples_per_epoch={run['samples_per_epoch']})"
    return "by whole epochs"


def _run_args(run: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in run.items())


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


def _topology(doc: Mapping[str, Any]) -> Topology:
    return Topology(*(_int(doc[k], k) for k in _TOPOLOGY))


def _read(doc: dict[str, Any], version: int) -> State:
    if doc["format"] == _V1_MIX:  # v1 mix: one segment of a run by epochs
        seg = Segment(_topology(doc), batches=_int(doc["batches"], "batches"))
        return State(
            tuple(dict(s) for s in doc["sources"]),
            _int(doc["seed"], "seed"),
            bool(doc["shuffle"]),
            "drop",
            str(doc["per_batch"]),
            {},
            _int(doc["epoch"], "epoch"),
            _int(doc["epoch"], "epoch"),
            (seg,),
        )
    if version == 1:  # v1 single dataset: segments laid end to end on the epoch's own timeline
        segments, at = [], 0
        for s in doc["segments"]:
            batches = _int(s["batches"], "batches")
            segments.append(Segment(_topology(s), start=at, pass_start=at, batches=batches))
            at += batches
        sources = ({"manifest": str(doc["manifest"]), "samples": _int(doc["samples"], "samples")},)
        return State(
            sources,
            _int(doc["seed"], "seed"),
            bool(doc["shuffle"]),
            str(doc["mode"]),
            "spread",
            {},
            _int(doc["epoch"], "epoch"),
            _int(doc["epoch"], "epoch"),
            tuple(segments),
        )
    run = {str(k): _int(v, k) for k, v in dict(doc["run"]).items()}
    if set(run) - {"steps", "samples_per_epoch", "tokens"} or len(run) > 1:
        raise ValueError(f"run must be {{}}, {{'steps': N}}, {{'samples_per_epoch': S}} or {{'tokens': T}}, got {run}")
    segments = []
    for s in doc["segments"]:
        end = s["pass_end"]
        segments.append(
            Segment(
                _topology(s),
                _int(s["start"], "start"),
                _int(s["pass_start"], "pass_start"),
                None if end is None else _int(end, "pass_end"),
                _int(s["batches"], "batches"),
                None if s.get("asks") is None else tuple(str(a) for a in s["asks"]),
            )
        )
    return State(
        tuple(dict(s) for s in doc["sources"]),
        _int(doc["seed"], "seed"),
        bool(doc["shuffle"]),
        str(doc["mode"]),
        str(doc["per_batch"]),
        run,
        _int(doc["loader_epoch"], "loader_epoch"),
        _int(doc["epoch"], "epoch"),
        tuple(segments),
    )


def furthest(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Of states saved in one pass (by the workers that shared it), the one furthest along it:
    the loop received the batches of every other before it. StateError for a state that is not one."""
    read = [State.from_json(s) for s in states]
    best = max(range(len(read)), key=lambda i: read[i].last.position)
    return dict(states[best])
