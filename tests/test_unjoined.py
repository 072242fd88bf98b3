"""A large member's pieces joined straight into the batch's shared segment (format.tar's
``Unjoined``, loader.SharedFields): the same samples, bytes, order, errors and resume state as
members joined into ``bytes`` first, from the parser up to real DataLoader workers on local
files and on S3 (moto), a body cut mid-member and a corrupt shard included."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from conftest import write_dataset

from shardstream import Read, ShardStream, ShardWriter, Store, World, make_loader
from shardstream.errors import ShardFormatError
from shardstream.format import tar
from shardstream.format.tar import BLOCK, END_OF_ARCHIVE, Unjoined, iter_sample_dicts, member_header, padding
from shardstream.loader.handoff import Mappings, SegmentPool, pack

KB = 1 << 10
MB = 1 << 20


def build(members: list[tuple[str, bytes]], end: bool = True) -> bytes:
    out = b"".join(member_header(name, len(data)) + data + padding(len(data)) for name, data in members)
    return out + END_OF_ARCHIVE if end else out


def mixed_shard(seed: int, large: int) -> bytes:
    """Samples of a large .bin (``large`` bytes and up), a small .cls, now and then a small .txt, a
    large .npy (a field kept as a buffer of its own) or a name long enough for a pax header."""
    rng = np.random.default_rng(seed)
    members = []
    for i in range(14):
        key = f"s{i:03d}" if i % 5 != 3 else "d/" + "x" * 120 + f"{i:03d}"  # (a pax 'path' record)
        members.append((f"{key}.bin", rng.bytes(large + int(rng.integers(0, 3 * BLOCK)) if i % 4 != 2 else int(rng.integers(1, 3000)))))
        members.append((f"{key}.cls", b"%d" % i))
        if i % 3 == 1:
            members.append((f"{key}.txt", rng.bytes(int(rng.integers(1, 200)))))
        if i % 6 == 5:
            members.append((f"{key}.npy", rng.bytes(large + 1000)))
    return build(members)


class Plain:
    """``read(n)`` over bytes, as ``bytes``."""

    def __init__(self, data: bytes):
        self.stream = io.BytesIO(data)

    def __call__(self, n: int) -> bytes:
        return self.stream.read(n)


class Pieces(Plain):
    """And ``pieces(n)``, as read-ahead has: views of immutable pieces of 64 KiB (obstore's)."""

    def pieces(self, n: int) -> list:
        data = self.stream.read(n)
        return [memoryview(data)[i : i + 64 * KB] for i in range(0, len(data), 64 * KB)]


class Reusing(Plain):
    """Every read and piece a view of one buffer that the next read writes again (a stream that
    reuses its block): whatever keeps a piece must have copied it."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.block = bytearray(256 * KB)

    def __call__(self, n: int):
        got = self.stream.readinto(memoryview(self.block)[: min(n, len(self.block))])
        return memoryview(self.block)[:got]

    def pieces(self, n: int) -> list:
        piece = self(n)
        return [piece] if piece else []


class Into(Plain):
    """And ``readinto``, as a local file has: the parser reads into a block it reuses."""

    def readinto(self, view) -> int:
        return self.stream.readinto(view)


READERS = {"plain": Plain, "pieces": Pieces, "reusing": Reusing, "into": Into}
# What the new path is held against: the same reader, but for the one that writes its pieces again
# (the old path keeps a member's pieces until its join too: no real stream does that to it).
OLD = {"plain": "plain", "pieces": "pieces", "reusing": "plain", "into": "into"}


def parse(data: bytes, reader: str, join_later: bool, end: int | None = None, **kwargs):
    """Every sample the parser hands over (fields as (type name, bytes), read only once the parse
    is over), then its error as (type, message) or None."""
    got, error = [], None
    try:
        stream, stop = READERS[reader](data), len(data) if end is None else end
        for samples in iter_sample_dicts(stream, url="mem://x.tar", end=stop, join_later=join_later, reuse_blocks=reader == "into", **kwargs):
            got += samples
    except ShardFormatError as exc:
        error = (type(exc), str(exc))
    return [{k: (type(v).__name__, bytes(v)) if k[:2] != "__" else v for k, v in s.items()} for s in got], error


def same_but_unjoined(old, new) -> int:
    """``new`` holds what ``old`` does, an Unjoined where old has bytes (a large member read on its
    own), else the same type: the count of those."""
    assert [{k: v[1] if isinstance(v, tuple) else v for k, v in s.items()} for s in new] == [
        {k: v[1] if isinstance(v, tuple) else v for k, v in s.items()} for s in old
    ]
    unjoined = 0
    for a, b in zip(old, new):
        for k, v in a.items():
            if isinstance(v, tuple) and v[0] != b[k][0]:
                assert (v[0], b[k][0]) == ("bytes", "Unjoined"), (k, v[0], b[k][0])
                unjoined += 1
    return unjoined


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize(("large", "read_size", "large_member"), [(40 * KB, 256 * KB, 16 * KB), (MB + 100, 4 * MB, MB)])
def test_the_parser_hands_over_the_same_samples_with_large_members_unjoined(reader, large, read_size, large_member):
    data = mixed_shard(1, large)
    kwargs = {"read_size": read_size, "large_member": large_member, "keep_buffers": {"npy"}, "require_end_marker": True}
    old, old_error = parse(data, OLD[reader], False, **kwargs)
    new, new_error = parse(data, reader, True, **kwargs)
    assert old_error is None and new_error is None
    assert len(old) == 14
    assert same_but_unjoined(old, new) > 0
    assert all(s["npy"][0] == "memoryview" for s in new if "npy" in s)  # a kept buffer stays one


def _cut_inside_a_large_member(data: bytes, large: int) -> int:
    """A byte offset inside the third large member's data."""
    return data.index(b"s004.bin") + BLOCK + large // 2


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("fault", ["truncated", "stream_ends", "header_after_large", "size_beyond_end", "duplicate_key"])
def test_the_parser_raises_the_same_errors_after_the_same_samples(reader, fault):
    large = 40 * KB
    data = mixed_shard(2, large)
    end = None
    if fault == "truncated":  # the stream and the range end inside a member
        data = data[: _cut_inside_a_large_member(data, large)]
    elif fault == "stream_ends":  # the range says more than the stream holds
        end = len(data)
        data = data[: _cut_inside_a_large_member(data, large)]
    elif fault == "header_after_large":  # a corrupt header right after a large member read on its own
        at = data.index(b"s004.cls")
        data = data[:at] + b"?" + data[at + 1 :]
    elif fault == "size_beyond_end":  # a large member's size field claims more than the shard holds
        at = data.index(b"s004.bin") + 124
        data = data[:at] + b"%011o\0" % (len(data) * 2) + data[at + 12 :]
    else:
        at = data.index(b"s005.bin")
        data = data[:at] + b"s001" + data[at + 4 :]
        data = data[: at + 148] + b"%06o\0 " % (sum(data[at : at + 148]) + sum(data[at + 156 : at + BLOCK]) + 256) + data[at + 156 :]
    kwargs = {"read_size": 256 * KB, "large_member": 16 * KB, "require_end_marker": True}
    old, old_error = parse(data, OLD[reader], False, end=end, **kwargs)
    new, new_error = parse(data, reader, True, end=end, **kwargs)
    assert old_error is not None and new_error == old_error
    same_but_unjoined(old, new)  # (the samples before the fault, as many as the old path hands over)


def test_unjoined_pieces_copy_into_place_and_join():
    parts = [b"ab", memoryview(b"xcdx")[1:3], b"", b"e"]
    value = Unjoined(parts, 5)
    assert len(value) == 5 and bytes(value) == b"abcde"
    out = bytearray(7)
    value.copy_into(memoryview(out)[1:6])
    assert out == b"\0abcde\0"


def test_pieces_a_stream_may_write_again_are_copied_when_kept():
    block = bytearray(b"abcd")
    kept = tar._immutable(memoryview(block)[1:3])
    block[1:3] = b"XY"
    assert bytes(kept) == b"bc"
    whole = b"abcd"
    assert tar._immutable(whole) is whole
    view = memoryview(whole)[1:3]
    assert tar._immutable(view) is view  # a view of bytes: nothing can change it


@pytest.mark.parametrize("seed", range(4))
def test_a_block_whose_first_member_overruns_it_has_no_run(seed):
    """``_overruns`` skips the run search only where ``_plain_run`` finds none: headers of members
    that end just before, at and past the block's end, and size fields that are not all digits."""
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(60):
        blocks = int(rng.integers(2, 40))
        stop = blocks * BLOCK
        size = int(rng.integers(0, stop)) if rng.random() < 0.3 else stop - BLOCK + int(rng.integers(-2 * BLOCK, 2 * BLOCK))
        header = bytearray(member_header(f"k{size}.bin", size))
        if rng.random() < 0.2:  # a size field a writer did not write: spaces, an underscore, a sign
            header[124 + int(rng.integers(0, 11))] = int(rng.choice([32, 95, 43, 45, 56]))
        data = bytes(header) + rng.bytes(stop - BLOCK)
        if tar._overruns(data, 0, stop):
            checked += 1
            assert tar._plain_run(data, 0, stop, 1 << 30) is None
    assert checked > 10


def test_pack_joins_unjoined_fields_into_the_batch_segment_as_bytes_arrive():
    rng = np.random.default_rng(5)
    blobs = [rng.bytes(MB + 7 * i) for i in range(3)]
    pieces = [Unjoined([memoryview(b)[i : i + 100 * KB] for i in range(0, len(b), 100 * KB)], len(b)) for b in blobs]
    small = Unjoined([b"tiny"], 4)  # (smaller than a member read on its own: in shared memory all the same)
    pool = SegmentPool()
    packed, fds, dropped = pack({"bin": [pieces[0], blobs[1], pieces[2]], "other": [small]}, pool)
    assert len(pool._segments) == 4  # each field copied once, into a segment (a member read on its own, however small)
    out = Mappings(1).unpack(0, packed, [os.dup(fd) for fd in fds], dropped, False)
    assert out["bin"] == blobs and [type(b) for b in out["bin"]] == [bytes, bytes, bytes]
    assert out["other"] == [b"tiny"] and type(out["other"][0]) is bytes


# -- real workers: worker processes that hand over as stored (members joined straight into their
# segments) against thread workers (members joined into bytes, handed over as they are) ------------


def write_blobs(url: str, n: int, seed: int, storage_options=None) -> dict[str, bytes]:
    """n undecoded samples of 1 MB and up to 50 KB more (members read on their own), 3 to a shard."""
    rng = np.random.default_rng(seed)
    blobs = {f"{i:04d}": rng.bytes(MB + int(rng.integers(0, 50_000))) for i in range(n)}
    with ShardWriter(url, max_count=3, storage_options=storage_options) as w:
        for key, blob in blobs.items():
            w.write_encoded(key, {"bin": blob, "cls": b"%d" % len(blob)})
    return blobs


class RecordStored:
    """A worker_init_fn (after the loader's own start): whether this worker hands over as stored,
    and a line in a file for each member its hand-off joins in place (``Unjoined.copy_into``)."""

    def __init__(self, path):
        self.path = path

    def __call__(self, worker_id):
        from shardstream import get_worker_info

        with open(os.path.join(self.path, f"stored-{worker_id}"), "w") as f:
            f.write(str(get_worker_info().as_stored))
        copy_into = Unjoined.copy_into
        log = os.path.join(self.path, f"joined-{worker_id}")

        def counted(self, view):
            with open(log, "a") as f:
                f.write(f"{len(self)}\n")
            copy_into(self, view)

        Unjoined.copy_into = counted  # type: ignore[method-assign]  # (in this worker process only)


def recorded(path) -> list[str]:
    return [open(os.path.join(path, f"stored-{w}")).read() for w in range(2)]


def joined_in_place(path) -> int:
    """Members the workers' hand-off joined in place, so far."""
    count = 0
    for w in range(2):
        name = os.path.join(path, f"joined-{w}")
        if os.path.exists(name):
            count += len(open(name).read().split())
    return count


def batches_of(loader, stop: int | None = None):
    """Each batch's keys and fields (types checked: bytes), and the loader's state after ``stop``."""
    got, state = [], None
    for batch in loader:
        assert {type(b) for b in batch["bin"]} == {bytes}
        got.append((list(batch["__key__"]), list(batch["bin"]), list(batch["cls"])))
        if len(got) == stop:
            state = loader.state_dict()
            break
    return got, state


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_workers_hand_over_the_same_batches_and_states_with_members_joined_in_place(tmp_path, method):
    blobs = write_blobs(str(tmp_path / "b"), 14, seed=1)

    def loader(new: bool):
        ds = ShardStream(str(tmp_path / "b"), batch_size=2, seed=5, decode=False, world=World(0, 1))
        kwargs = {"worker_init_fn": RecordStored(str(tmp_path)), "workers": "processes"} if new else {"workers": "threads"}
        return make_loader(ds, num_workers=2, start_method=method, log_interval=None, pin_memory=False, **kwargs)

    new_loader = loader(True)
    new, new_state = batches_of(new_loader, stop=3)
    assert recorded(tmp_path) == ["True", "True"]  # this loader's workers took the new path
    assert joined_in_place(tmp_path) >= 6  # (3 batches of 2, and those its workers made ahead)
    old, old_state = batches_of(loader(False), stop=3)
    assert new == old and new_state == old_state
    assert all(b == blobs[k] for keys, bins, _ in new for k, b in zip(keys, bins))
    rest_new, _ = batches_of(new_loader)  # the next pass of the same workers, whole
    assert sorted(k for keys, _, _ in rest_new for k in keys) == sorted(blobs)
    resumed = []
    for new_path in (True, False):  # the rest of the cut pass, from its state, by both paths
        again = loader(new_path)
        again.load_state_dict(new_state)
        resumed.append(batches_of(again)[0])
    assert resumed[0] == resumed[1]
    assert sorted(k for keys, _, _ in new + resumed[0] for k in keys) == sorted(blobs)


def test_only_batches_of_samples_as_stored_take_the_new_path(tmp_path):
    write_blobs(str(tmp_path / "b"), 4, seed=2)
    url = str(tmp_path / "b")

    def as_stored(**kwargs) -> bool:
        return ShardStream(url, batch_size=2, shuffle=False, world=World(0, 1), **{"decode": False, **kwargs}).as_stored

    assert as_stored()
    assert not as_stored(decode=True)
    assert not as_stored(decode={"bin": bytes})
    assert not as_stored(transform=_identity)
    # and in a real worker of a loader whose dataset decodes, or with a collate_fn: the flag is off, the bytes as ever
    for decode, collate in (({"cls": int}, None), (False, _identity)):
        ds = ShardStream(url, batch_size=2, shuffle=False, decode=decode, world=World(0, 1))
        kwargs = {"collate_fn": collate, "worker_init_fn": RecordStored(str(tmp_path))}
        loader = make_loader(ds, num_workers=2, workers="processes", log_interval=None, **kwargs)
        assert sum(len(b["__key__"]) for b in loader) == 4
        assert recorded(tmp_path) == ["False", "False"] and joined_in_place(tmp_path) == 0


def _identity(x):
    return x


def corrupt_third_shard(root) -> str:
    """Flip a byte of the header right after the first large member of the third shard: its name
    changes, its checksum no longer matches. The shard's name."""
    shard = sorted(p for p in os.listdir(root) if p.endswith(".tar"))[2]
    path = os.path.join(root, shard)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    at = data.index(b".cls", data.index(b".bin")) - 4
    data[at] ^= 0x20
    with open(path, "wb") as f:
        f.write(bytes(data))
    return shard


def test_a_corrupt_shard_fails_the_same_way_after_the_same_batches(tmp_path):
    write_blobs(str(tmp_path / "b"), 12, seed=3)
    shard = corrupt_third_shard(str(tmp_path / "b"))
    outcomes = []
    for kwargs in ({"workers": "processes"}, {"workers": "threads"}):
        ds = ShardStream(str(tmp_path / "b"), batch_size=2, shuffle=False, decode=False, world=World(0, 1))
        got = []
        with pytest.raises(ShardFormatError) as info:
            for batch in make_loader(ds, num_workers=2, log_interval=None, **kwargs):
                got.append((list(batch["__key__"]), list(batch["bin"])))
        lines = str(info.value).strip().splitlines()  # the worker that raised, ..., the error
        outcomes.append((got, lines[0], lines[-1]))
    assert outcomes[0] == outcomes[1]
    assert "checksum" in outcomes[0][2] and shard in outcomes[0][2]


def test_skipped_samples_and_the_repeats_that_fill_their_batches_are_the_same(tmp_path):
    """Under on_error="skip" a corrupt range's samples are dropped and the last batches filled by
    repeating recent samples (the same member object twice in a batch): both paths alike."""
    blobs = write_blobs(str(tmp_path / "b"), 12, seed=6)
    corrupt_third_shard(str(tmp_path / "b"))
    runs = []
    for kwargs in ({"worker_init_fn": RecordStored(str(tmp_path)), "workers": "processes"}, {"workers": "threads"}):
        ds = ShardStream(str(tmp_path / "b"), batch_size=2, seed=2, decode=False, on_error="skip", world=World(0, 1))
        loader = make_loader(ds, num_workers=2, log_interval=None, pin_memory=False, **kwargs)
        runs.append(batches_of(loader)[0])
    assert runs[0] == runs[1] and joined_in_place(tmp_path) > 0
    keys = [k for keys, _, _ in runs[0] for k in keys]
    assert len(keys) == 12 and len(set(keys)) < 12  # some skipped, some repeated
    assert all(b == blobs[k] for keys, bins, _ in runs[0] for k, b in zip(keys, bins))


def test_a_mix_of_two_sources_hands_over_the_same_batches(tmp_path):
    from shardstream import Source

    a = write_blobs(str(tmp_path / "a"), 9, seed=7)
    b = write_blobs(str(tmp_path / "b"), 6, seed=8)
    runs = []
    for kwargs in ({"worker_init_fn": RecordStored(str(tmp_path)), "workers": "processes"}, {"workers": "threads"}):
        sources = [Source(str(tmp_path / "a"), weight=0.6, name="a"), Source(str(tmp_path / "b"), weight=0.4, name="b")]
        ds = ShardStream(sources, batch_size=2, seed=3, decode=False, world=World(0, 1))
        loader = make_loader(ds, num_workers=2, log_interval=None, pin_memory=False, **kwargs)
        runs.append(batches_of(loader, stop=4))
    assert runs[0] == runs[1] and joined_in_place(tmp_path) > 0
    assert recorded(tmp_path) == ["True", "True"]
    for keys, bins, cls in runs[0][0]:
        for k, blob, c in zip(keys, bins, cls):
            assert blob in (a.get(k), b.get(k)) and int(c) == len(blob)


@pytest.mark.parametrize("cut", [None, "rst"])
def test_s3_workers_hand_over_the_same_batches_a_body_cut_mid_member_included(s3, cut, tmp_path):
    """On S3 (moto) with read-ahead (obstore's pieces kept), every GET body cut after 700 KB when
    ``cut``: the members resumed mid-body arrive whole, by both paths, in the same batches."""
    from faultproxy import FaultProxy

    from shardstream.storage.config import StorageConfig

    bucket, options, _ = s3
    url = f"s3://{bucket}/joined"
    blobs = write_blobs(url, 8, seed=4, storage_options=options)
    config = StorageConfig(backoff_base=0.001, backoff_cap=0.01)
    runs = []
    with FaultProxy(options["endpoint_url"], reset_after=700_000 if cut else None, cut=cut or "rst") as proxy:
        for kwargs in ({"worker_init_fn": RecordStored(str(tmp_path)), "workers": "processes"}, {"workers": "threads"}):
            store = Store(options={"endpoint_url": proxy.url}, config=config, read=Read(readahead_bytes=8 << 20))
            ds = ShardStream(url, batch_size=2, seed=1, decode=False, world=World(0, 1), store=store)
            loader = make_loader(ds, num_workers=2, log_interval=None, pin_memory=False, **kwargs)
            got, state = batches_of(loader, stop=2)
            rest, _ = batches_of(loader)
            runs.append((got, state, rest))
            runs.append(joined_in_place(tmp_path))
    new, joined_new, old, joined_old = runs
    assert joined_new >= 8 + 4 and joined_old == joined_new  # the new loader's (2 batches, then a pass), none by the old
    assert new == old
    got, _, rest = new
    assert {k: b for keys, bins, _ in rest for k, b in zip(keys, bins)} == blobs  # (a whole pass after the cut one)
    assert all(b == blobs[k] for keys, bins, _ in got for k, b in zip(keys, bins))
    if cut:
        assert proxy.counts["resets"] > 0
    if cut:
        assert proxy.counts["resets"] > 0


def test_small_samples_come_through_as_ever_under_the_new_path(tmp_path):
    """Small members are never read on their own: the flag is on, nothing reaches the hand-off unjoined."""
    url = write_dataset(tmp_path / "s", 12, max_count=5)
    ds = ShardStream(url, batch_size=3, shuffle=False, decode=False, world=World(0, 1))
    assert ds.as_stored
    loader = make_loader(ds, num_workers=2, workers="processes", log_interval=None)
    assert sum(len(b["__key__"]) for b in loader) == 12
