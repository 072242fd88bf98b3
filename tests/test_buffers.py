"""The pass's buffer pool: memory is handed out again only when nothing refers to it, so batches
and decoded fields a user keeps are never overwritten, and memory nobody holds is reused."""

from __future__ import annotations

import numpy as np
import torch

from shardstream import ShardStream, ShardWriter, World
from shardstream.buffers import BufferPool, active_pool, batch_buffers
from shardstream.pipeline.batch import default_collate


def test_memory_is_reused_only_after_every_view_is_gone():
    pool = BufferPool()
    a = pool.take(1000)
    first = a.ctypes.data
    holders = [torch.from_numpy(a[10:20]), np.frombuffer(memoryview(a), np.float32, 4), memoryview(a)[5:9]]
    del a
    for _ in range(len(holders)):
        other = pool.take(1000)
        assert other.ctypes.data != first  # a view is alive: not handed out again
        del other
        holders.pop()
    again = pool.take(1000)
    assert again.ctypes.data == first and pool.reused >= 1


def test_the_pool_tracks_at_most_max_bytes():
    pool = BufferPool(max_bytes=3000)
    kept = [pool.take(1000) for _ in range(5)]  # all held: two are plain allocations
    assert pool.tracked_bytes == 3000 and len({k.ctypes.data for k in kept}) == 5
    del kept
    small = pool.take(500)  # no free one of this size: a free one of another size makes room
    assert pool.tracked_bytes == 2500 and small.nbytes == 500


def test_the_default_collate_takes_batch_buffers_from_the_active_pool_only():
    pool = BufferPool()
    samples = [{"x": torch.full((128, 128), float(i))} for i in range(4)]
    with batch_buffers(pool):
        assert active_pool() is pool
        first = default_collate(samples)["x"]
    assert active_pool() is None and pool.allocated == 1
    address = first.data_ptr()
    with batch_buffers(pool):
        second = default_collate(samples)["x"]
    assert second.data_ptr() != address  # the first batch is still held
    del first
    with batch_buffers(pool):
        third = default_collate(samples)["x"]
    assert third.data_ptr() == address and torch.equal(third, second)


def test_batches_and_fields_kept_by_the_user_are_never_overwritten(tmp_path, monkeypatch):
    import shardstream.dataset

    pools: list[BufferPool] = []

    class Recorded(BufferPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(shardstream.dataset, "BufferPool", Recorded)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((520, 520)).astype(np.float32) for _ in range(24)]  # > 1 MiB members
    with ShardWriter(str(tmp_path), max_count=8) as w:
        for i, a in enumerate(arrays):
            w.write({"__key__": f"{i:04d}", "npy": a})

    def passes(keep):
        ds = ShardStream(str(tmp_path), batch_size=4, shuffle=False, world=World(0, 1))
        for _ in range(2):
            for batch in ds:
                keep(batch)

    kept = []
    passes(kept.append)  # every batch held: none may share memory, all must keep their values
    assert len({b["npy"].data_ptr() for b in kept}) == len(kept) == 12
    for batch in kept:
        for key, x in zip(batch["__key__"], batch["npy"]):
            assert torch.equal(x, torch.from_numpy(arrays[int(key)]))

    pools.clear()
    fields = []
    passes(lambda b: fields.extend(b["npy"][i].clone() for i in range(4)))  # batches dropped: memory reused
    assert all(torch.equal(f, torch.from_numpy(arrays[i % 24])) for i, f in enumerate(fields))
    assert len(pools) == 1 and pools[0].reused > 0  # one pool for the dataset's passes


def test_later_passes_allocate_nothing_new_and_thread_workers_share_the_pool(tmp_path):
    import pickle

    from shardstream import make_loader

    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((520, 520)).astype(np.float32) for _ in range(16)]  # > 1 MiB members
    with ShardWriter(str(tmp_path), max_count=4) as w:
        for i, a in enumerate(arrays):
            w.write({"__key__": f"{i:04d}", "npy": a})
    ds = ShardStream(str(tmp_path), batch_size=2, shuffle=False, world=World(0, 1))
    loader = make_loader(ds, num_workers=2, workers="threads", pin_memory=False, log_interval=None)
    keys = [sorted(k for b in loader for k in b["__key__"]) for _ in range(3)]
    assert keys == [[f"{i:04d}" for i in range(16)]] * 3
    pool = ds._buffers
    after_first = pool.allocated
    assert after_first > 0 and pool.tracked_bytes > 0  # the workers' views took their buffers from the dataset's pool
    for batch in loader:  # a fourth pass, every value checked: reused memory holds this pass's bytes
        for key, x in zip(batch["__key__"], batch["npy"]):
            assert torch.equal(x, torch.from_numpy(arrays[int(key)]))
    # Later passes reuse the first pass's buffers: at most a few more as this loop holds each batch
    # a little longer (a pool made per pass would allocate the whole working set again, 3 more times).
    assert pool.allocated < 1.5 * after_first and pool.reused > 2 * after_first
    copy = pickle.loads(pickle.dumps(pool))  # what a worker process receives: an empty pool of the same bound
    assert copy.tracked_bytes == 0 and copy.max_bytes == pool.max_bytes


def test_a_workers_segments_are_mapped_up_front():
    import resource
    import sys

    from shardstream.loader.handoff import SegmentPool

    size = 8 << 20
    array = SegmentPool().take(size)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    array.fill(7)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert int(array.sum(dtype="int64")) == 7 * size
    if sys.platform.startswith("linux"):  # one madvise call mapped every page: filling takes no page faults
        assert faults < 64, f"{faults} page faults filling {size // 4096} pages"
