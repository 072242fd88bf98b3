"""Every (rank, worker) of a pass modelled in one process: the plan's reads become sample ids,
run through the pipeline's own shuffle continuation and merge (``pipeline.interleave.read_planned``),
cut into batches and delivered in DataLoader's round-robin order. A sample is (data epoch,
source, global id)."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np

from shardstream.pipeline.interleave import read_planned
from shardstream.plan.layout import SampleIds
from shardstream.plan.mix import Ask
from shardstream.plan.run import PassPlan, RunPlan, RunSettings, Sources

SEED = 11


def counts_for(num_shards: int, seed: int = 0, low: int = 1, high: int = 30) -> list[int]:
    rng = np.random.default_rng(seed + 100 * num_shards)
    return [int(x) for x in rng.integers(low, high, num_shards)]


def make_sources(counts: list[list[int]], asks: list[Ask] | None = None, mixed: bool | None = None) -> Sources:
    """Sources as a stream makes them: ``mixed`` (default: more than one source) gives them names
    (a mix, or a mix of one: samples tagged, a MixPlan report); else a dataset given as a root."""
    arrays = tuple(np.asarray(c, dtype=np.int64) for c in counts)
    if mixed is None:
        mixed = len(counts) > 1
    asks = asks or [Ask(repeat=1.0)] * len(counts)
    names = tuple(f"s{i}" for i in range(len(counts))) if mixed else ()
    return Sources.of(arrays, ["m"] if len(counts) == 1 else [str(i) for i in range(len(counts))], names, asks)


def make_run(
    sources: Sources,
    *,
    world: int,
    batch: int,
    buffer: int = 8,
    initial: int = 3,
    mode: str = "drop",
    per_batch: str = "spread",
    steps: int | None = None,
    samples_per_epoch: int | None = None,
    shuffle: bool = True,
) -> RunPlan:
    return RunPlan(
        sources,
        RunSettings(
            seed=SEED,
            shuffle=shuffle,
            mode=mode,
            per_batch=per_batch,
            world_size=world,
            batch_size=batch,
            shuffle_buffer=buffer,
            shuffle_initial=initial,
            steps=steps,
            samples_per_epoch=samples_per_epoch,
        ),
    )


def chunked(items: list, rng: random.Random | None) -> list[list]:
    """Items as lists of random sizes (read blocks): nothing may depend on the chunking."""
    if rng is None:
        return [items] if items else []
    out, i = [], 0
    while i < len(items):
        step = rng.randint(1, 7)
        out.append(items[i : i + step])
        i += step
    return out


def merge_round_robin(per_worker: list[list]) -> list:
    """The order DataLoader delivers worker batches in: one from each worker in turn, skipping exhausted ones."""
    out = []
    for k in range(max((len(b) for b in per_worker), default=0)):
        for batches in per_worker:
            if k < len(batches):
                out.append(batches[k])
    return out


def deliver(plan: PassPlan, rank: int, chunk_rng: random.Random | None = None, reads: list[int] | None = None) -> list[tuple]:
    """The batches rank ``rank`` receives in ``plan``'s pass, in order."""
    counts = plan.run.sources.counts
    ids = [SampleIds(c) for c in counts]
    batch = plan.topology.batch_size
    per_worker = []
    for d in range(plan.topology.num_workers):
        part = plan.worker(rank, d)
        items = []
        for window in part.windows:

            def read(i, ranges, epoch=window.epoch):
                got = [(epoch, i, int(x)) for x in ids[i].of_ranges(ranges)]
                if reads is not None:
                    reads.append(len(got))
                return chunked(got, chunk_rng)

            items += [x for chunk in read_planned(dataclasses.replace(part, windows=[window], names=None), read) for x in chunk]
        assert len(items) == part.num_batches * batch, (len(items), part.num_batches, batch)
        per_worker.append([tuple(items[j * batch : (j + 1) * batch]) for j in range(part.num_batches)])
    got = merge_round_robin(per_worker)
    assert len(got) == plan.batches_per_rank  # equal on every rank
    return got


def deliver_all(plan: PassPlan, chunk_rng: random.Random | None = None) -> list[list[tuple]]:
    return [deliver(plan, r, chunk_rng) for r in range(plan.topology.world_size)]


def flat(ranks: list[list[tuple]]) -> list[tuple]:
    return [x for r in ranks for b in r for x in b]


def through_json(state: dict) -> dict:
    return json.loads(json.dumps(state))
