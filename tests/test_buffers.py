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
    assert len(pools) == 2 and all(p.reused > 0 for p in pools)


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
