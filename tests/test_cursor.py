"""The one owner of the position (shardstream/plan/cursor.py): every batch carries where it came
from (worker, pass, which of that worker's batches), the loop's cursor counts the pass's batches
received without a gap from those origins, whatever order they arrive in, and refuses a batch of
another plan or one received twice; the main process plans each pass once and its workers check
their plan against it (a mismatch is a StateError, never other data)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import write_dataset

from shardstream import ShardStream, Shuffle, World, make_loader
from shardstream.errors import StateError
from shardstream.plan.cursor import Cursor, Origin, Place, plan_id

BATCH = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("cursor") / "ds", 96, max_count=10, size=20)  # 24 batches per pass


def stream(root, **kw):
    return ShardStream(root, batch_size=BATCH, seed=3, shuffle=Shuffle(8), world=World(0, 1), **kw)


def test_the_loop_counts_the_batches_received_without_a_gap_in_any_arrival_order(root):
    plan = stream(root).pass_plan(3)
    k, n = 3, plan.batches_per_rank
    origins = [Origin(w, plan.loader_epoch, plan_id(plan), i) for w in range(k) for i in range(len(range(w, n, k)))]
    random.Random(7).shuffle(origins)
    cursor = Cursor(plan)
    seen: set[int] = set()
    for origin in origins:
        cursor.see(origin)
        seen.add(origin.worker + origin.nth * k)
        prefix = next(i for i in range(n + 1) if i not in seen)
        assert cursor.received == prefix
        assert cursor.state() == plan.state_after(prefix)
    assert cursor.received == n and cursor.taken == n


def test_the_loop_refuses_a_batch_of_another_plan_or_one_received_twice(root):
    ds = stream(root)
    plan = ds.pass_plan(2)
    cursor = Cursor(plan)
    cursor.see(Origin(0, 0, cursor.id, 0))
    with pytest.raises(StateError, match="received twice"):
        cursor.see(Origin(0, 0, cursor.id, 0))
    with pytest.raises(StateError, match="past the pass"):
        cursor.see(Origin(1, 0, cursor.id, plan.batches_per_rank))
    ds.set_epoch(1)
    other = ds.pass_plan(2)
    assert plan_id(other) != cursor.id and plan_id(other) == plan_id(ds.pass_plan(2))  # one identity per plan
    with pytest.raises(StateError, match="planned"):
        cursor.see(Origin(1, 1, plan_id(other), 0))
    assert cursor.received == 1  # nothing refused was counted


def test_a_producer_gives_each_batch_its_origin_and_its_position(root):
    plan = stream(root).pass_plan(2)
    cursor = Cursor(plan, slot=1, stride=2, worker=1)
    assert [cursor.take() for _ in range(3)] == [Origin(1, plan.loader_epoch, plan_id(plan), i) for i in range(3)]
    assert cursor.received == 1 + 2 * 2 + 1  # worker 1's third batch is batch 5 of the pass


def test_make_loader_counts_from_origins_and_users_see_only_their_batches(root):
    ds = stream(root)
    loader = make_loader(ds, num_workers=2, log_interval=None, start_method="fork", persistent_workers=False)
    plain = list(torch.utils.data.DataLoader(stream(root), batch_size=None, num_workers=2))
    got = []
    for batch in loader:
        assert set(batch) == set(plain[0])  # what the dataset makes, nothing more
        got.append(batch["__key__"])
        if len(got) == 9:
            state = loader.state_dict()
    assert got == [b["__key__"] for b in plain] and loader.received == len(got) == 24
    ds2 = stream(root)
    ds2.load_state_dict(state)
    assert [b["__key__"] for b in make_loader(ds2, num_workers=2, log_interval=None, start_method="fork")] == got[9:]


def test_a_worker_told_another_plan_reads_nothing(root, monkeypatch):
    ds = stream(root)

    def wrong(self, num_workers):  # the main process announces a plan the workers do not make
        cursor = Cursor(self.pass_plan(num_workers))
        cursor._id = 12345
        self._clock.announce(max(1, num_workers), cursor.id)
        return cursor

    monkeypatch.setattr(ShardStream, "open_pass", wrong)
    loader = make_loader(ds, num_workers=2, log_interval=None, start_method="fork", persistent_workers=False)
    with pytest.raises(StateError, match="planned that pass as 0000000000003039"):
        next(iter(loader))
    with pytest.raises(StateError, match="planned that pass as"):
        next(iter(make_loader(ds, num_workers=0, log_interval=None)))


def test_a_copy_keeps_the_loaded_state_kind_but_not_this_process_pass(root):
    import pickle

    place = Place()
    place.cursor, place.iterated, place.own_state, place.loader_workers = Cursor(stream(root).pass_plan(1)), True, True, 2
    copy = pickle.loads(pickle.dumps(place))
    assert (copy.cursor, copy.iterated, copy.own_state, copy.loader_workers) == (None, False, True, 2)


def test_after_a_loader_pass_a_plain_dataloader_over_the_same_dataset_takes_the_next_epoch(root):
    ds = stream(root)
    first = [b["__key__"] for b in make_loader(ds, num_workers=2, log_interval=None, start_method="fork", persistent_workers=False)]
    then = [b["__key__"] for b in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)]  # the announced pass was closed
    fresh = stream(root)
    fresh.set_epoch(1)
    assert then == [b["__key__"] for b in torch.utils.data.DataLoader(fresh, batch_size=None, num_workers=2)] and then != first
    assert ds.epoch == 1
