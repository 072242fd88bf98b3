"""segments.py: a worker writes a shared segment again only after the main process let go of every
tensor on it; held batches keep their values; real DataLoader workers reuse their segments."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
import torch

from shardstream import ShardStream, ShardWriter, World, make_loader
from shardstream.loader import SEGMENTS, pack_batch, unpack_batch
from shardstream.loader.segments import MAX_SEGMENTS, Channels, Handoff, WorkerPool, worker_pool

MB = 1 << 20


def _pool() -> tuple[Channels, WorkerPool]:
    channels = Channels(1)
    return channels, WorkerPool(channels.pipes[0][0], 0)


def _batch_on(pool: WorkerPool, value: float, n: int = MB // 4) -> dict:
    storage = pool.take(4 * n)
    t = torch.empty(0, dtype=torch.float32).set_(storage)[:n]
    t.fill_(value)
    return {"x": t, "k": ["a"]}


def _received(packed: dict) -> dict:
    """What the main process gets: storages sent with the batch arrive as mappings of their own
    (as torch's file-descriptor passing gives), not the worker's storage objects."""
    if SEGMENTS in packed:
        handoff = packed[SEGMENTS]
        segments = []
        for number, storage in handoff.segments:
            if storage is not None:
                fd, size = storage._share_fd_cpu_()
                dup = os.dup(fd)
                try:
                    storage = torch.UntypedStorage._new_shared_fd_cpu(dup, size)
                finally:
                    os.close(dup)
            segments.append((number, storage))
        handoff.segments = segments  # (the batch's markers point at this record)
    return packed


def _unpack(packed: dict, channels: Channels) -> dict:
    return unpack_batch(_received(packed), channels=channels)


def _send(pool: WorkerPool, channels: Channels, value: float, n: int = MB // 4) -> tuple[Handoff, torch.Tensor]:
    """One batch from the worker's side to the main process's: (its hand-off record, its tensor)."""
    packed = pack_batch(_batch_on(pool, value, n), pool=pool)
    handoff = packed[SEGMENTS]
    return handoff, _unpack(packed, channels)["x"]


def test_a_segment_is_written_again_only_after_the_main_process_let_go():
    channels, pool = _pool()
    first, got = _send(pool, channels, 1.0)
    assert [storage is not None for _, storage in first.segments] == [True]  # first sending: the storage goes
    assert got.shape == (MB // 4,) and bool((got == 1.0).all())
    # Held by the user: the worker gets another segment, and the first keeps its values.
    second, got2 = _send(pool, channels, 2.0)
    assert second.segments[0][0] != first.segments[0][0] and len(pool.segments) == 2
    assert bool((got == 1.0).all()) and bool((got2 == 2.0).all())
    view = got[10:20]  # a view keeps the segment as held as the tensor does
    del got
    third = pack_batch(_batch_on(pool, 3.0), pool=pool)[SEGMENTS]  # never received: stays in flight
    assert len(pool.segments) == 3 and bool((view == 1.0).all())
    del view
    again, got4 = _send(pool, channels, 4.0)  # the first segment, now free
    number, storage = again.segments[0]
    assert number == first.segments[0][0] and storage is None  # mapped in the main process: sent by number
    assert pool.reused == 1 and pool.made == 3
    assert bool((got4 == 4.0).all()) and bool((got2 == 2.0).all()) and third.segments[0][1] is not None


def test_the_next_workers_inherit_only_segments_no_batch_view_holds():
    channels, pool = _pool()
    _, held = _send(pool, channels, 1.0)
    first, dropped = _send(pool, channels, 2.0)
    del dropped
    channels.forget({pool.token}, retire=True)  # the pass ran out: its worker has exited
    assert len(channels.retired) == 2 and pool.token not in channels.mapped
    channels.prepare_workers()  # the next worker is forked now
    token, inherited = channels.inherit[0]
    assert len(inherited) == 1 and len(channels.retired) == 1  # the held one stays retired
    number, storage, capacity = inherited[0]
    # registered under the new worker's token: its first batch can name the segment by number
    assert channels.mapped[token][number].ctypes.data == storage.data_ptr() and capacity == storage.nbytes()
    assert bool(np.all(channels.mapped[token][number][: 4 * 100].view(np.float32) == 2.0))  # the batch let go
    heir = WorkerPool(channels.pipes[0][0], 0, token=token, inherited=inherited)
    assert heir.token == token and heir.inherited == 1 and heir.segments[0].known
    packed = pack_batch({"x": torch.empty(0, dtype=torch.float32).set_(heir.segments[0].storage)[: MB // 4]}, pool=heir)
    assert packed[SEGMENTS].segments == [(number, None)]  # (the forked worker reuses it: see the loader test)
    got = _unpack(packed, channels)["x"]
    assert bool((got == 2.0).all()) and bool((held == 1.0).all())
    del held, first
    channels.forget({token}, retire=True)
    channels.prepare_workers()
    assert len(channels.inherit[0][1]) == 1  # held until now: inherited this time
    assert set(channels.retired) == {(token, number)}  # ``got`` holds it now
    third = channels.workers_tokens()
    channels.forget(third)  # a pass cut short: unmapped, not retired
    assert set(channels.retired) == {(token, number)} and not any(t in channels.mapped for t in third)
    assert bool((got == 2.0).all())  # a tensor still held keeps its own view


def test_a_segment_the_worker_still_uses_is_not_handed_out_again():
    channels, pool = _pool()
    batch = _batch_on(pool, 1.0)
    kept = batch["x"][:10]  # e.g. a transform in the worker that keeps the last batch
    got = _unpack(pack_batch(batch, pool=pool), channels)["x"]
    del got, batch  # released by the main process
    _send(pool, channels, 2.0)
    assert pool.reused == 0 and bool((kept == 1.0).all())
    del kept
    _send(pool, channels, 3.0)
    assert pool.reused == 1


def test_a_pinned_or_copied_batch_releases_its_segment_at_once():
    channels, pool = _pool()
    copy = _unpack(pack_batch(_batch_on(pool, 5.0), pool=pool), channels)["x"].clone()  # the received tensor dies here
    pack_batch(_batch_on(pool, 6.0), pool=pool)
    assert pool.reused == 1 and bool((copy == 5.0).all())


def test_the_pin_memory_thread_pins_pooled_tensors_and_their_segments_come_back(monkeypatch):
    """DataLoader's pin thread runs torch's ``pin_memory`` over each batch as it arrives; a pooled
    tensor is pinned there (off the training loop), not later by unpack_batch. This machine has no
    accelerator, so the pinning itself is a copy that records its calls."""
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned_by: list[str] = []

    def fake_pin(self, device=None):
        pinned_by.append(threading.current_thread().name)
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    channels, pool = _pool()
    packed = _received(pack_batch(_batch_on(pool, 7.0), pool=pool))
    packed[SEGMENTS].channels = channels  # what arrival in the main process sets
    out: list = []
    thread = threading.Thread(target=lambda b: out.append(pin_memory(b)), args=(packed,), name="pin-thread")
    thread.start()
    thread.join()
    del packed
    assert pinned_by == ["pin-thread"]
    got = unpack_batch(out.pop(), pin=True)["x"]
    assert pinned_by == ["pin-thread"] and bool((got == 7.0).all())  # not pinned a second time
    _send(pool, channels, 8.0)
    assert pool.reused == 1 and bool((got == 7.0).all())  # the pinned copy is the user's own


def test_releases_of_other_workers_and_earlier_workers_are_ignored():
    channels, pool = _pool()
    packed = pack_batch(_batch_on(pool, 1.0), pool=pool)
    handoff = packed[SEGMENTS]
    # a stale message: the same segment number from a worker with another token
    channels._release(0, (handoff.token + 1) % (1 << 64), handoff.segments[0][0])
    pack_batch(_batch_on(pool, 2.0), pool=pool)
    assert pool.reused == 0 and pool.made == 2
    channels._release(0, handoff.token, handoff.segments[0][0])  # the right token: released
    pack_batch(_batch_on(pool, 3.0), pool=pool)
    assert pool.reused == 1 and pool.made == 2


def test_a_segment_that_left_inside_an_object_the_pack_step_does_not_walk_is_never_reused():
    channels, pool = _pool()

    class Opaque:  # torch pickles the tensor inside by file descriptor, as it always did
        def __init__(self, t):
            self.t = t

    batch = _batch_on(pool, 1.0)
    packed = pack_batch({"o": Opaque(batch.pop("x")), "k": ["a"]}, pool=pool)
    assert SEGMENTS not in packed and pool.segments == []
    assert bool((packed["o"].t == 1.0).all())
    pack_batch(_batch_on(pool, 2.0), pool=pool)
    assert pool.reused == 0 and bool((packed["o"].t == 1.0).all())


def test_a_full_release_pipe_costs_fresh_segments_never_a_reuse():
    channels, pool = _pool()
    packed = pack_batch(_batch_on(pool, 1.0), pool=pool)  # (taking a segment drains the pipe)
    w = channels.pipes[0][1]
    filled = 0
    for size in (4096, 8):  # up to the last byte
        while True:
            try:
                filled += os.write(w, b"\0" * size)
            except BlockingIOError:
                break
    got = _unpack(packed, channels)["x"]
    del packed, got
    assert channels.dropped_releases == 1
    os.read(channels.pipes[0][0], filled)  # the worker drains only junk now: nothing is released
    pack_batch(_batch_on(pool, 2.0), pool=pool)
    assert pool.reused == 0 and pool.made == 2


def test_sizes_share_segments_within_a_size_class_and_the_pool_is_bounded():
    channels, pool = _pool()
    storage = pool.take(3 * MB + 1)  # rounded up to a size class
    assert storage.nbytes() >= 3 * MB + 1
    pool.sent(set())  # handed out, never packed: let go
    assert pool.segments == []
    held = []
    for i in range(MAX_SEGMENTS + 2):
        held.append(_unpack(pack_batch(_batch_on(pool, float(i)), pool=pool), channels)["x"])
    assert len(pool.segments) == MAX_SEGMENTS  # the rest were fresh and not kept
    assert all(bool((t == float(i)).all()) for i, t in enumerate(held))
    del held
    gc.collect()
    pack_batch(_batch_on(pool, 9.0, n=MB // 4 - 1000), pool=pool)  # a little smaller: fits a kept one
    assert pool.reused == 1


def test_a_segment_made_ahead_serves_the_first_batch_that_fits_it():
    channels = Channels(1)
    pool = WorkerPool(channels.pipes[0][0], 0, ahead=MB)  # made in a thread from now on
    assert pool.ahead_capacity >= MB
    first, got = _send(pool, channels, 1.0)  # a batch of 1 MiB: the segment made ahead
    assert pool.made_ahead == 1 and pool.made == 0 and pool.reused == 0
    assert [storage is not None for _, storage in first.segments] == [True]  # sent as any new one is
    assert bool((got == 1.0).all())
    del got
    again, got = _send(pool, channels, 2.0)  # released: it is reused like any other
    assert again.segments == [(first.segments[0][0], None)] and pool.reused == 1 and bool((got == 2.0).all())


def test_a_segment_made_ahead_that_does_not_fit_stays_free_in_the_pool():
    channels = Channels(1)
    pool = WorkerPool(channels.pipes[0][0], 0, ahead=MB)
    _, big = _send(pool, channels, 1.0, n=MB)  # 4 MiB: more than twice its size
    assert pool.made_ahead == 1 and pool.made == 1 and len(pool.segments) == 2
    ahead = next(seg.number for seg in pool.segments if seg.capacity < 4 * MB)
    handoff, small = _send(pool, channels, 2.0)  # 1 MiB: the one made ahead, untouched until now
    assert handoff.segments[0][0] == ahead and pool.made == 1 and len(pool.segments) == 2
    assert bool((big == 1.0).all()) and bool((small == 2.0).all())


def test_no_segment_is_made_ahead_for_a_worker_that_inherited_some():
    channels, pool = _pool()
    _send(pool, channels, 1.0)
    channels.forget({pool.token}, retire=True)
    channels.prepare_workers()
    token, inherited = channels.inherit[0]
    heir = WorkerPool(channels.pipes[0][0], 0, token=token, inherited=inherited, ahead=MB)
    assert heir.ahead_capacity == 0 and heir.inherited == 1
    heir.take(MB)
    assert heir.made_ahead == 0 and len(heir.segments) == 2  # (in one process the inherited one is still in use)


def test_the_handoff_record_pickles():
    import pickle

    h = pickle.loads(pickle.dumps(Handoff(7, 1, [(3, None)], [2])))
    assert (h.token, h.worker, h.segments, h.dropped) == (7, 1, [(3, None)], [2])


# --- real DataLoader workers ---------------------------------------------------------------


def _npy_dataset(root, n=96, shape=(64, 128)):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
    with ShardWriter(str(root), max_count=16) as w:
        for i, a in enumerate(arrays):
            w.write({"__key__": f"{i:04d}", "npy": a})
    return str(root), arrays


class ReportReuse:
    """A loader collate_fn (it runs in the worker): the pool's reuse count goes with the batch, and
    a strided view and a second tensor on the same segment test the markers' layout."""

    def __call__(self, batch):
        pool = worker_pool()
        batch["reused"] = -1 if pool is None else pool.reused
        batch["corner"] = batch["npy"][:, 1:60, ::2]  # over 64 KiB: not sent inline
        return batch


@pytest.mark.parametrize("persistent", [True, False])
def test_workers_reuse_segments_and_batches_held_across_passes_keep_their_values(tmp_path, persistent):
    root, arrays = _npy_dataset(tmp_path / "d")
    ds = ShardStream(root, batch_size=8, shuffle=False, world=World(0, 1))  # 256 KiB batches: shared memory
    loader = make_loader(ds, num_workers=2, persistent_workers=persistent, collate_fn=ReportReuse(), log_interval=None)
    kept = []
    reused = 0
    for _ in range(3):
        for i, batch in enumerate(loader):
            want = torch.stack([torch.from_numpy(arrays[int(k)]) for k in batch["__key__"]])
            assert torch.equal(batch["npy"], want) and torch.equal(batch["corner"], want[:, 1:60, ::2])
            reused = max(reused, batch["reused"])
            if i % 3 == 0:
                batch["npy"].add_(1.0)  # the user writes into a held batch too
                kept.append((batch, want + 1.0))
    assert reused > 0  # segments came back to the workers
    for batch, want in kept:
        assert torch.equal(batch["npy"], want) and torch.equal(batch["corner"], want[:, 1:60, ::2])


class ReportInherited:
    def __call__(self, batch):
        pool = worker_pool()
        batch["made"], batch["inherited"] = pool.made, pool.inherited
        return batch


def test_new_workers_each_pass_inherit_the_segments_of_the_pass_before(tmp_path):
    root, arrays = _npy_dataset(tmp_path / "d")
    ds = ShardStream(root, batch_size=8, shuffle=False, world=World(0, 1))
    loader = make_loader(ds, num_workers=2, persistent_workers=False, collate_fn=ReportInherited(), log_interval=None)
    passes = []
    kept = []
    for p in range(4):
        made, inherited = [], []
        for i, batch in enumerate(loader):
            want = torch.stack([torch.from_numpy(arrays[int(k)]) for k in batch["__key__"]])
            assert torch.equal(batch["npy"], want)
            made.append(batch["made"])
            inherited.append(batch["inherited"])
            if i == p:  # held across the next passes, and written by the user
                batch["npy"].mul_(-1.0)
                kept.append((batch, -want))
        passes.append((max(made), min(inherited)))
        assert len(loader.channels.retired) <= 2 * MAX_SEGMENTS
    # the first workers make their segments; later ones start with the ones no batch holds
    assert passes[0][0] > 0 and passes[0][1] == 0
    assert all(inherited > 0 for _, inherited in passes[1:]), passes
    assert all(made < passes[0][0] for made, _ in passes[1:]), passes
    for batch, want in kept:  # never handed to a later worker while held
        assert torch.equal(batch["npy"], want)
    before = set(loader.channels.retired)  # segments still held by kept batches
    for _ in loader:  # a pass cut short: its workers may still run, so none of theirs is retired
        break
    del _
    gc.collect()
    assert set(loader.channels.retired) <= before


class ReportPending:
    def __call__(self, batch):
        pool = worker_pool()
        batch["reused"] = pool.reused
        batch["pending"] = sum(1 for s in pool.segments if s.pending)
        return batch


def test_batches_dropped_unseen_when_a_pass_is_cut_short_release_their_segments(tmp_path):
    root, arrays = _npy_dataset(tmp_path / "d")
    ds = ShardStream(root, batch_size=8, shuffle=False, world=World(0, 1))
    loader = make_loader(ds, num_workers=2, persistent_workers=True, collate_fn=ReportPending(), log_interval=None)
    for _ in range(6):  # each cut-short pass: DataLoader drops the batches the workers prefetched
        for batch in loader:
            want = torch.stack([torch.from_numpy(arrays[int(k)]) for k in batch["__key__"]])
            assert torch.equal(batch["npy"], want)
            break
    del batch
    seen = []
    for batch in loader:
        want = torch.stack([torch.from_numpy(arrays[int(k)]) for k in batch["__key__"]])
        assert torch.equal(batch["npy"], want)
        seen.append((batch["reused"], batch["pending"]))
    # the dropped batches' segments came back: the workers still reuse, and few are in flight
    # (batches alternate between the two workers: each worker's count is compared with its own)
    assert seen[-2][0] > seen[0][0] and seen[-1][0] > seen[1][0] and max(p for _, p in seen) <= 4, seen


def _write_blobs(root, n: int, seed: int) -> list[bytes]:
    """n undecoded samples of 1 MB and up to 50 KB more, 4 to a shard, in root; their bytes."""
    rng = np.random.default_rng(seed)
    blobs = [rng.bytes(MB + int(rng.integers(0, 50_000))) for _ in range(n)]
    with ShardWriter(str(root), max_count=4) as w:
        for i, b in enumerate(blobs):
            w.write_encoded(f"{i:04d}", {"bin": b})
    return blobs


def test_large_undecoded_fields_reuse_segments_and_arrive_whole(tmp_path):
    blobs = _write_blobs(tmp_path / "b", 12, seed=1)
    ds = ShardStream(str(tmp_path / "b"), batch_size=2, shuffle=False, decode=False, world=World(0, 1))
    loader = make_loader(ds, num_workers=2, persistent_workers=True, collate_fn=ReportReuse2(), log_interval=None)
    reused = 0
    for _ in range(3):
        for batch in loader:
            assert [type(b) for b in batch["bin"]] == [bytes, bytes]
            assert batch["bin"] == [blobs[int(k)] for k in batch["__key__"]]
            reused = max(reused, batch["reused"])
    assert reused > 0


class ReportReuse2:
    def __call__(self, batch):
        pool = worker_pool()
        batch["reused"] = -1 if pool is None else pool.reused
        return batch


def test_with_reuse_off_workers_have_no_pool_and_batches_are_right(tmp_path):
    root, arrays = _npy_dataset(tmp_path / "d", n=16)
    ds = ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1))
    loader = make_loader(ds, num_workers=2, collate_fn=ReportReuse2(), log_interval=None, reuse_shared_memory=False)
    batches = list(loader)
    assert len(batches) == 4
    for batch in batches:
        assert batch["reused"] == -1
        assert torch.equal(batch["npy"], torch.stack([torch.from_numpy(arrays[int(k)]) for k in batch["__key__"]]))


class ReportPool:
    def __call__(self, batch):
        pool = worker_pool()
        batch["reused"] = -1 if pool is None else pool.reused
        batch["inherited"] = -1 if pool is None else pool.inherited
        return batch


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_that_are_not_forked_reuse_and_inherit_segments_too(tmp_path, method):
    root, arrays = _npy_dataset(tmp_path / "d", n=64)
    ds = ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1))
    loader = make_loader(ds, num_workers=2, collate_fn=ReportPool(), log_interval=None, start_method=method, persistent_workers=False)
    for p in range(2):  # the second pass's new workers inherit the first pass's segments
        reused = 0
        batches = 0
        for batch in loader:
            batches += 1
            assert (batch["inherited"] > 0) == (p == 1)
            assert batch["reused"] >= 0  # a pool: its pipe and segments came with its worker_init_fn
            reused = max(reused, batch["reused"])
            assert torch.equal(batch["npy"], torch.stack([torch.from_numpy(arrays[int(k)]) for k in batch["__key__"]]))
        assert batches == 16 and reused > 0
    assert loader.channels is not None and loader.channels.retired  # kept for the next pass's workers


def test_a_dropped_loader_closes_its_pipes(tmp_path):
    root, _ = _npy_dataset(tmp_path / "d", n=16)

    def open_pipes() -> set[str]:  # "pipe:[inode]" of every pipe end open in this process
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                out.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the listing's own descriptor, closed by now
                pass
        return {name for name in out if name.startswith("pipe:")}

    ds = ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1))
    loader = make_loader(ds, num_workers=2, log_interval=None)
    assert loader.channels is not None
    ours = {os.readlink(f"/proc/self/fd/{fd}") for pair in loader.channels.pipes for fd in pair}
    assert len(ours) == 2 and ours <= open_pipes()  # two pipes, both ends here
    batches = list(loader)
    del loader
    gc.collect()
    assert ours <= open_pipes()  # the batches still hold the channels: their releases need the pipes
    del batches
    gc.collect()
    assert not ours & open_pipes()


class RecordAhead:
    """A worker_init_fn (after the loader's own start): what this worker's pool is making ahead."""

    def __init__(self, path):
        self.path = path

    def __call__(self, worker_id):
        pool = worker_pool()
        with open(os.path.join(self.path, f"ahead-{worker_id}"), "w") as f:
            f.write(str(-1 if pool is None else pool.ahead_capacity))


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_workers_make_their_first_segment_ahead_sized_from_the_manifest(tmp_path, method):
    blobs = _write_blobs(tmp_path / "b", 16, seed=2)
    ds = ShardStream(str(tmp_path / "b"), batch_size=2, shuffle=False, decode=False, world=World(0, 1))
    record = RecordAhead(str(tmp_path))
    loader = make_loader(ds, num_workers=2, worker_init_fn=record, log_interval=None, start_method=method)
    # the manifest's mean sample (its tar headers included) times the batch, a quarter more
    assert loader.channels is not None
    assert 2 * (MB + 50_000) <= loader.channels.first_batch_bytes <= 2 * (MB + 60_000) * 5 // 4
    got = {}
    for batch in loader:
        assert [type(b) for b in batch["bin"]] == [bytes, bytes]
        got.update(zip(batch["__key__"], batch["bin"]))
    assert got == {f"{i:04d}": b for i, b in enumerate(blobs)}
    for worker in range(2):
        with open(tmp_path / f"ahead-{worker}") as f:
            assert int(f.read()) >= loader.channels.first_batch_bytes


def test_no_segment_is_sized_ahead_where_the_manifest_cannot_tell_a_batch_size(tmp_path):
    root, _ = _npy_dataset(tmp_path / "d", n=16)  # small samples: their fields travel inline
    small = ShardStream(root, batch_size=4, shuffle=False, decode=False, world=World(0, 1))
    assert make_loader(small, num_workers=2, log_interval=None).channels.first_batch_bytes == 0
    rng = np.random.default_rng(3)
    with ShardWriter(str(tmp_path / "b"), max_count=4) as w:
        for i in range(8):
            w.write_encoded(f"{i:04d}", {"bin": rng.bytes(2 * MB)})
    big = str(tmp_path / "b")
    for kwargs in ({"decode": True}, {"decode": False, "transform": _identity}, {"decode": {"bin": bytes}}):
        ds = ShardStream(big, batch_size=2, shuffle=False, world=World(0, 1), **kwargs)
        assert make_loader(ds, num_workers=2, log_interval=None).channels.first_batch_bytes == 0, kwargs
    ds = ShardStream(big, batch_size=2, shuffle=False, decode=False, world=World(0, 1))
    assert make_loader(ds, num_workers=2, log_interval=None, collate_fn=ReportReuse2()).channels.first_batch_bytes == 0
    assert make_loader(ds, num_workers=2, log_interval=None).channels.first_batch_bytes >= 4 * MB


def _identity(sample):
    return sample


# --- torch's own default_collate in a worker -------------------------------------------------
# torch's default_collate stacks a worker's batch into a storage it asks UntypedStorage._new_shared
# for; in make_loader's workers that has a segment pool, a large one comes from the pool
# (private.worker_new_shared), so the batch rides the reused segments as shardstream's own collate's do.
IMAGE = (3, 64, 64)  # 12 KiB of uint8 per sample: a batch of 8 is 96 KiB, over the pack step's 64 KiB inline limit


def _image_dataset(root, n: int = 48) -> tuple[str, list[np.ndarray]]:
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, IMAGE, dtype=np.uint8) for _ in range(n)]
    with ShardWriter(str(root), max_count=12) as w:
        for i, image in enumerate(images):
            w.write({"__key__": f"{i:04d}", "npy": image})
    return str(root), images


def _torch_collated(root: str) -> ShardStream:
    from torch.utils.data import default_collate

    return ShardStream(root, batch_size=8, shuffle=False, collate=default_collate, world=World(0, 1))


class ReportTorchStack:
    """A loader collate_fn, after the dataset's collate (torch's default_collate), in the worker: the
    pool's counters, the bytes of the storage torch stacked the batch into against the batch's own,
    whose _new_shared this process has, and whether a stack made in another thread is pooled."""

    def __call__(self, batch):
        from torch.utils.data import default_collate

        pool = worker_pool()
        x = batch["npy"]
        batch["pool"] = torch.tensor([-1, -1, -1] if pool is None else [pool.reused, pool.made, pool.made_ahead])
        batch["storage"] = torch.tensor([x.untyped_storage().nbytes(), x.nbytes, int(x.is_shared())])
        batch["new_shared"] = torch.UntypedStorage._new_shared.__func__.__qualname__
        stacked: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: stacked.append(default_collate(list(x))))
        thread.start()
        thread.join()
        batch["threaded_pooled"] = pool is not None and pool.find(stacked[0]) is not None
        return batch


def _want(images: list[np.ndarray], keys: list[str]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(images[int(k)]) for k in keys])


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_torch_default_collate_batches_ride_reused_segments_and_held_batches_keep_their_values(tmp_path, method):
    root, images = _image_dataset(tmp_path / "d")
    ds = _torch_collated(root)
    alone = {tuple(b["__key__"]): b["npy"] for b in make_loader(ds, num_workers=0, log_interval=None)}
    loader = make_loader(ds, num_workers=2, start_method=method, collate_fn=ReportTorchStack(), log_interval=None, pin_memory=False)
    kept = []
    reused = 0
    for p in range(3):
        batches = 0
        for i, batch in enumerate(loader):
            batches += 1
            x, keys = batch["npy"], batch["__key__"]
            assert torch.equal(x, alone[tuple(keys)]) and torch.equal(x, _want(images, keys))  # as with no workers
            made = batch["pool"].tolist()
            assert made[1] + made[2] > 0  # the worker's pool made the segments torch stacked into
            assert batch["new_shared"] == "worker_new_shared.<locals>._new_shared"
            assert batch["threaded_pooled"] is False  # another thread of the worker: torch's own shared memory
            reused = max(reused, made[0])
            if p == 0 and i % 2 == 0:  # held through the later passes, one of them written by the user
                if i == 0:
                    x.add_(1)
                kept.append((x, _want(images, keys) + (1 if i == 0 else 0)))
        assert batches == 6
    assert reused > 0  # segments came back to the workers (their pool's count, not a timing)
    for x, want in kept:  # no held segment was written again
        assert torch.equal(x, want)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_torch_default_collate_stacks_into_a_pooled_segment_larger_than_it_asked(tmp_path, method):
    root, images = _image_dataset(tmp_path / "d", n=24)
    ds = _torch_collated(root)
    loader = make_loader(ds, num_workers=2, start_method=method, collate_fn=ReportTorchStack(), log_interval=None, pin_memory=False)
    batch_bytes = 8 * int(np.prod(IMAGE))
    assert loader.channels is not None
    loader.channels.first_batch_bytes = batch_bytes * 3 // 2  # each worker's first segment, made ahead: half as large again
    larger = 0
    for batch in loader:
        assert torch.equal(batch["npy"], _want(images, batch["__key__"]))
        storage, asked, shared = batch["storage"].tolist()
        assert asked == batch_bytes and storage >= asked and shared
        if batch["pool"].tolist()[2] == 1 and storage > asked:
            larger += 1
    assert larger >= 2  # each worker's first batch: the segment made ahead, larger than torch asked


def test_torch_default_collate_keeps_torch_shared_memory_where_there_is_no_pool(tmp_path):
    from torch.utils.data import DataLoader

    root, images = _image_dataset(tmp_path / "d", n=24)
    ds = _torch_collated(root)
    no_reuse = make_loader(ds, num_workers=2, start_method="fork", collate_fn=ReportTorchStack(), log_interval=None, reuse_shared_memory=False)
    plain = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=ReportTorchStack(), multiprocessing_context="fork")
    for loader, new_shared in ((no_reuse, "worker_new_shared.<locals>._new_shared"), (plain, "_StorageBase._new_shared")):
        batches = list(loader)
        assert len(batches) == 3
        for batch in batches:
            assert torch.equal(batch["npy"], _want(images, batch["__key__"]))
            assert batch["pool"].tolist() == [-1, -1, -1]  # no pool in the worker
            storage, asked, shared = batch["storage"].tolist()
            assert storage == asked and shared  # torch's own fresh shared memory, as large as asked
            assert batch["new_shared"] == new_shared
