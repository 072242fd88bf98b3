"""Pad mode marks its repeats: every batch carries ``__valid__`` (a bool tensor), False for the samples
the plan repeats to make equal batches, so the samples marked valid across all ranks are every sample
of the dataset exactly once (a validation metric that honours the mask counts each sample once).
In one process over ``World`` ranks, through make_loader's workers, after a resume, in a mix, and
over real gloo DDP ranks."""

from __future__ import annotations

import collections
import datetime
import json
import os

import pytest
import torch
from conftest import rank_results, run_ranks, write_dataset

import shardstream
from shardstream import World

N = 53  # not a multiple of world * batch: pad mode repeats some


def _valid_keys(batches) -> tuple[list[str], int, int]:
    """(keys marked valid, samples seen, batches) of an iterable of batches."""
    keys, seen, count = [], 0, 0
    for batch in batches:
        valid = batch["__valid__"]
        assert valid.dtype == torch.bool and valid.shape == (len(batch["__key__"]),)
        keys += [k for k, v in zip(batch["__key__"], valid.tolist()) if v]
        seen += len(valid)
        count += 1
    return keys, seen, count


def _expected() -> list[str]:
    return [f"s{i:06d}" for i in range(N)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_valid_samples_across_ranks_are_every_sample_once(tmp_path, shuffle):
    root = write_dataset(tmp_path / "ds", n=N, max_count=10)
    world = 3
    every: list[str] = []
    batch_counts = set()
    for rank in range(world):
        ds = shardstream.ShardStream(root, batch_size=4, mode="pad", shuffle=shuffle and shardstream.Shuffle(16), seed=3, world=World(rank, world))
        keys, seen, count = _valid_keys(ds)
        assert seen == count * 4
        batch_counts.add(count)
        every += keys
    assert len(batch_counts) == 1  # equal batches on every rank
    assert sorted(every) == _expected()  # each sample exactly once among the valid ones
    # and pad mode did repeat: 3 ranks * 5 batches * 4 = 60 positions for 53 samples
    assert batch_counts == {5}


def _key_and_label(sample: dict) -> dict:
    return {"__key__": sample["__key__"], "cls": sample["cls"]}


def test_valid_survives_make_loader_workers_and_a_transform(tmp_path):
    root = write_dataset(tmp_path / "ds", n=N, max_count=10)
    every: list[str] = []
    for rank in range(2):
        ds = shardstream.ShardStream(
            root,
            batch_size=5,
            mode="pad",
            shuffle=shardstream.Shuffle(8),
            world=World(rank, 2),
            transform=_key_and_label,  # a new dict without the mark
        )
        loader = shardstream.make_loader(ds, num_workers=2)
        keys, _, _ = _valid_keys(loader)
        every += keys
    assert sorted(every) == _expected()


def test_a_mix_in_pad_mode_marks_its_repeats(tmp_path):
    """Two evaluation sets as a mix (repeat=1 each) over 3 ranks: every sample of each once."""
    a = write_dataset(tmp_path / "a", n=29, max_count=10)
    b = write_dataset(tmp_path / "b", n=17, max_count=10)
    every: list[tuple[str, str]] = []
    for rank in range(3):
        ds = shardstream.ShardStream(
            [shardstream.Source(a, name="a"), shardstream.Source(b, name="b")],
            batch_size=4,
            mode="pad",
            shuffle=shardstream.Shuffle(8),
            world=World(rank, 3),
        )
        for batch in ds:
            every += [(s, k) for s, k, v in zip(batch["__source__"], batch["__key__"], batch["__valid__"].tolist()) if v]
    assert sorted(every) == sorted([("a", f"s{i:06d}") for i in range(29)] + [("b", f"s{i:06d}") for i in range(17)])


def test_drop_mode_has_no_mark(tmp_path):
    root = write_dataset(tmp_path / "ds", n=N, max_count=10)
    batch = next(iter(shardstream.ShardStream(root, batch_size=4, world=World(0, 2))))
    assert "__valid__" not in batch


def test_valid_after_a_resume_counts_the_rest_once(tmp_path):
    """Interrupted after 2 batches, resumed on another topology (elastic): what was delivered
    before plus the valid samples after are every sample once. (Here no repeat is delivered before
    its original: the rest owes samples none of whose copies came, see docs/lightning.md.)"""
    root = write_dataset(tmp_path / "ds", n=N, max_count=10)
    world = 2
    before: list[str] = []
    state = None
    for rank in range(world):
        ds = shardstream.ShardStream(root, batch_size=4, mode="pad", shuffle=shardstream.Shuffle(8), world=World(rank, world))
        it = iter(ds)
        for _ in range(2):
            keys, _, _ = _valid_keys([next(it)])
            before += keys
        if rank == 0:
            state = ds.state_dict(batches=2)
    after: list[str] = []
    for rank in range(3):  # another world size: an elastic resume
        ds = shardstream.ShardStream(root, batch_size=4, mode="pad", shuffle=shardstream.Shuffle(8), world=World(rank, 3))
        ds.load_state_dict(state)
        keys, _, _ = _valid_keys(ds)
        after += keys
    assert sorted(before + after) == _expected()


def test_refilled_samples_are_marked_invalid(tmp_path):
    """A transform that drops samples makes the batch stage refill with repeats: those are not valid."""
    root = write_dataset(tmp_path / "ds", n=N, max_count=10)
    dropped = {"s000003", "s000004"}
    every: list[str] = []
    for rank in range(2):
        ds = shardstream.ShardStream(
            root, batch_size=4, mode="pad", shuffle=False, world=World(rank, 2), transform=lambda s: None if s["__key__"] in dropped else s
        )
        keys, _, _ = _valid_keys(ds)
        every += keys
    assert sorted(every) == sorted(set(_expected()) - dropped)
    assert collections.Counter(every).most_common(1)[0][1] == 1


def _rank_main(rank: int, world: int, store: str, root: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    ds = shardstream.ShardStream(root, batch_size=4, mode="pad", shuffle=shardstream.Shuffle(8), seed=1)
    loader = shardstream.make_loader(ds, num_workers=2)
    keys, total, count = [], torch.zeros(2, dtype=torch.float64), 0
    for batch in loader:
        valid = batch["__valid__"]
        keys += [k for k, v in zip(batch["__key__"], valid.tolist()) if v]
        total += torch.stack([(batch["cls"].double() * valid).sum(), valid.sum().double()])
        count += 1
    summed = total.clone()
    dist.all_reduce(summed)  # equal batch counts: no rank waits for another that has more
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"keys": keys, "batches": count, "sum": summed.tolist()}, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_pad_mode_valid_mask(tmp_path):
    root = write_dataset(tmp_path / "ds", n=N, max_count=10)
    out = str(tmp_path / "result")
    run_ranks(_rank_main, 2, (2, str(tmp_path / "store"), root, out))
    ranks = rank_results(out, 2)
    assert len({r["batches"] for r in ranks}) == 1
    assert sorted(k for r in ranks for k in r["keys"]) == _expected()
    # the masked metric over both ranks equals the metric over the dataset, each sample once
    assert ranks[0]["sum"] == ranks[1]["sum"] == [float(sum(i % 7 for i in range(N))), float(N)]
