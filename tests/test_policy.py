"""policy.py: raise or skip, counted, and a tolerance of consecutive failures."""

from __future__ import annotations

import pytest

from shardstream.errors import SampleError, ShardstreamError
from shardstream.policy import ErrorPolicy
from shardstream.stats import StreamStats


def failure(i: int = 0) -> SampleError:
    return SampleError("file:///d/shard-000000.tar", f"k{i}", "cannot decode field 'jpg'")


def test_raise_reraises_the_failure_itself():
    policy = ErrorPolicy("raise")
    exc = failure()
    with pytest.raises(SampleError) as info:
        policy.failed(exc)
    assert info.value is exc and policy.skipped == 0


def test_skip_counts_lost_samples_in_the_counters():
    stats = StreamStats()
    policy = ErrorPolicy("skip", tolerance=3, counters=stats.counters(0))
    policy.failed(failure(), lost=5)
    policy.ok()
    policy.failed(failure())
    assert policy.skipped == 6 and stats.totals()["samples_skipped"] == 6


def test_tolerance_counts_consecutive_failures_only():
    policy = ErrorPolicy("skip", tolerance=2)
    for i in range(10):  # failures separated by successes never trip the limit
        policy.failed(failure(i))
        policy.ok()
    policy.failed(failure(10))
    policy.failed(failure(11))
    with pytest.raises(ShardstreamError, match="3 consecutive samples failed"):
        policy.failed(failure(12))


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="on_error"):
        ErrorPolicy("ignore")
