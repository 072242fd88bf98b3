"""Member sidecars: where every member of every sample lies, so a reader slices them without
parsing a tar header, whoever wrote the shard (webdataset, img2dataset, GNU tar, bsdtar, tarfile).

``shardstream index`` parses each shard once (``format.scan``); ``MemberRecorder`` sees the same
bytes and, for each sample the parser gives, walks its span's headers (pax headers, GNU long names
and all) to find where each field's data starts, checks that those bytes are the parser's value,
and records it. A shard where anything is unusual (a sparse member, a directory or metadata
member inside a sample, a member of ``LARGE_MEMBER`` bytes or more) gets no member sidecar and is
read by the parser as before: the sidecar only ever says what the parser itself found.
``pack`` writes the same sidecar for the shards it writes (``sidecar.MemberLog``: it knows each
member's header and data start as it writes them), with no parsing.

Layout (``SHARD.members`` beside the offset sidecar; all little-endian):

    bytes 0..72     magic ``b"SSMEMB\\x00\\x01"``, uint64 shard size, uint64 samples n, uint64
                    members m, uint32 extension-name bytes, uint32 key bytes, 32 bytes: the shard's
                    sha256 as the manifest has it (zeros for none)
    then            uint64[n + 1] sample offsets (as the offset sidecar), uint64[n + 1] each
                    sample's first member, uint64[m] member data starts, uint64[m] header
                    fingerprints, uint32[m] member sizes, uint16[m] extension numbers, the
                    extension names and the keys (UTF-8, NUL-separated)
    last 32 bytes   sha256 of everything before them

Its size is in the manifest (``shards.members``), so it is read in one ranged GET with no HEAD,
once per process (``MEMBER_CACHE``); it holds the sample offsets too, so a range inside a shard
needs no offset sidecar besides. Loading checks the digest, the magic, the counts and the shard's
size and sha256 against the manifest: a sidecar truncated, overwritten or left from another
indexing of the shard is one ManifestError naming the shard. Reading (``iter_member_dicts``)
checks every member's header against its fingerprint, all of a block's at once with numpy (as the
parser checks every header's checksum): a shard rewritten after it was indexed is a
ShardFormatError naming the shard and the byte, before any of that block's samples go out.
"""

from __future__ import annotations

import hashlib
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shardstream.errors import ManifestError, ShardFormatError
from shardstream.format.offsets import SUFFIX, OffsetCache
from shardstream.format.tar import (
    BLOCK,
    DEFAULT_READ_SIZE,
    LARGE_MEMBER,
    MAX_SPREAD,
    PARSE_WINDOW,
    _parse_pax,
    _parse_size,
    _pax_int,
    _sparse_pax,
)
from shardstream.sidecar import MEMBERS_HEADER, MEMBERS_MAGIC, MEMBERS_SUFFIX, WEIGHTS, encode_member_table

MAGIC, HEADER, MEMBERS_SUFFIX = MEMBERS_MAGIC, MEMBERS_HEADER, MEMBERS_SUFFIX
DIGEST = 32
# A header's fingerprint (``sidecar.WEIGHTS``): its 64 words times odd constants, summed modulo
# 2**64. Any change to one word changes it; the indexed header was checked (checksum, name) by the parser.
_WEIGHTS = np.array(WEIGHTS, dtype=np.uint64)
_FLUSH = 4096  # headers fingerprinted at once while indexing
REBUILD = "re-pack the dataset; for shards written elsewhere, re-run `shardstream index`"  # what a sidecar or shard that do not match needs


def fingerprints(rows: np.ndarray) -> np.ndarray:
    """uint64 fingerprints of 512-byte headers given as rows of 64 uint64 words.

    A matrix-vector product (integer arithmetic, wrapping modulo 2**64 as the sum of products
    does) rather than ``(rows * _WEIGHTS).sum(axis=1)``: the same values with no temporary the
    size of the headers, which a reader computes for every member it slices."""
    return np.matmul(rows, _WEIGHTS)


def members_path(sidecar: str) -> str:
    """The member sidecar's path beside an offset sidecar's (``x.tar.idx`` -> ``x.tar.members``)."""
    return (sidecar[: -len(SUFFIX)] if sidecar.endswith(SUFFIX) else sidecar) + MEMBERS_SUFFIX


class MemberTable:
    """A decoded member sidecar: ``offsets`` (n + 1 int64), ``firsts`` (n + 1: sample i's members
    are ``firsts[i]:firsts[i + 1]``), ``starts`` (int64 data starts), ``sizes``, ``fps``, ``exts``
    (the extension of each member, a list of str), ``keys`` (a list of str) and, when every sample
    has the same fields in the same order, ``uniform`` (those extensions)."""

    __slots__ = ("offsets", "firsts", "starts", "sizes", "fps", "exts", "keys", "uniform", "spread", "nbytes")

    def __init__(self, offsets, firsts, starts, sizes, fps, ext_ids, names: list[str], keys: list[str]):
        self.offsets, self.firsts, self.starts, self.sizes, self.fps = offsets, firsts, starts, sizes, fps
        self.exts = [names[i] for i in ext_ids.tolist()]
        self.keys = keys
        self.uniform: tuple[str, ...] | None = None
        counts = np.diff(firsts)
        if len(counts) and int(counts.min()) == int(counts.max()) > 0:
            m = int(counts[0])
            pattern = ext_ids[:m]
            if bool((ext_ids.reshape(-1, m) == pattern).all()):
                self.uniform = tuple(self.exts[:m])
        span = int(offsets[-1] - offsets[0]) if len(offsets) else 0
        own = int((BLOCK + (sizes.astype(np.int64) + BLOCK - 1) // BLOCK * BLOCK).sum())  # a plain tar's bytes for these members
        self.spread = min(MAX_SPREAD, span / own) if own else 1.0
        self.nbytes = offsets.nbytes + firsts.nbytes + starts.nbytes + sizes.nbytes + fps.nbytes + 64 * (len(keys) + len(self.exts))


def decode_members(data: bytes, url: str, shard: str, samples: int, size: int, sha256: str | None, expected_bytes: int) -> MemberTable:
    """Parse and check a member sidecar ``url`` of shard ``shard``; ManifestError naming both."""

    def bad(what: str) -> ManifestError:
        return ManifestError(f"{shard}: its member sidecar {url} {what}; {REBUILD}")

    if len(data) != expected_bytes:
        return _raise(bad(f"is {len(data)} bytes, the manifest says {expected_bytes} (truncated or overwritten)"))
    if len(data) < HEADER.size + DIGEST or hashlib.sha256(memoryview(data)[:-DIGEST]).digest() != data[-DIGEST:]:
        return _raise(bad("does not match its own digest (corrupt or overwritten)"))
    magic, shard_size, n, m, ext_len, key_len, sha = HEADER.unpack_from(data)
    if magic != MAGIC:
        return _raise(bad(f"is not a shardstream member sidecar (bad magic {magic!r})"))
    if n != samples or shard_size != size or sha != (bytes.fromhex(sha256) if sha256 else bytes(32)):
        return _raise(bad(f"describes a shard of {n} samples and {shard_size} bytes (or another sha256), the manifest one of {samples} and {size}"))
    if len(data) != HEADER.size + 16 * (n + 1) + 22 * m + ext_len + key_len + DIGEST:
        return _raise(bad("has the wrong length for its counts"))
    pos = HEADER.size

    def take(dtype: str, count: int) -> np.ndarray:
        nonlocal pos
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=pos)
        pos += arr.nbytes
        return arr

    offsets, firsts, starts, fps = take("<u8", n + 1), take("<u8", n + 1), take("<u8", m), take("<u8", m)
    sizes, ext_ids = take("<u4", m), take("<u2", m)
    try:
        names = data[pos : pos + ext_len].decode("utf-8").split("\0")
        keys = data[pos + ext_len : pos + ext_len + key_len].decode("utf-8").split("\0") if n else []
    except UnicodeDecodeError:
        return _raise(bad("holds names that are not UTF-8"))
    if len(keys) != n or (m and int(ext_ids.max()) >= len(names)):
        return _raise(bad("holds the wrong number of keys or extension names"))
    starts64 = starts.astype(np.int64)
    offsets64 = offsets.astype(np.int64)
    ok = (
        int(firsts[0]) == 0
        and int(firsts[-1]) == m
        and bool(np.all(firsts[1:] >= firsts[:-1]))
        and bool(np.all(offsets[1:] > offsets[:-1]))
        and bool(np.all(offsets < np.uint64(1 << 62)))
        and bool(np.all(starts < np.uint64(1 << 62)))
    )
    if ok and m:
        owner = np.repeat(np.arange(n), np.diff(firsts).astype(np.int64))  # each member's sample
        ends = starts64 + sizes.astype(np.int64)
        ok = (
            bool(np.all(starts64 % BLOCK == 0))
            and bool(np.all(starts64 - BLOCK >= offsets64[owner]))
            and bool(np.all(ends <= offsets64[owner + 1]))
            and bool(np.all(starts64[1:] >= ends[:-1]))
            and bool(np.all(sizes < LARGE_MEMBER))
        )
    if not ok:
        return _raise(bad("holds offsets outside their samples (corrupt)"))
    return MemberTable(offsets64, firsts.astype(np.int64), starts64, sizes.astype(np.int64), fps.copy(), ext_ids, names, keys)


def _raise(exc: Exception) -> Any:
    raise exc


MEMBER_CACHE: OffsetCache[MemberTable] = OffsetCache()


# -- indexing -----------------------------------------------------------------------------------


class MemberRecorder:
    """``read(n)`` passed through to the parser, keeping the bytes until ``sample`` has seen the
    sample they hold; ``sample(key, offset, end, fields)`` records where its fields' data lie.
    ``encoded(offsets, size, sha256)``: the sidecar, or None where the shard is not one a reader
    may slice (``reason`` says why)."""

    def __init__(self, read: Callable[[int], bytes], url: str):
        self._read, self.url = read, url
        self._chunks: list[tuple[int, Any]] = []  # (absolute start, bytes) not yet consumed
        self._fetched = 0
        self.reason: str | None = None
        self._firsts = [0]
        self._starts: list[int] = []
        self._sizes: list[int] = []
        self._ext_ids: list[int] = []
        self._names: dict[str, int] = {}
        self._keys: list[str] = []
        self._headers: list[bytes] = []
        self._fps: list[np.ndarray] = []

    def __call__(self, n: int) -> bytes:
        data = self._read(n)
        if data and self.reason is None:
            self._chunks.append((self._fetched, data))
        self._fetched += len(data)
        return data

    def _span(self, a: int, b: int) -> bytes:
        parts = []
        keep = 0
        for i, (at, data) in enumerate(self._chunks):
            stop = at + len(data)
            if stop <= a:
                keep = i + 1
                continue
            if at >= b:
                break
            parts.append(memoryview(data)[max(0, a - at) : min(len(data), b - at)])
        del self._chunks[:keep]
        return b"".join(parts)

    def _give_up(self, why: str) -> None:
        self.reason = why
        self._chunks.clear()

    def sample(self, key: str, offset: int, end: int, fields: dict[str, Any]) -> None:
        if self.reason is not None:
            return
        raw = self._span(offset, end)
        if len(raw) != end - offset:
            return self._give_up("its bytes were not all seen")
        found: list[tuple[int, int, bytes]] = []
        pos = 0
        pax_size: int | None = None
        while pos < len(raw):
            header = raw[pos : pos + BLOCK]
            if len(header) < BLOCK:
                return self._give_up("a sample ends inside a header")
            size = _parse_size(header[124:136], self.url, offset + pos)
            kind = header[156]
            if kind == 120:  # 'x': a pax header for the next member
                pax = _parse_pax(raw[pos + BLOCK : pos + BLOCK + size], self.url, offset + pos)
                if _sparse_pax(pax):
                    return self._give_up("a sparse member")
                pax_size = _pax_int(pax, "size", self.url, offset + pos) if "size" in pax else None
            elif kind in (76, 75, 103):  # 'L', 'K' (GNU long names), 'g' (global pax)
                pax_size = None
            elif kind in (48, 0, 55):  # regular files
                if pax_size is not None:
                    size = pax_size
                found.append((pos + BLOCK, size, header))
                pax_size = None
            else:
                return self._give_up(f"a member of type {chr(kind)!r} inside sample {key!r}")
            pos += BLOCK + (size + BLOCK - 1) // BLOCK * BLOCK
        values = list(fields.items())
        if len(found) != len(values):
            return self._give_up(f"sample {key!r} holds members that are not its fields")
        for (ext, value), (start, size, header) in zip(values, found):
            if size >= LARGE_MEMBER or len(value) != size or raw[start : start + size] != value:
                return self._give_up(f"a field of sample {key!r} is not the bytes after its header (or is large)")
            self._starts.append(offset + start)
            self._sizes.append(size)
            self._ext_ids.append(self._names.setdefault(ext, len(self._names)))
            self._headers.append(header)
        self._keys.append(key)
        self._firsts.append(len(self._starts))
        if len(self._headers) >= _FLUSH:
            self._flush()

    def _flush(self) -> None:
        if self._headers:
            rows = np.frombuffer(b"".join(self._headers), dtype="<u8").reshape(-1, BLOCK // 8)
            self._fps.append(fingerprints(rows))
            self._headers = []

    def encoded(self, offsets: list[int], size: int, sha256: str | None) -> bytes | None:
        if self.reason is None and (not self._keys or len(offsets) != len(self._keys) + 1):
            self.reason = "no samples"
        if self.reason is not None:
            return None
        self._flush()
        names = [name for name, _ in sorted(self._names.items(), key=lambda kv: kv[1])]
        fps = np.concatenate(self._fps) if self._fps else np.zeros(0, np.uint64)
        return encode_member_table(offsets, self._firsts, self._starts, self._sizes, fps.tolist(), self._ext_ids, names, self._keys, size, sha256)


# -- reading ------------------------------------------------------------------------------------

_ARENAS = threading.local()  # the reused block of the last slicing this thread finished


def iter_member_dicts(
    read: Callable[[int], bytes],
    table: MemberTable,
    first: int,
    stop: int,
    *,
    url: str,
    read_size: int = DEFAULT_READ_SIZE,
    reuse_blocks: bool = False,
    arena: bytearray | None = None,
) -> Iterator[list[dict[str, Any]]]:
    """Samples ``first:stop`` of a shard as the parser's dicts (fields in member order, then
    ``__key__`` and ``__url__``), sliced at the table's member offsets from ``read`` (positioned at
    sample ``first``'s offset). A list per read block, or per ``PARSE_WINDOW`` of it (larger by the
    table's spread, as the parser's lists are). Every member's header is checked against its
    fingerprint before the block's samples go out; a mismatch or a stream that ends early is a
    ShardFormatError naming ``url`` and the byte."""
    offsets = table.offsets
    bounds = offsets.tolist()  # python ints for bisect
    firsts = table.firsts
    base = bounds[first]
    end = bounds[stop]
    spread = table.spread
    block_size = int(read_size * spread)
    window = int(PARSE_WINDOW * spread)
    readinto = getattr(read, "readinto", None)
    use_arena = reuse_blocks and readinto is not None
    if use_arena and arena is None:
        arena = _ARENAS.__dict__.pop("block", None) or bytearray()  # this thread's last one, as the parser's
    buf: Any = b""
    filled = 0
    bufbase = base  # absolute offset of buf[0]
    fetched = base
    s = first
    keys, exts, uniform = table.keys, table.exts, table.uniform
    while s < stop:
        keep = bufbase + filled - bounds[s]  # the tail from sample s on
        need = bounds[s + 1] - fetched  # at least sample s whole
        want = min(max(block_size, need), end - fetched)
        if use_arena:
            assert arena is not None
            total = keep + want
            tail = bytes(memoryview(buf)[filled - keep : filled]) if keep else b""  # (a few KiB: copied, the block may be buf)
            if len(arena) < total:
                arena = bytearray(-(-total // (64 << 10)) * (64 << 10))
            arena[:keep] = tail
            into = memoryview(arena)
            got = keep
            while got < total:
                n = readinto(into[got:total])  # type: ignore[misc]
                if not n:
                    raise ShardFormatError(url, fetched, f"stream ended at byte {fetched}, expected {end} (truncated shard)")
                got += n
                fetched += n
            buf, filled = arena, total
        else:
            parts: list[Any] = [memoryview(buf)[filled - keep : filled]] if keep else []
            got = 0
            while got < need:  # up to ``want``, but on once sample s is whole: a first read may be small (``_FirstReadsSmall``)
                chunk = read(want - got)
                if not chunk:
                    raise ShardFormatError(url, fetched, f"stream ended at byte {fetched}, expected {end} (truncated shard)")
                fetched += len(chunk)
                got += len(chunk)
                parts.append(chunk)
            buf = parts[0] if len(parts) == 1 and type(parts[0]) in (bytes, bytearray) else b"".join(parts)
            filled = len(buf)
        bufbase = fetched - filled
        done = min(stop, bisect_right(bounds, fetched, s, stop + 1) - 1)  # samples s:done are all here
        view = memoryview(buf)
        words = np.frombuffer(buf, dtype="<u8", count=filled // BLOCK * (BLOCK // 8)).reshape(-1, BLOCK // 8)
        copy = type(buf) is not bytes  # fields out of a reused or writable block: copied as bytes
        while s < done:
            w = max(s + 1, bisect_right(bounds, bounds[s] + window, s + 1, done + 1) - 1)  # this list: samples s:w
            m0, m1 = int(firsts[s]), int(firsts[w])
            rel = table.starts[m0:m1] - bufbase
            at = (rel >> 9) - 1
            got_fps = fingerprints(words.take(at, axis=0))
            if not np.array_equal(got_fps, table.fps[m0:m1]):
                bad = int(np.argmax(got_fps != table.fps[m0:m1]))
                raise ShardFormatError(
                    url,
                    bufbase + int(at[bad]) * BLOCK,
                    "this member's header is not the one its member sidecar records (a corrupt shard, or one changed "
                    f"since it was packed or indexed); {REBUILD}",
                )
            a_list = rel.tolist()
            b_list = (rel + table.sizes[m0:m1]).tolist()
            if copy:
                datas = [view[a:b].tobytes() for a, b in zip(a_list, b_list)]
            else:
                datas = [buf[a:b] for a, b in zip(a_list, b_list)]
            out: list[dict[str, Any]]
            ks = keys[s:w]
            if uniform is not None:
                m = len(uniform)
                if m == 1:
                    (e0,) = uniform
                    out = [{e0: a, "__key__": k, "__url__": url} for k, a in zip(ks, datas)]
                elif m == 2:
                    e0, e1 = uniform
                    out = [{e0: a, e1: b, "__key__": k, "__url__": url} for k, a, b in zip(ks, datas[0::2], datas[1::2])]
                else:
                    out = [dict(zip(uniform, datas[j * m : j * m + m]), __key__=k, __url__=url) for j, k in enumerate(ks)]
            else:
                cuts = (firsts[s : w + 1] - m0).tolist()
                names = exts[m0:m1]
                out = [dict(zip(names[cuts[j] : cuts[j + 1]], datas[cuts[j] : cuts[j + 1]]), __key__=k, __url__=url) for j, k in enumerate(ks)]
            s = w
            yield out
        del view
    if use_arena:
        _ARENAS.block = arena
