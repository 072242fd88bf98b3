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


@pytest.mark.parametrize(
    "bad,message",
    [
        (npy_bytes(np.arange(10))[:-8], "EOF"),
        (b"\x93NUMPY\x01\x00", "magic"),
        (b"not npy at all", "magic"),
        (npy_bytes(np.array([None, 1], dtype=object)), "allow_pickle"),
    ],
)
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
    from shardstream import get_worker_info

    batch = default_collate(samples)
    take = getattr(get_worker_info(), "take", None)  # a worker process's segment pool's take, None elsewhere
    batch["made_in_shared_memory"] = take is not None and take.__self__.find(batch["npy"]) is not None
    return batch


@pytest.mark.parametrize("workers", [0, "threads", "processes"])
def test_batches_equal_np_load_and_stack_and_are_shared_when_made_in_workers(tmp_path, workers):
    root, arrays = write_npy(tmp_path / "d")
    ds = ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1), collate=_collate_reporting_shared)
    batches = list(make_loader(ds, num_workers=2 if workers else 0, workers=workers or None))
    assert len(batches) == 6
    for batch in batches:
        want = torch.stack([torch.from_numpy(arrays[int(k)]) for k in batch["__key__"]])
        assert batch["npy"].dtype == want.dtype and batch["npy"].stride() == want.stride()
        assert torch.equal(batch["npy"], want)
        assert batch["cls"].tolist() == [int(k) for k in batch["__key__"]]
        # In a worker process the batch is written straight into a segment of its pool, so the
        # hand-off passes a descriptor and copies nothing; threads hand the tensor itself over.
        assert batch["made_in_shared_memory"] is (workers == "processes")


# -- large members: read into a buffer of their own, one copy -----------------------------------


def _tar(path, members):
    """A real tar file (Python's tarfile) of (name, bytes) members."""
    import tarfile

    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


class _CountingFile:
    """A local file's read/readinto, counting the bytes each one moved."""

    def __init__(self, path, into=True):
        self.file = open(path, "rb", buffering=0)
        self.read_bytes = self.into_bytes = 0
        if into:
            self.readinto = self._readinto

    def __call__(self, n):
        data = self.file.read(n)
        self.read_bytes += len(data)
        return data

    def _readinto(self, view):
        n = self.file.readinto(view)
        self.into_bytes += n
        return n


def _members(seed=0, n=24):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        big = int(rng.integers(1, 3 << 20)) if i % 3 else int(rng.integers(0, 3000))
        out.append((f"{i:04d}.npy", rng.bytes(big)))
        out.append((f"{i:04d}.cls", str(i).encode()))
    return out


@pytest.mark.parametrize("into", [True, False])
@pytest.mark.parametrize("read_size", [100_000, 4 << 20])
def test_large_members_are_read_whole_and_equal_what_tarfile_reads(tmp_path, into, read_size):
    from shardstream.format.tar import iter_samples

    members = _members()
    path = _tar(tmp_path / "a.tar", members)
    f = _CountingFile(path, into)
    size = path.stat().st_size
    got = {}
    for key, _start, _end, fields in iter_samples(f, url="a.tar", end=size, read_size=read_size, keep_buffers={"npy"}):
        for ext, value in fields.items():
            got[f"{key}.{ext}"] = value
    assert {k: bytes(v) for k, v in got.items()} == dict(members)
    for name, value in got.items():
        large = name.endswith(".npy") and len(value) >= (1 << 20)
        # kept extensions stay the member's own writable buffer; everything else is bytes
        assert type(value) is (memoryview if large else bytes), (name, type(value))
        assert not large or not value.readonly
    assert f.read_bytes + f.into_bytes == size - 1024 or f.read_bytes + f.into_bytes == size
    if into:
        large = [len(d) for _, d in members if len(d) >= (1 << 20)]
        # every byte of the large members went straight into its own buffer, but for the first
        # read block and the start of each one read in the short read that follows a large member
        assert f.into_bytes >= sum(large) - read_size - len(large) * (128 << 10)


def test_large_members_not_kept_are_bytes(tmp_path):
    from shardstream.format.tar import iter_samples

    members = [("a.bin", b"x" * (3 << 20)), ("a.npy", b"y" * (2 << 20)), ("b.bin", b"z" * 10)]
    path = _tar(tmp_path / "b.tar", members)
    samples = list(iter_samples(_CountingFile(path), url="b.tar", end=path.stat().st_size))
    assert [(k, {e: (type(v), len(v)) for e, v in f.items()}) for k, _, _, f in samples] == [
        ("a", {"bin": (bytes, 3 << 20), "npy": (bytes, 2 << 20)}),
        ("b", {"bin": (bytes, 10)}),
    ]


def test_a_truncated_large_member_is_an_error_naming_the_offset(tmp_path):
    from shardstream.errors import ShardFormatError
    from shardstream.format.tar import iter_samples

    path = _tar(tmp_path / "c.tar", [("a.npy", bytes(3 << 20)), ("a.cls", b"1")])
    data = path.read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: 2 << 20])
    with pytest.raises(ShardFormatError, match="truncated"):
        # the manifest says the range is the whole original size: the stream ends early
        list(iter_samples(_CountingFile(cut), url="cut.tar", end=len(data), keep_buffers={"npy"}))


def test_a_corrupt_large_member_header_is_refused_before_its_bytes_are_read(tmp_path):
    from shardstream.errors import ShardFormatError
    from shardstream.format.tar import iter_samples

    path = _tar(tmp_path / "d.tar", [("a.cls", b"1"), ("a.npy", bytes(8 << 20))])
    data = bytearray(path.read_bytes())
    data[1024 + 3] ^= 0x20  # the second header's name: its checksum no longer matches
    path.write_bytes(data)
    f = _CountingFile(path)
    with pytest.raises(ShardFormatError, match="checksum"):
        list(iter_samples(f, url="d.tar", end=len(data), read_size=64 << 10))
    assert f.read_bytes + f.into_bytes <= 256 << 10


def _npy_noting_buffer(data):
    """The default .npy decoder, plus what it was handed: the member's own writable buffer (viewed in
    place, no copy) or bytes."""
    from shardstream.pipeline.decode import load_npy

    return {"array": torch.from_numpy(load_npy(data)), "own_buffer": type(data) is memoryview and not data.readonly}


@pytest.mark.parametrize("workers", [0, 2])
def test_large_npy_fields_reach_viewing_decoders_as_their_own_buffer(tmp_path, workers, monkeypatch):
    from shardstream.pipeline import decode

    monkeypatch.setattr(decode, "VIEWING_DECODERS", decode.VIEWING_DECODERS | {_npy_noting_buffer})
    root, arrays = write_npy(tmp_path / "d", n=6, shape=(600, 600))  # 1.4 MB members
    ds = ShardStream(root, batch_size=3, shuffle=False, world=World(0, 1), decode={"npy": _npy_noting_buffer})
    # forked: the workers see this process's patched VIEWING_DECODERS (a forkserver's would import it afresh)
    batches = list(make_loader(ds, num_workers=workers, start_method="fork"))
    assert len(batches) == 2
    for batch in batches:
        for key, field in zip(batch["__key__"], batch["npy"]):
            assert torch.equal(field["array"], torch.from_numpy(arrays[int(key)]))
            assert field["own_buffer"] is True

    # the default decoder gives the same batches; with no decoder the fields arrive as bytes
    plain = ShardStream(root, batch_size=3, shuffle=False, world=World(0, 1))
    for a, b in zip(make_loader(plain, num_workers=workers), batches):
        assert torch.equal(a["npy"], torch.stack([f["array"] for f in b["npy"]]))
    raw = ShardStream(root, batch_size=3, shuffle=False, decode=False, world=World(0, 1))
    fields = [v for b in make_loader(raw, num_workers=workers) for v in b["npy"]]
    assert len(fields) == 6 and all(type(v) is bytes for v in fields)
    assert all(np.array_equal(np.load(io.BytesIO(v)), a) for v, a in zip(fields, arrays))


def test_fields_are_bytes_when_the_stream_hands_over_bytearrays(tmp_path):
    """S3 reads come back as bytearrays; the fields cut from them are bytes all the same."""
    from shardstream.format.tar import iter_samples

    members = _members(seed=3, n=9)
    path = _tar(tmp_path / "e.tar", members)
    f = open(path, "rb", buffering=0)

    def read(n):
        return bytearray(f.read(n))

    got = {}
    for key, _s, _e, fields in iter_samples(read, url="e.tar", end=path.stat().st_size, read_size=200_000):
        for ext, value in fields.items():
            assert type(value) is bytes, (key, ext, type(value))
            got[f"{key}.{ext}"] = value
    f.close()
    assert got == dict(members)
