"""pipeline/batch.py: exactly the planned number of equal batches, refilled after skips; the default collate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardstream.errors import TooManyErrors
from shardstream.pipeline.batch import BatchStats, batch_samples, default_collate


def samples(n: int, start: int = 0):
    return [{"__key__": f"k{i}", "cls": i, "x": torch.full((2,), i)} for i in range(start, start + n)]


def test_exact_batches_across_uneven_chunks_and_the_rest_is_drained():
    drained = []

    def chunks():
        for i in range(0, 23, 5):
            yield samples(min(5, 23 - i), i)
        drained.append(True)  # the upstream's end runs (its end-of-range checks are not skipped)

    out = list(batch_samples(chunks(), batch_size=4, num_batches=5))
    assert [b["cls"].tolist() for b in out] == [list(range(i, i + 4)) for i in range(0, 20, 4)]
    assert drained == [True]


def test_missing_samples_are_refilled_from_recent_ones_and_counted():
    stats = BatchStats()
    out = list(batch_samples([samples(10)], batch_size=4, num_batches=4, stats=stats))
    assert len(out) == 4 and all(len(b["__key__"]) == 4 for b in out)
    assert stats.refilled == 6
    assert set(k for b in out for k in b["__key__"]) == {f"k{i}" for i in range(10)}


def test_nothing_to_refill_from_is_an_error():
    with pytest.raises(TooManyErrors, match="no sample could be read"):
        list(batch_samples([], batch_size=2, num_batches=1))


def test_default_collate_stacks_what_it_can():
    batch = default_collate(
        [
            {"__key__": "a", "t": torch.zeros(2, 3), "i": 1, "f": 0.5, "b": True, "a": np.ones(2), "s": "x", "r": torch.zeros(1)},
            {"__key__": "b", "t": torch.ones(2, 3), "i": 2, "f": 1.5, "b": False, "a": np.zeros(2), "s": "y", "r": torch.zeros(2)},
        ]
    )
    assert batch["__key__"] == ["a", "b"] and batch["s"] == ["x", "y"]
    assert batch["t"].shape == (2, 2, 3)
    assert batch["i"].dtype == torch.int64 and batch["f"].dtype == torch.float64 and batch["b"].dtype == torch.bool
    assert batch["a"].shape == (2, 2)
    assert isinstance(batch["r"], list)  # ragged tensors stay a list
