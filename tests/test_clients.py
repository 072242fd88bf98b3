"""Every resumable client, for real, with real DataLoader workers and every sample checked by key:
make_loader's loader, torch's plain DataLoader (``dataset.state_dict(batches=n)``), torchdata's
StatefulDataLoader (the dataset as a Stateful dataset, in the loop's process and in its workers)
and HF Accelerate (``prepare``, ``register_for_checkpointing`` + ``save_state``/``load_state``).
Each stops mid-epoch, saves through JSON (or Accelerate's checkpoint folder), builds everything
anew, loads, and must deliver the uninterrupted run's rest of the epoch, then the next epoch."""

from __future__ import annotations

import json
import os
import traceback
from collections import Counter

import pytest
import torch
from conftest import free_port, rank_results, run_ranks, write_dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from shardstream import Schedule, ShardStream, Shuffle, World, make_loader
from shardstream.errors import ConfigError, StateError

BATCH = 4
SAMPLES = 122  # 30 batches of 4, 2 samples dropped per epoch (drop mode)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("clients") / "ds", SAMPLES, max_count=13, size=20)


def stream(root, **kw):
    opts = dict(batch_size=BATCH, seed=5, shuffle=Shuffle(16), world=World(0, 1))
    opts.update(kw)
    return ShardStream(root, **opts)


def keys(loader, stop=None):
    """Keys per batch of one pass; with ``stop``, leave after that many batches."""
    got = []
    for batch in loader:
        got.append(list(batch["__key__"]))
        if len(got) == stop:
            break
    return got


def shut(loader):
    """Stop a DataLoader's workers now (one left mid-pass, or persistent); DataLoader has no public
    close, and its iterator's __del__ would leave them to the garbage collector."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def through_json(state):
    return json.loads(json.dumps(state))


def epochs(make, n=2):
    """The uninterrupted run: n passes of one loader (the dataset follows epochs 0, 1, ... by itself)."""
    loader = make()
    out = [keys(loader) for _ in range(n)]
    shut(loader)
    return out


def flat(batches):
    return [k for b in batches for k in b]


# -- torchdata's StatefulDataLoader ------------------------------------------------------------------
def sdl(root, workers, steps=None, **kw):
    return StatefulDataLoader(stream(root, schedule=Schedule(steps=steps)), batch_size=None, num_workers=workers, **kw)


@pytest.mark.parametrize("workers,every,persistent", [(0, 1, False), (2, 1, False), (2, 3, True), (3, 1, False)])
def test_stateful_dataloader_resumes_exactly(root, workers, every, persistent):
    opts = dict(snapshot_every_n_steps=every, persistent_workers=persistent)
    ref, ref_next = epochs(lambda: sdl(root, workers, **opts))
    assert len(ref) == 30 and len(set(flat(ref))) == 120
    for stop in (1, 7, 29) if workers != 3 else (5,):
        loader = sdl(root, workers, **opts)
        assert len(loader) == 30
        assert keys(loader, stop) == ref[:stop]
        state = through_json(loader.state_dict())
        shut(loader)
        resumed = sdl(root, workers, **opts)  # a new dataset and loader, as after a restart
        resumed.load_state_dict(state)
        assert len(resumed) == 30  # the whole pass, before and after load_state_dict
        assert keys(resumed) == ref[stop:], f"stopped after {stop}"
        assert keys(resumed) == ref_next  # the next epoch runs normally
        shut(resumed)


@pytest.mark.parametrize("workers,persistent,steps", [(0, False, None), (2, False, None), (2, True, None), (2, False, 17)])
def test_stateful_dataloader_twice_preempted_and_at_the_epoch_end(root, workers, persistent, steps):
    """Preempted during the resumed pass too; a state saved after the loop ran out (torchdata
    marks it finished and starts a new iterator) goes on with the next pass. By steps (17 a pass),
    passes cross data epochs: the next pass is the run's next 17 steps."""

    def loader():
        return sdl(root, workers, steps=steps, persistent_workers=persistent)

    ref, ref_next = epochs(loader)
    first = loader()
    keys(first, 6)
    second = loader()
    second.load_state_dict(through_json(first.state_dict()))
    shut(first)
    assert keys(second, 9) == ref[6:15]  # preempted again during the resumed pass
    third = loader()
    third.load_state_dict(through_json(second.state_dict()))
    shut(second)
    assert keys(third) == ref[15:]
    shut(third)
    ended = loader()
    keys(ended)
    again = loader()
    again.load_state_dict(through_json(ended.state_dict()))
    shut(ended)
    assert keys(again) == ref_next
    shut(again)


def test_stateful_dataloader_refuses_a_worker_state_on_another_topology(root):
    loader = sdl(root, 2)
    keys(loader, 5)
    state = through_json(loader.state_dict())
    shut(loader)
    other = StatefulDataLoader(stream(root, batch_size=3), batch_size=None, num_workers=2)
    other.load_state_dict(state)
    with pytest.raises(StateError, match=r"a worker's own state resumes only on its topology.*dataset.load_state_dict") as raised:
        keys(other)
    # Its traceback holds the iterator torchdata was starting (the error came from its __init__):
    # clearing those frames drops it at once, and its __del__ stops its workers. Left to the garbage
    # collector, the iterator's queues are finalized before it, and its shutdown then waits 5 s for
    # each worker before terminating it.
    traceback.clear_frames(raised.tb)
    del raised


@pytest.mark.parametrize("old,new", [(2, 3), (2, 0), (0, 2), (2, 2)])
def test_stateful_dataloader_state_resumes_on_other_workers(root, old, new):
    """StatefulDataLoader refuses its own state on another worker count; ShardStream.load_state_dict
    reads the position out of it (the furthest worker snapshot), so a new loader with any number of
    workers, or make_loader, finishes the epoch: exactly on the same count, elastically otherwise."""
    ref, _ = epochs(lambda: sdl(root, old))
    ref_next = epochs(lambda: sdl(root, new))[1]  # the next epoch, dealt out over the new workers
    loader = sdl(root, old, snapshot_every_n_steps=2)
    taken = keys(loader, 7)
    state = through_json(loader.state_dict())
    shut(loader)
    for client in ("stateful", "make_loader"):
        ds = stream(root)
        ds.load_state_dict(state)
        if client == "stateful":
            resumed = StatefulDataLoader(ds, batch_size=None, num_workers=new)
        else:
            resumed = make_loader(ds, num_workers=new, log_interval=None, pin_memory=False)
        rest = keys(resumed)
        if new == old:
            assert rest == ref[7:]
        else:
            seen = Counter(flat(taken) + flat(rest))
            assert max(seen.values()) == 1 and set(seen) <= set(flat(ref))  # drop mode: nothing twice
            assert len(flat(ref)) - len(seen) < BATCH  # every unseen sample but a leftover under one batch
        assert keys(resumed) == ref_next  # then the next epoch runs normally on the new topology
        resumed.close() if client == "make_loader" else shut(resumed)


# -- torch's own DataLoader ------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_plain_dataloader_resumes_exactly(root, workers):
    def plain(ds):
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)

    ref, ref_next = epochs(lambda: plain(stream(root)))
    for stop in (3, 20):
        ds = stream(root)
        assert keys(plain(ds), stop) == ref[:stop]
        state = through_json(ds.state_dict(batches=stop))  # what the loop received in this pass
        if workers == 0:
            assert ds.state_dict() == state  # iterated in the loop's process: the dataset counted itself
        again = stream(root)
        assert len(plain(again)) == 30
        again.load_state_dict(state)  # before the DataLoader starts its workers
        loader = plain(again)
        assert len(loader) == 30  # the whole pass, before and after load_state_dict
        assert keys(loader) == ref[stop:]
        assert keys(loader) == ref_next


# -- make_loader: len and remaining after a resume -------------------------------------------------
@pytest.mark.parametrize("workers,steps", [(2, None), (0, None), (2, 11)])
def test_loader_length_is_the_whole_pass_after_a_resume(root, workers, steps):
    # torch's DataLoader, StatefulDataLoader and Lightning: len() is the whole pass, and a client
    # that restores its own count of batches done (Lightning's fit loop) stops at len(loader).
    def loader():
        return make_loader(stream(root, schedule=Schedule(steps=steps)), num_workers=workers, log_interval=None, pin_memory=False)

    full = steps or 30
    ref, ref_next = epochs(loader)
    first = loader()
    assert len(first) == first.remaining == full
    keys(first, 7)
    assert len(first) == full and first.remaining == full - 7  # during a pass
    resumed = loader()
    resumed.load_state_dict(through_json(first.state_dict()))
    assert len(resumed) == full and resumed.remaining == full - 7
    got = []
    for batch in resumed:
        got.append(list(batch["__key__"]))
        assert len(resumed) == full and resumed.remaining == full - 7 - len(got)  # all through it
    assert got == ref[7:] and len(got) == full - 7
    assert len(resumed) == resumed.remaining == full
    assert keys(resumed) == ref_next and len(ref_next) == full


def test_resumed_len_is_gone(root):
    with pytest.raises(ConfigError, match="resumed_len"):
        make_loader(stream(root), num_workers=0, resumed_len="whole")


def test_loader_length_after_an_elastic_resume(root):
    first = make_loader(stream(root), num_workers=2, log_interval=None, pin_memory=False)
    taken = keys(first, 5)
    resumed = make_loader(stream(root, batch_size=3), num_workers=1, log_interval=None, pin_memory=False)
    resumed.load_state_dict(first.state_dict())
    expected = resumed.remaining
    assert len(resumed) == 5 + expected  # counted from the pass's start: the 5 received before, then the rest
    rest = keys(resumed)
    assert len(rest) == expected == (SAMPLES - 2 - 5 * BATCH) // 3  # the unseen 100, in batches of 3
    assert not set(flat(taken)) & set(flat(rest))
    assert len(resumed) == resumed.remaining == SAMPLES // 3


def test_plan_summary_knows_the_loader_workers(root):
    ds = stream(root)
    assert "1 workers per rank" in ds.plan().summary()
    loader = make_loader(ds, num_workers=2, log_interval=None, pin_memory=False)
    assert "2 workers per rank" in ds.plan().summary()  # make_loader told the dataset
    assert "3 workers per rank" in ds.plan(num_workers=3).summary()  # asked for another count
    keys(loader, 4)
    state = loader.state_dict()
    assert state["segments"][-1]["num_workers"] == 2
    again = stream(root)
    resumed = make_loader(again, num_workers=2, log_interval=None, pin_memory=False)
    resumed.load_state_dict(state)
    summary = again.plan().summary()
    assert "2 workers per rank" in summary and "exactly after 4 of 30" in summary  # not elastic onto 1 worker
    assert again.resume_plan().exact and again.resume_plan(num_workers=3).exact is False
    assert again.state_dict() == state  # before the pass: the state as loaded, for the loader's workers


# -- HF Accelerate -------------------------------------------------------------------------------
def _accelerate_objects(root, workers):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader(stream(root), num_workers=workers, log_interval=None, pin_memory=False)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(prepared)  # save_state/load_state carry its state_dict
    return accelerator, model, optimizer, prepared


def _train(accelerator, model, optimizer, loader, stop=None):
    got = []
    for batch in loader:
        x = torch.stack([batch["cls"].float(), torch.ones(len(batch["cls"]))], 1)
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        got.append(list(batch["__key__"]))
        if len(got) == stop:
            break
    return got


@pytest.mark.parametrize("workers", [0, 2])
def test_accelerate_prepare_every_sample_once_and_save_state_resumes(root, workers, tmp_path):
    accelerator, model, optimizer, loader = _accelerate_objects(root, workers)
    assert loader.state_dict  # prepare passes a make_loader loader through: it is no DataLoader
    ref = [_train(accelerator, model, optimizer, loader) for _ in range(2)]
    for epoch in ref:
        assert len(epoch) == 30 and len(set(flat(epoch))) == 120 and set(flat(epoch)) <= set(f"s{i:06d}" for i in range(SAMPLES))
    accelerator, model, optimizer, loader = _accelerate_objects(root, workers)
    assert _train(accelerator, model, optimizer, loader, stop=9) == ref[0][:9]
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator, model, optimizer, loader = _accelerate_objects(root, workers)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert len(loader) == 30 and loader.remaining == 21  # the whole pass, and what is left of it
    assert _train(accelerator, model, optimizer, loader) == ref[0][9:]
    assert _train(accelerator, model, optimizer, loader) == ref[1]


def _accelerate_rank(rank, world, port, root, out):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world and accelerator.process_index == rank
    ds = ShardStream(root, batch_size=BATCH, seed=5, shuffle=Shuffle(16))  # World detected from torch.distributed
    loader = accelerator.prepare(make_loader(ds, num_workers=1, log_interval=None, pin_memory=False))
    got = [keys(loader), keys(loader)]
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"world": [ds.world.rank, ds.world.world_size], "epochs": got, "len": len(loader)}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


@pytest.mark.slow
def test_accelerate_two_processes_split_every_epoch(root, tmp_path):
    out = str(tmp_path / "keys")
    run_ranks(_accelerate_rank, 2, (2, free_port(), root, out))
    results = rank_results(out, 2)
    assert [r["world"] for r in results] == [[0, 2], [1, 2]]
    for epoch in range(2):
        per_rank = [flat(r["epochs"][epoch]) for r in results]
        assert len(per_rank[0]) == len(per_rank[1]) == results[0]["len"] * BATCH == 15 * BATCH
        assert not set(per_rank[0]) & set(per_rank[1]) and len(set(per_rank[0]) | set(per_rank[1])) == 120


def test_to_device_remaining_counts_the_batch_copied_ahead(root):
    from shardstream import to_device

    loader = make_loader(stream(root), num_workers=0, log_interval=None, pin_memory=False)
    moved = to_device(loader, "cpu", copy_ahead=1)  # holds the next batch once it yields one
    it = iter(moved)
    for _ in range(5):
        next(it)
    assert len(moved) == 30 and moved.remaining == 25 and loader.remaining == 24
    state = moved.state_dict()
    resumed = make_loader(stream(root), num_workers=0, log_interval=None, pin_memory=False)
    resumed.load_state_dict(state)
    assert len(resumed) == 30 and resumed.remaining == 25
