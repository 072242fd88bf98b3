"""loader.py: make_loader leaves the dataset as it was; the worker hand-off keeps every batch
structure and sends small tensors inline."""

from __future__ import annotations

import collections
import os
import sys

import numpy as np
import pytest
import torch
from conftest import write_dataset

from shardstream import ShardStream, World, make_loader
from shardstream.loader import INLINE_MAX_BYTES, PACKED, SHARED, SHARED_FIELD_MIN_BYTES, pack_batch, unpack_batch

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


@pytest.mark.parametrize("batch", STRUCTURES)
def test_pack_and_unpack_keep_every_structure(batch):
    packed = pack_batch(batch)
    assert same(unpack_batch(packed), batch)


def test_small_tensors_travel_as_arrays_large_ones_as_tensors():
    packed = pack_batch({"cls": small, "img": large})
    assert isinstance(packed["batch"]["cls"], np.ndarray) and packed["batch"]["img"] is large
    assert packed[PACKED] == {"cls": True}
    assert pack_batch({"img": large, "k": ["a"]}) == {"img": large, "k": ["a"]}  # nothing small: unchanged
    user_arrays = {"arr": np.ones(2)}
    assert isinstance(unpack_batch(pack_batch(user_arrays))["arr"], np.ndarray)  # the user's own arrays stay arrays


def test_large_bytes_cross_in_shared_memory_and_arrive_as_the_same_type():
    data = bytes(range(256)) * (SHARED_FIELD_MIN_BYTES // 256 + 1)
    other = bytearray(b"\x07" * (SHARED_FIELD_MIN_BYTES + 5))
    packed = pack_batch({"raw": [data, b"tiny", data[::-1]], "k": ["a", "b", "c"], "ba": other})
    # every large field of the batch in one shared segment (one handle to pass), none left in the structure
    sent = packed[SHARED]
    assert sent.tensor.is_shared() and sent.tensor.numel() == 2 * len(data) + len(other)
    assert packed["batch"]["raw"] == [None, b"tiny", None] and packed["batch"]["ba"] is None
    assert not any(isinstance(v, torch.Tensor) for v in packed.values())  # the pin-memory thread has nothing to pin
    back = unpack_batch(packed)
    assert type(back["raw"][0]) is bytes and back["raw"] == [data, b"tiny", data[::-1]]
    assert type(back["ba"]) is bytearray and back["ba"] == other and back["k"] == ["a", "b", "c"]


def _raw_fields(tmp_path):
    from shardstream import ShardWriter

    rng = np.random.default_rng(1)
    fields = [rng.bytes(SHARED_FIELD_MIN_BYTES + int(rng.integers(0, 5000))) for _ in range(8)]
    with ShardWriter(str(tmp_path / "raw"), max_count=2) as w:
        for i, f in enumerate(fields):
            w.write_encoded(f"{i:03d}", {"bin": f, "cls": str(i).encode()})
    return str(tmp_path / "raw"), fields


def test_large_undecoded_fields_cross_real_workers_as_bytes(tmp_path):
    root, fields = _raw_fields(tmp_path)
    ds = ShardStream(root, batch_size=2, shuffle=False, decode=False, world=World(0, 1))
    got = {}
    for batch in make_loader(ds, num_workers=2):
        for key, value in zip(batch["__key__"], batch["bin"]):
            assert type(value) is bytes
            got[int(key)] = value
    assert got == dict(enumerate(fields))


def to_tuple(samples):
    return torch.tensor([s["cls"] for s in samples]), [s["__key__"] for s in samples]


def to_bare_tensor(samples):
    return torch.tensor([s["cls"] for s in samples])


@pytest.mark.parametrize("collate", [to_tuple, to_bare_tensor, torch.utils.data.default_collate])
def test_user_collate_results_cross_real_workers_intact(tmp_path, collate):
    root = write_dataset(tmp_path / "d", 40, max_count=10)
    ds = ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1), collate=collate)
    in_process = list(make_loader(ds, num_workers=0))
    through_workers = list(make_loader(ds, num_workers=2))
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


def _faults_reallocating() -> int:
    """Minor page faults of allocating 16 MiB in 4 MiB buffers again right after freeing the same."""
    import resource

    held = [bytearray(4 << 20) for _ in range(4)]
    del held
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [bytearray(4 << 20) for _ in range(4)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del held
    return faults


def _with_faults(sample):
    sample["faults"] = _faults_reallocating()
    return sample


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_workers_keep_the_memory_they_free_for_their_next_samples(tmp_path):
    """A loader's workers reuse the heap memory they freed (glibc keeps it rather than unmapping or
    trimming it): 16 MiB of large buffers allocated again after a free take no new pages, where a
    process left to glibc's defaults maps (and the kernel zeroes) every page afresh, 4,096 faults."""
    import subprocess

    url = write_dataset(tmp_path / "ds", n=4, max_count=2)
    ds = ShardStream(url, batch_size=2, shuffle=False, world=World(0, 1), transform=_with_faults)
    loader = make_loader(ds, num_workers=2, pin_memory=False, log_interval=None)
    in_workers = [f for batch in loader for f in batch["faults"].tolist()]
    assert len(in_workers) == 4 and max(in_workers) < 256, in_workers
    here = os.path.dirname(__file__)
    plain = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import test_loader; print(test_loader._faults_reallocating())"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert int(plain.stdout) > 2048  # (the same in a process of its own, glibc's defaults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_workers_keep_glibcs_defaults_when_asked(tmp_path, monkeypatch):
    """SHARDSTREAM_KEEP_FREED_MEMORY=0 in the rank's environment: the workers leave glibc's malloc as
    it is, so the same reallocation maps its pages afresh (a user short of memory keeps it low)."""
    monkeypatch.setenv("SHARDSTREAM_KEEP_FREED_MEMORY", "0")
    url = write_dataset(tmp_path / "ds", n=4, max_count=2)
    ds = ShardStream(url, batch_size=2, shuffle=False, world=World(0, 1), transform=_with_faults)
    loader = make_loader(ds, num_workers=2, pin_memory=False, log_interval=None)
    in_workers = [f for batch in loader for f in batch["faults"].tolist()]
    assert len(in_workers) == 4 and min(in_workers) > 2048, in_workers
