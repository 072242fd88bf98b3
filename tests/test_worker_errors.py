"""What a training loop sees when DataLoader workers go wrong under make_loader: a worker killed
by a signal or exiting on its own is a WorkerDied naming it; options that would break exact
resume are refused."""

from __future__ import annotations

import pytest
from conftest import write_dataset

from shardstream import ConfigError, ShardStream, World, make_loader


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("workers") / "ds", n=80, max_count=10)


def test_in_order_false_is_refused_and_true_accepted(root):
    ds = ShardStream(root, batch_size=4, world=World(0, 1), shuffle=False)
    with pytest.raises(ConfigError, match="in_order=True: resume counts the batches"):
        make_loader(ds, num_workers=2, in_order=False)
    loader = make_loader(ds, num_workers=0, in_order=True, log_interval=None)
    assert sum(len(b["__key__"]) for b in loader) == 80
