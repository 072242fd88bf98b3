"""The loader: make_loader leaves the dataset as it was; the hand-off from worker processes
(loader/handoff.py) keeps every batch structure, sends small tensors inline and large ones on
reused anonymous segments; thread and process workers give the same batches."""

from __future__ import annotations

import collections
import os
import pickle

import numpy as np
import pytest
import torch
from conftest import write_dataset

from shardstream import ShardStream, World, make_loader
from shardstream.loader.handoff import INLINE_MAX_BYTES, SHARED_FIELD_MIN_BYTES, Mappings, SegmentPool, _Inline, _OnSegment, pack

Pair = collections.namedtuple("Pair", "x y")


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return type(a) is type(b) and a == b


small = torch.arange(6)
large = torch.zeros(INLINE_MAX_BYTES // 4 + 1, dtype=torch.float32)
STRUCTURES = [
    {"cls": small, "img": large, "__key__": ["a", "b"]},
    (small, large),
    [small, {"nested": (small.float(), [small])}],
    Pair(small, large),
    small,
    {"arr": np.ones(3), "t": small, "bf": small.to(torch.bfloat16), "none": None},
    {"nothing": "to inline", "big": large},
    {"raw": [b"x" * SHARED_FIELD_MIN_BYTES, b"small", bytearray(b"y" * (SHARED_FIELD_MIN_BYTES + 3))], "one": b"z" * (2 * SHARED_FIELD_MIN_BYTES)},
]


def round_trip(batch, pool=None, mappings=None, pin=False):
    """``batch`` packed as a worker packs it and unpacked as the loop does (one process: the
    descriptors are duplicated, as sending them would)."""
    pool = pool or SegmentPool()
    mappings = mappings or Mappings(1)
    packed, fds, dropped = pack(batch, pool)
    sent = pickle.loads(pickle.dumps(packed))  # as the socket carries it
    return mappings.unpack(0, sent, [os.dup(fd) for fd in fds], dropped, pin), packed


@pytest.mark.parametrize("batch", STRUCTURES)
def test_pack_and_unpack_keep_every_structure(batch):
    assert same(round_trip(batch)[0], batch)


def test_small_tensors_travel_as_arrays_large_ones_on_segments():
    _, packed = round_trip({"cls": small, "img": large, "arr": np.ones(2)})
    assert type(packed["cls"]) is _Inline and type(packed["img"]) is _OnSegment
    assert isinstance(packed["arr"], np.ndarray)  # the user's own arrays stay arrays
    got, packed = round_trip({"raw": b"r" * SHARED_FIELD_MIN_BYTES, "ba": bytearray(SHARED_FIELD_MIN_BYTES), "s": b"small"})
    assert type(packed["raw"]) is _OnSegment and packed["s"] == b"small"
    assert type(got["raw"]) is bytes and type(got["ba"]) is bytearray and got["s"] == b"small"


def test_a_segment_is_written_again_only_once_the_loop_let_go():
    pool, mappings = SegmentPool(), Mappings(1)
    a, _ = round_trip({"img": torch.full((1 << 18,), 1.0)}, pool, mappings)
    assert len(pool._segments) == 1
    b, _ = round_trip({"img": torch.full((1 << 18,), 2.0)}, pool, mappings)  # the first is held: a second segment
    assert len(pool._segments) == 2 and a["img"].eq(1.0).all() and b["img"].eq(2.0).all()
    pool.release(mappings.take_released(0))  # nothing released yet: both still held
    assert all(s.out for s in pool._segments)
    del a
    released = mappings.take_released(0)
    assert released == [0]  # the first batch's tensors are gone: its segment comes back
    pool.release(released)
    c, _ = round_trip({"img": torch.full((1 << 18,), 3.0)}, pool, mappings)
    assert len(pool._segments) == 2 and b["img"].eq(2.0).all() and c["img"].eq(3.0).all()  # reused, b untouched


def test_a_batch_buffer_made_on_a_segment_crosses_without_a_copy():
    pool, mappings = SegmentPool(), Mappings(1)
    buffer = torch.from_numpy(pool.take(1 << 20)).view(torch.float32)  # as the default collate makes it in a worker
    buffer.fill_(7.0)
    _, packed = round_trip({"x": buffer[:100_000].view(1000, 100)}, pool, mappings)
    assert packed["x"].offset == 0 and len(pool._segments) == 1  # found on its segment, not copied into another


def test_pinned_or_copied_fields_release_their_segment_at_once():
    pool, mappings = SegmentPool(), Mappings(1)
    got, _ = round_trip({"raw": b"r" * SHARED_FIELD_MIN_BYTES}, pool, mappings)
    assert got["raw"] == b"r" * SHARED_FIELD_MIN_BYTES and mappings.take_released(0) == [0]


def test_segments_have_no_name_in_dev_shm():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    pool = SegmentPool()
    got, _ = round_trip({"img": large, "raw": b"r" * SHARED_FIELD_MIN_BYTES}, pool)
    assert len(pool._segments) >= 1 and same(got["img"], large)
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) == before


def _raw_fields(tmp_path):
    from shardstream import ShardWriter

    rng = np.random.default_rng(1)
    fields = [rng.bytes(SHARED_FIELD_MIN_BYTES + int(rng.integers(0, 5000))) for _ in range(8)]
    with ShardWriter(str(tmp_path / "raw"), max_count=2) as w:
        for i, f in enumerate(fields):
            w.write_encoded(f"{i:03d}", {"bin": f, "cls": str(i).encode()})
    return str(tmp_path / "raw"), fields


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_large_undecoded_fields_cross_real_workers_as_bytes(tmp_path, workers):
    root, fields = _raw_fields(tmp_path)
    ds = ShardStream(root, batch_size=2, shuffle=False, decode=False, world=World(0, 1))
    got = {}
    for batch in make_loader(ds, num_workers=2, workers=workers):
        for key, value in zip(batch["__key__"], batch["bin"]):
            assert type(value) is bytes
            got[int(key)] = value
    assert got == dict(enumerate(fields))


def test_large_batches_held_across_passes_keep_their_values(tmp_path):
    root, fields = _raw_fields(tmp_path)
    decoder = {"bin": lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8)}
    ds = ShardStream(root, batch_size=2, shuffle=False, decode=decoder, world=World(0, 1))
    loader = make_loader(ds, num_workers=2, workers="processes", start_method="fork")
    held = [b for _ in range(2) for b in loader]  # every batch of two passes kept: no segment written under them
    for batch in held:
        for key, value in zip(batch["__key__"], batch["bin"]):
            assert bytes(value.numpy()) == fields[int(key)]


def to_tuple(samples):
    return torch.tensor([s["cls"] for s in samples]), [s["__key__"] for s in samples]


def to_bare_tensor(samples):
    return torch.tensor([s["cls"] for s in samples])


@pytest.mark.parametrize("workers", ["threads", "processes"])
@pytest.mark.parametrize("collate", [to_tuple, to_bare_tensor, torch.utils.data.default_collate])
def test_user_collate_results_cross_real_workers_intact(tmp_path, collate, workers):
    root = write_dataset(tmp_path / "d", 40, max_count=10)
    ds = ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1), collate=collate)
    in_process = list(make_loader(ds, num_workers=0))
    through_workers = list(make_loader(ds, num_workers=2, workers=workers))
    assert len(through_workers) == len(in_process) == 10
    key = (lambda b: b[1]) if collate is to_tuple else (lambda b: b.tolist() if isinstance(b, torch.Tensor) else b["__key__"])
    order = sorted(range(10), key=lambda i: str(key(through_workers[i])))
    expected = sorted(range(10), key=lambda i: str(key(in_process[i])))
    for i, j in zip(order, expected):
        assert same(through_workers[i], in_process[j])


def _same(batch):
    return batch


def test_make_loader_does_not_change_the_dataset(tmp_path):
    root = write_dataset(tmp_path / "d", 40, max_count=10)
    ds = ShardStream(root, batch_size=4, world=World(0, 1))
    before = {k: v for k, v in vars(ds).items()}
    loader = make_loader(ds, num_workers=2, collate_fn=_same)  # module level: forkserver workers get it pickled
    assert ds.loader_workers == 2  # all it is told: what its plan() and state assume
    assert vars(ds).keys() == before.keys() and all(vars(ds)[k] is v for k, v in before.items() if k != "loader_workers")
    assert sorted(k for b in loader for k in b["__key__"]) == sorted(k for b in ds for k in b["__key__"])
    assert vars(ds).keys() == before.keys()


def test_loader_map_sees_batches_as_the_dataset_made_them(tmp_path):
    root = write_dataset(tmp_path / "d", 40, max_count=10)
    ds = ShardStream(root, batch_size=4, world=World(0, 1))
    loader = make_loader(ds, num_workers=2).map(lambda b: (type(b["cls"]).__name__, len(b["__key__"])))
    assert list(loader) == [("Tensor", 4)] * 10
