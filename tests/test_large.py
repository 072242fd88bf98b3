"""Large fields move once: .npy decodes as a view of the member's bytes (same values, dtype,
shape and strides as np.load), batches are assembled in one buffer per field (shared memory in a
DataLoader worker), and the batches are identical to np.load + torch.stack."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from shardstream import ShardStream, ShardWriter, make_loader
from shardstream.pipeline.batch import default_collate, stack_arrays, stack_tensors
from shardstream.pipeline.decode import Decoder, default_decoders, load_npy
from shardstream.plan.topology import World

ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    np.array(5, np.int16),
    np.zeros((0, 3), np.uint8),
    np.arange(6, dtype=np.int64),
    np.array([[True, False]]),
    np.arange(5, dtype=np.float16),
    np.arange(4, dtype=np.complex64),
]


def npy_bytes(array, version=None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version)
    return buf.getvalue()


@pytest.mark.parametrize("version", [None, (1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("index", range(len(ARRAYS)))
def test_npy_decodes_like_np_load(index, version):
    data = npy_bytes(ARRAYS[index], version)
    want = torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))
    for buffer in (data, bytearray(data)):
        got = default_decoders()["npy"](buffer)
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got, want)


def test_npy_is_a_view_of_the_member_and_private_to_it():
    data = bytearray(npy_bytes(np.arange(1000, dtype=np.float32)))
    array = load_npy(data)
    assert np.shares_memory(array, np.frombuffer(data, np.uint8))  # no copy
    immutable = npy_bytes(np.arange(1000, dtype=np.float32))
    a, b = (default_decoders()["npy"](immutable[:]) for _ in range(2))
    a += 1  # in place, as a transform may do: only this sample changes
    assert torch.equal(b, torch.arange(1000, dtype=torch.float32)) and torch.equal(a, b + 1)


@pytest.mark.parametrize("bad,message", [
    (npy_bytes(np.arange(10))[:-8], "EOF"),
    (b"\x93NUMPY\x01\x00", "magic"),
    (b"not npy at all", "magic"),
    (npy_bytes(np.array([None, 1], dtype=object)), "allow_pickle"),
])
def test_broken_npy_is_a_clear_error(bad, message):
    from shardstream.errors import SampleError

    decoder = Decoder(default_decoders())
    with pytest.raises(SampleError, match=message):
        decoder({"__key__": "k", "__url__": "u", "npy": bad})


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.bfloat16, torch.bool, torch.int64])
def test_stacking_into_one_buffer_equals_torch_stack(dtype):
    values = [(torch.rand(64, 300) * 200).to(dtype) for _ in range(5)]  # 5 x >= 19 KB: the buffer path
    got, want = stack_tensors(values), torch.stack(values)
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want)
    arrays = [v.numpy() for v in values] if dtype != torch.bfloat16 else []
    if arrays:
        got, want = stack_arrays(arrays), torch.from_numpy(np.stack(arrays))
        assert got.dtype == want.dtype and got.stride() == want.stride() and torch.equal(got, want)
    mixed = [torch.ones(3), torch.ones(3, dtype=torch.float64)]
    assert torch.stack(mixed).dtype == stack_tensors(mixed).dtype  # promotion: torch's own rules
    fortran = [np.asfortranarray(np.ones((3, 4))) for _ in range(2)]
    assert stack_arrays(fortran).stride() == torch.from_numpy(np.stack(fortran)).stride()


def write_npy(root, n=24, shape=(64, 64)):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
    with ShardWriter(str(root), max_count=10) as w:
        for i, a in enumerate(arrays):
            w.write_encoded(f"{i:04d}", {"npy": npy_bytes(a), "cls": str(i).encode()})
    return str(root), arrays


def _collate_reporting_shared(samples):
    batch = default_collate(samples)
    batch["made_in_shared_memory"] = batch["npy"].is_shared()
    return batch


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_equal_np_load_and_stack_and_are_shared_when_made_in_workers(tmp_path, workers):
    root, arrays = write_npy(tmp_path / "d")
    ds = ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1), collate=_collate_reporting_shared)
    batches = list(make_loader(ds, num_workers=workers))
    assert len(batches) == 6
    for batch in batches:
        want = torch.stack([torch.from_numpy(arrays[int(k)]) for k in batch["__key__"]])
        assert batch["npy"].dtype == want.dtype and batch["npy"].stride() == want.stride()
        assert torch.equal(batch["npy"], want)
        assert batch["cls"].tolist() == [int(k) for k in batch["__key__"]]
        # In a worker the batch is written straight into shared memory, so the hand-off to the
        # main process passes a handle and copies nothing; in the main process it need not be.
        assert batch["made_in_shared_memory"] is (workers > 0)
