"""The tests' waits scale with the machine's load (conftest.scaled): a loaded machine is slower,
not broken. Checked here against the load average the way every wait reads it."""

from __future__ import annotations

import os

from conftest import MAX_LOAD_FACTOR, load_factor, scaled


def test_waits_stretch_by_the_load_per_core_within_bounds():
    factor = load_factor()
    assert 1.0 <= factor <= MAX_LOAD_FACTOR
    per_core = os.getloadavg()[0] / len(os.sched_getaffinity(0))
    assert factor >= min(MAX_LOAD_FACTOR, per_core) * 0.5  # the load moves between two reads; not by half
    assert scaled(120) >= 120 and scaled(0) == 0


def test_this_tests_own_bound_is_scaled_too(request):
    marker = request.node.get_closest_marker("timeout")
    base = float(request.config.getini("timeout"))
    if marker is None:  # an idle machine: the ini's bound as it is
        assert load_factor() <= 1.5
    else:
        assert base <= marker.args[0] <= base * MAX_LOAD_FACTOR
