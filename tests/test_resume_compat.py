"""States saved by an earlier shardstream keep resuming exactly: a single dataset's resume states
captured with main's code before the planner was unified (tests/fixtures/resume_v2_single.json:
runs by epochs and by steps, drop and pad, 0 and 2 workers, each saved after 7 batches of loader
epoch 1), loaded now over the same dataset, yield the batches that code yielded after them (the
rest of the pass, then the next pass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_samples

from shardstream import Schedule, ShardStream, ShardWriter, Shuffle, World, make_loader
from shardstream.sources import manifest_digest

CAPTURED = json.loads((Path(__file__).parent / "fixtures" / "resume_v2_single.json").read_text())
CASES = sorted(k for k in CAPTURED if k != "captured_from")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("compat") / "ds")
    with ShardWriter(root, max_count=13) as w:  # the dataset the states were saved over, byte for byte
        for s in make_samples(120, size=20):
            w.write(s)
    return root


@pytest.mark.parametrize("case", CASES)
def test_captured_state_resumes_exactly(root, case):
    run, mode, workers = case.split("-")
    captured = CAPTURED[case]
    kw = dict(batch_size=4, seed=5, shuffle=Shuffle(16), world=World(0, 1), mode=mode)
    if run == "steps":
        kw["schedule"] = Schedule(steps=11)
    stream = ShardStream(root, **kw)
    assert manifest_digest(stream.sources.manifests[0]) == captured["state"]["sources"][0]["manifest"]  # the same bytes
    loader = make_loader(stream, num_workers=int(workers), log_interval=None)
    loader.load_state_dict(captured["state"])
    rest = [list(b["__key__"]) for b in loader]
    loader.set_epoch(2)
    after = [list(b["__key__"]) for b in loader]
    assert rest == captured["rest"] and after == captured["next"]
