"""Every integer seed gives a deterministic order that resumes exactly, and anything else is a
ConfigError at construction. Seeds that worked before keep their orders: a state saved today
loads and gives the same order after the change. A negative seed counts as its two's complement
in 64 bits (``seed % 2**64``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_samples, write_dataset

from shardstream import ConfigError, ShardStream, Shuffle, Source, World, plan_epoch
from shardstream.plan.epoch import shard_permutation

SEEDS = [0, 1, 12345, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64, 2**70, -1, -7, -(2**70)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("seeds") / "ds", n=60, max_count=6)


def _stream(source, seed) -> ShardStream:
    return ShardStream(source, batch_size=4, world=World(0, 1), seed=seed, shuffle=Shuffle(8))


def _keys(ds: ShardStream) -> list[str]:
    return [k for batch in ds for k in batch["__key__"]]


@pytest.mark.parametrize("seed", [0, 1, 2**16 + 3, 2**31, 2**32 - 1, 2**32, 2**40 + 5, 2**63, 2**64 - 1, 2**70])
def test_shard_orders_of_non_negative_seeds_are_unchanged(seed):
    # The formula every earlier release used for a non-negative seed: its orders, and the resume
    # states saved with them, stay valid.
    for epoch in (0, 3):
        before = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, epoch]).permutation(50)
        assert shard_permutation(50, seed, epoch).tolist() == before.tolist()


def test_a_negative_seed_is_its_64_bit_twos_complement():
    for seed in (-1, -7, -(2**40)):
        assert shard_permutation(50, seed, 2).tolist() == shard_permutation(50, seed % 2**64, 2).tolist()
    assert shard_permutation(50, -1, 0).tolist() != shard_permutation(50, 1, 0).tolist()


@pytest.mark.parametrize("seed", SEEDS)
def test_every_integer_seed_streams_deterministically_and_resumes_exactly(root, seed):
    keys = _keys(_stream(root, seed))
    assert sorted(keys) == sorted(s["__key__"] for s in make_samples(60))
    assert _keys(_stream(root, seed)) == keys  # the same order every run
    first = _stream(root, seed)
    it = iter(first)
    next(it), next(it)
    state = json.loads(json.dumps(first.state_dict(batches=2)))  # as a checkpoint stores it
    assert state["seed"] == seed
    resumed = _stream(root, seed)
    resumed.load_state_dict(state)
    assert _keys(resumed) == keys[8:]


def test_seeds_differ_and_a_numpy_integer_is_an_int(root):
    orders = {tuple(_keys(_stream(root, s))) for s in (0, -1, 2**64, 2**70)}
    assert len(orders) == 4
    ds = _stream(root, np.int64(5))
    assert type(ds.seed) is int and _keys(ds) == _keys(_stream(root, 5))
    assert json.loads(json.dumps(ds.state_dict(batches=0)))["seed"] == 5


def test_a_mix_takes_any_integer_seed(tmp_path):
    a = write_dataset(tmp_path / "a", n=30, max_count=5)
    b = write_dataset(tmp_path / "b", n=20, max_count=5, samples=make_samples(20, seed=1))
    for seed in (-1, 2**70):
        sources = [Source(a, weight=0.6, name="a"), Source(b, weight=0.4, name="b")]
        keys = _keys(_stream(sources, seed))
        assert keys and keys == _keys(_stream(sources, seed))


@pytest.mark.parametrize("seed", [1.5, "7", None, True, [1]])
def test_a_seed_that_is_not_an_integer_is_a_config_error(root, seed):
    with pytest.raises(ConfigError, match=r"seed must be an integer, got "):
        _stream(root, seed)
    with pytest.raises(ConfigError, match=r"seed must be an integer"):
        plan_epoch([10, 10], world_size=1, num_workers=1, batch_size=2, seed=seed)
