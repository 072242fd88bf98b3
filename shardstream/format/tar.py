"""The tar format, both ways: deterministic headers for writing, a fast checked parser for reading.

Writing (``shardstream.ustar``, its names here too): ``member_header(name, size)`` builds a ustar header with fixed mode, owner and mtime, so
the same input always packs to the same bytes; names that do not fit ustar fall back to a pax
header, which webdataset and GNU tar read.

Reading: ``iter_sample_batches`` parses 512-byte headers straight out of large buffered reads
(no ``tarfile`` per member), validates checksums a buffer at a time with numpy, follows GNU long
names and pax headers, never trusts a size field beyond the bytes that are really there, and
groups members into samples by key, as webdataset does, in the same pass. Runs of plain members
(what writers make, each maybe after a pax header of harmless records, as webdataset's TarWriter
and GNU tar's and bsdtar's pax formats write before every member) are found a block at a time
with numpy (``_plain_run``) and grouped into samples with list operations (``_plain_samples``);
everything else goes through the member by member loop, which has every check; both give the
same samples and errors (tests/test_tarplain.py). A member's pax or long-name headers and the
member itself always land in the same list. Read into one reused block (a local file), members
behind pax headers are read (and listed) in blocks larger by those headers' share (``MAX_SPREAD``),
so that a block holds about as many samples as a plain tar's.

Record shapes:
    iter_sample_batches -> [(key: str, offset: int, end: int, fields: {ext: bytes}), ...]  a list per read
                           block, or per PARSE_WINDOW bytes of it;
                           offset = the sample's first header (long-name/pax included),
                           end = after the padding of its last member
    iter_sample_dicts   -> [{ext: bytes, ..., "__key__": key, "__url__": url}, ...]        the same lists, each
                           sample the dict the pipeline passes on, built once
    iter_samples        -> (key, offset, end, fields)                                     flattened
"""

from __future__ import annotations

import re
import threading
from bisect import bisect_left
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any

import numpy as np

from shardstream.buffers import BufferPool
from shardstream.errors import ShardFormatError
from shardstream.ustar import BLOCK as BLOCK
from shardstream.ustar import END_OF_ARCHIVE as END_OF_ARCHIVE
from shardstream.ustar import MAX_OCTAL_SIZE as MAX_OCTAL_SIZE
from shardstream.ustar import member_header as member_header  # (the writing half, in a module of its own)
from shardstream.ustar import padding as padding

ZERO_BLOCK = bytes(BLOCK)
DEFAULT_READ_SIZE = 4 << 20
# A member at least this large that is not all in the current read block gets a buffer of its own,
# filled straight from the stream (``readinto``): its bytes are copied once, not read into a block,
# joined and cut out again. After one, reads restart at AFTER_LARGE_READ bytes and double back up
# to read_size, so little of the next large member lands in a shared block.
LARGE_MEMBER = 1 << 20
# Samples are handed on in lists of the members that start within this many bytes of a read block
# (a block of 4 MiB, as S3 reads give, is 8 lists): the stages after the parser (decode, the user's
# function, collate) then work on samples whose bytes are still in the CPU's caches. On this VM,
# 1 KiB samples through a user function and default_collate cost 8.2 us each with lists (and local
# reads) of 512 KiB, 8.5 with 256 KiB, 9.0 with 96 KiB and 10.1 with 1 MiB.
PARSE_WINDOW = 512 << 10
AFTER_LARGE_READ = 64 << 10
# A local read (into one reused block) of members behind pax headers is larger by the share of
# the block those headers and their payloads take, up to this factor: webdataset's small samples
# (a pax header and its payload before each member: 9 blocks a sample where a plain tar has 5)
# are read 1.8x larger, so that the fixed cost of a block (the run path's numpy calls, a list)
# is spread over as many samples as in a plain tar.
MAX_SPREAD = 2.0
# The reused block grows in steps of this many bytes: a block read of read_size plus the unparsed
# tail of the one before (a few KiB, different every time) then fits the block it grew to,
# instead of allocating (and zeroing, and faulting in) a new one whenever a tail is longer than
# every one before it.
ARENA_STEP = 64 << 10


# webdataset's split (tariterators.base_plus_ext). The fast path below gives the same answer
# for every name whose last component has a dot after its first character; the regex decides
# the rest (a last component starting with a dot: ``dir/.hidden.txt`` is key ``dir/``).
_WDS_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def split_name(name: str) -> tuple[str | None, str | None]:
    """Split a member name into (key, extension) the way webdataset does.

    The key is everything up to the first dot of the last path component; the extension is the
    rest, lower-cased. A last component that starts with a dot follows webdataset's regex
    (``dir/.x.txt`` -> ``("dir/", "x.txt")``, ``.x.txt`` -> no key); names without a dot in
    their last component have no key. ``is_meta_name`` members are not samples either.
    """
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot > slash + 1:
        return name[:dot], name[dot + 1 :].lower()
    if dot == slash + 1:
        match = _WDS_NAME.match(name)
        if match is not None:
            return match.group(1), match.group(2).lower()
    return None, None


def _parse_size(field: bytes, url: str, offset: int) -> int:
    if field[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB
        if field[0] != 0x80:
            raise ShardFormatError(url, offset, "negative or malformed base-256 size field")
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ShardFormatError(url, offset, f"size field is not octal: {bytes(field)!r}") from None  # bytes, read into a reused block or not


def _parse_pax(data: bytes, url: str, offset: int) -> dict[str, str]:
    """Records of a pax extended header. GNU sparse 0.0 repeats ``GNU.sparse.offset`` and
    ``GNU.sparse.numbytes`` once per chunk: those are folded, in order, into ``GNU.sparse.map``
    (the 0.1 spelling: "offset,numbytes,offset,numbytes...")."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        if data[pos] == 0:
            break
        space = data.find(b" ", pos)
        if space < 0:
            raise ShardFormatError(url, offset, "malformed pax record")
        try:
            length = int(data[pos:space])
        except ValueError:
            raise ShardFormatError(url, offset, "malformed pax record length") from None
        if length <= space - pos or pos + length > len(data):
            raise ShardFormatError(url, offset, "pax record length out of range")
        record = data[space + 1 : pos + length - 1]
        key, sep, value = record.partition(b"=")
        if not sep:
            raise ShardFormatError(url, offset, "pax record without '='")
        name = key.decode("utf-8", "replace")
        text = value.decode("utf-8", "surrogateescape")
        if name in ("GNU.sparse.offset", "GNU.sparse.numbytes"):
            previous = records.get("GNU.sparse.map")
            records["GNU.sparse.map"] = text if previous is None else previous + "," + text
        else:
            records[name] = text
        pos += length
    return records


def _pax_int(pax: dict[str, str], key: str, url: str, offset: int) -> int:
    try:
        value = int(pax[key])
    except ValueError:
        raise ShardFormatError(url, offset, f"pax record {key}={pax[key]!r} is not a number") from None
    if value < 0:
        raise ShardFormatError(url, offset, f"pax record {key}={value} is negative")
    return value


MAX_SPARSE_SIZE = 1 << 32  # a sparse member expanding past this is refused rather than allocated


def _expand_sparse(data: bytes, chunks: list[int], real_size: int, url: str, offset: int, name: str) -> bytes:
    """The full contents of a sparse member: ``chunks`` = [offset, length, ...] of the stored
    ``data``, in order; the holes between them are zeros. Maps that do not fit are refused."""
    if real_size > MAX_SPARSE_SIZE:
        raise ShardFormatError(url, offset, f"sparse member {name!r} expands to {real_size} bytes; refusing more than {MAX_SPARSE_SIZE}")
    if len(chunks) % 2:
        raise ShardFormatError(url, offset, f"sparse member {name!r} has an odd-length sparse map")
    out = bytearray(real_size)
    stored = 0
    previous_end = 0
    for i in range(0, len(chunks), 2):
        where, length = chunks[i], chunks[i + 1]
        if where < previous_end or where + length > real_size or stored + length > len(data):
            raise ShardFormatError(url, offset, f"sparse member {name!r}: map entry ({where}, {length}) does not fit its data")
        out[where : where + length] = data[stored : stored + length]
        stored += length
        previous_end = where + length
    if stored != len(data):
        raise ShardFormatError(url, offset, f"sparse member {name!r}: map covers {stored} of {len(data)} stored bytes")
    return bytes(out)


def _sparse_numbers(text: str, url: str, offset: int, name: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v != ""]
    except ValueError:
        raise ShardFormatError(url, offset, f"sparse member {name!r}: malformed sparse map") from None


def _pax_sparse(pax: dict[str, str], data: bytes, name: str, url: str, offset: int) -> tuple[str, bytes]:
    """(name, contents) of a GNU tar pax sparse member: formats 0.0 and 0.1 (map in the pax
    records) and 1.0 (map in decimal lines at the start of the data, padded to a block)."""
    name = pax.get("GNU.sparse.name", name)
    size_key = "GNU.sparse.realsize" if "GNU.sparse.realsize" in pax else "GNU.sparse.size"
    if size_key not in pax:
        raise ShardFormatError(url, offset, f"sparse member {name!r} has no real size record")
    real_size = _pax_int(pax, size_key, url, offset)
    if pax.get("GNU.sparse.major") == "1":
        if pax.get("GNU.sparse.minor", "0") != "0":
            raise ShardFormatError(url, offset, f"sparse member {name!r}: GNU sparse format 1.{pax['GNU.sparse.minor']} is not supported")
        lines = data.split(b"\n")
        try:
            count = int(lines[0])
            numbers = [int(v) for v in lines[1 : 1 + 2 * count]]
        except ValueError:
            raise ShardFormatError(url, offset, f"sparse member {name!r}: malformed sparse map") from None
        if len(numbers) != 2 * count:
            raise ShardFormatError(url, offset, f"sparse member {name!r}: sparse map shorter than its {count} entries")
        map_len = sum(len(v) + 1 for v in lines[: 1 + 2 * count])
        map_len += -map_len % BLOCK
        return name, _expand_sparse(data[map_len:], numbers, real_size, url, offset, name)
    if "GNU.sparse.map" not in pax:
        raise ShardFormatError(url, offset, f"sparse member {name!r} has no sparse map")
    return name, _expand_sparse(data, _sparse_numbers(pax["GNU.sparse.map"], url, offset, name), real_size, url, offset, name)


def _old_gnu_sparse(header: bytes, data: bytes, name: str, url: str, offset: int) -> tuple[str, bytes]:
    """Contents of an old GNU sparse ('S') member whose map fits in its header (4 entries)."""
    if header[482]:
        raise ShardFormatError(
            url, offset, f"old GNU sparse member {name!r} with more than 4 chunks is not supported; repack it without --sparse or with --format=pax"
        )
    numbers = []
    for i in range(4):
        entry = header[386 + 24 * i : 386 + 24 * (i + 1)]
        if entry[0] == 0:
            break
        numbers += [_parse_size(entry[:12], url, offset), _parse_size(entry[12:], url, offset)]
    real_size = _parse_size(header[483:495], url, offset)
    return name, _expand_sparse(data, numbers, real_size, url, offset, name)


def _header_name(buf: bytes, pos: int) -> str:
    """Name of the header at ``pos``: the POSIX prefix field, a slash, and the name field."""
    nul = buf.find(0, pos, pos + 100)
    name = buf[pos : (pos + 100 if nul < 0 else nul)].decode()
    if buf[pos + 345] and buf[pos + 257 : pos + 263] == b"ustar\0":  # POSIX prefix (not in old GNU headers)
        name = buf[pos + 345 : pos + 500].split(b"\0", 1)[0].decode() + "/" + name
    return name


_DATA_KINDS = b"0\x007S"  # regular file ('0', NUL), contiguous ('7'), old GNU sparse ('S')
_META = re.compile(r"__[^/]*__($|/)")


def is_meta_name(name: str) -> bool:
    """Members webdataset does not treat as sample data, whatever their extension: a name whose
    first path component is ``__something__`` (``__meta__/info.txt``, ``__index__.json`` is
    not one: the ``__`` must end the component)."""
    if name[:2] != "__":
        return False
    return ("/" not in name and name.endswith("__")) or _META.match(name) is not None


def _check_name(name: str, url: str, offset: int) -> None:
    if "\0" in name:
        raise ShardFormatError(url, offset, f"member name contains a NUL byte: {name!r}")
    if name.startswith("/") or ".." in name.split("/"):
        raise ShardFormatError(url, offset, f"unsafe member name {name!r} (absolute or '..')")


def _decode_name(raw: bytes, url: str, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ShardFormatError(url, offset, f"member name is not UTF-8: {raw!r}") from None


def _verify_checksums(buf: bytes, positions: list[int], url: str, base: int) -> None:
    """Check the checksums of all headers parsed from ``buf`` at once (vectorized; a few headers,
    as a read of large members gives, one by one: numpy's fixed cost is ~30 us a call, a header
    summed in Python ~4 us)."""
    if not positions:
        return
    if len(positions) <= _FEW_HEADERS:
        for pos in positions:
            digits = buf[pos + 148 : pos + 156].translate(None, _NOT_OCTAL)
            stored = int(digits, 8) if digits else 0
            if sum(buf[pos : pos + 148]) + sum(buf[pos + 156 : pos + BLOCK]) + 8 * 32 != stored:
                _check_signed(buf, pos, stored, url, base)
        return
    blocks = np.frombuffer(buf, np.uint8, count=(len(buf) // BLOCK) * BLOCK).reshape(-1, BLOCK)
    rows = blocks[np.asarray(positions, dtype=np.int64) // BLOCK]
    field = rows[:, 148:156].astype(np.int64)
    computed = rows.sum(axis=1, dtype=np.int64) - field.sum(axis=1) + 8 * 32
    # The stored value is octal digits padded with NUL/space: fold the digits, skip the rest.
    digit = (field >= 48) & (field <= 55)
    after: np.ndarray = np.cumsum(digit[:, ::-1], axis=1)[:, ::-1] - digit
    stored = np.where(digit, (field - 48) << (3 * after), 0).sum(axis=1)
    for i in np.nonzero(computed != stored)[0]:
        _check_signed(buf, positions[int(i)], int(stored[i]), url, base)


def _checksum_error(buf: bytes, positions: list[int], url: str, base: int) -> ShardFormatError | None:
    """``_verify_checksums``' error for the first bad header, returned rather than raised."""
    try:
        _verify_checksums(buf, positions, url, base)
    except ShardFormatError as exc:
        return exc
    return None


_FEW_HEADERS = 6
# The stored checksum is octal digits padded with NUL/space: every other byte is dropped.
_NOT_OCTAL = bytes(c for c in range(256) if not 48 <= c <= 55)


def _check_signed(buf: bytes, pos: int, stored: int, url: str, base: int) -> None:
    """The unsigned sum did not match: accept the header only if its signed sum does (some old
    writers summed signed bytes)."""
    hdr = buf[pos : pos + BLOCK]
    signed = sum(b - 256 if b > 127 else b for b in hdr[:148] + hdr[156:]) + 8 * 32
    if stored != signed:
        raise ShardFormatError(url, base + pos, "tar header checksum mismatch (corrupt or not a tar file)")


def _pieces(read: Callable[[int], bytes], left: int, url: str, at: int, end: int) -> Iterator[bytes]:
    """The next ``left`` bytes of the stream as the pieces ``read`` hands over, all of the rest
    asked for each time (one request on S3), or as the pieces its ``read.pieces(n)`` hands over
    where it has that (read-ahead: the body's own buffers, not joined into a block first); a stream
    that ends first is a truncated shard."""
    take = getattr(read, "pieces", None)
    while left > 0:
        got = take(left) if take is not None else [read(left)]
        if not got or not got[0]:
            raise ShardFormatError(url, at, f"stream ended at byte {at}, expected {end} (truncated shard)")
        for piece in got:
            yield piece
            left -= len(piece)
            at += len(piece)


def _fill(view: memoryview, read: Callable[[int], bytes], readinto: Callable[[memoryview], int] | None, url: str, at: int, end: int) -> None:
    """Fill ``view`` from the stream: ``readinto`` when the stream has one (one copy, kernel or
    network buffer to ``view``), else ``read`` pieces copied in."""
    got, n = 0, len(view)
    if readinto is None:
        for piece in _pieces(read, n, url, at, end):
            view[got : got + len(piece)] = piece
            got += len(piece)
        return
    while got < n:
        k = readinto(view[got:])
        if not k:
            raise ShardFormatError(url, at + got, f"stream ended at byte {at + got}, expected {end} (truncated shard)")
        got += k


def _own_buffer(size: int, buffers: BufferPool | None) -> memoryview:
    """A writable buffer for one large member, seen as a plain byte ``memoryview``: from the pass's
    pool (memory already mapped) or numpy's allocator (no zero-fill, as ``bytearray(n)`` does)."""
    array = buffers.take(size) if buffers is not None else np.empty(size, np.uint8)
    return memoryview(array)  # type: ignore[arg-type]  # ndarray has the buffer protocol


def _read_joined(head: bytes | memoryview, left: int, read: Callable[[int], bytes], url: str, at: int, end: int) -> bytes:
    """``head`` and the next ``left`` bytes of the stream as one ``bytes``, the pieces joined once."""
    pieces = [head] if head else []
    pieces += _pieces(read, left, url, at, end)
    if len(pieces) == 1 and type(pieces[0]) is bytes:
        return pieces[0]
    return b"".join(pieces)


class Unjoined:
    """A large member's bytes as the pieces the stream handed over, not yet joined: the parser's
    value for such a member where whoever takes it copies the bytes into their place anyway (a
    DataLoader worker's batch segment, ``loader.SharedFields``), so that each byte is copied once
    there instead of joined into ``bytes`` first and copied again. ``bytes(value)`` joins it.

    Only where nothing between the read and the batch's hand-off sees a field (no decoding, no
    transform, no collate of the user's: ``iter_sample_dicts``'s ``join_later``). Every piece is
    immutable (``bytes``, or a view of ``bytes``, as obstore's pieces are): a piece of anything
    else (a block the stream or the parser fills again) is copied when the member is read, so the
    value cannot change after the parse."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: list[Any], nbytes: int):
        self.parts, self.nbytes = parts, nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)

    def __repr__(self) -> str:
        return f"Unjoined({self.nbytes} bytes in {len(self.parts)} pieces)"

    def copy_into(self, view: memoryview) -> None:
        """Write the bytes to ``view`` (a writable byte view of exactly ``len(self)`` bytes)."""
        at = 0
        for part in self.parts:
            n = len(part)
            view[at : at + n] = part
            at += n


def _immutable(piece: Any) -> Any:
    """``piece`` if nothing can change its bytes later (``bytes``, or a view of ``bytes``: what
    obstore's pieces and blocks joined by the parser are), else a copy as ``bytes`` (a view of a
    block the stream or the parser may fill again)."""
    if type(piece) is bytes or (type(piece) is memoryview and type(piece.obj) is bytes):
        return piece
    return bytes(piece)


def _read_unjoined(head: memoryview, left: int, read: Callable[[int], bytes], url: str, at: int, end: int) -> Unjoined:
    """``head`` and the next ``left`` bytes of the stream as an ``Unjoined``: the pieces as they
    come, each made immutable (``_immutable``); the same reads and errors as ``_read_joined``."""
    pieces: list[Any] = [_immutable(head)] if len(head) else []
    for piece in _pieces(read, left, url, at, end):
        pieces.append(_immutable(piece))
    return Unjoined(pieces, len(head) + left)


# -- The common case, a run at a time ------------------------------------------------------------
# Shards as writers make them are runs of plain members: a ustar header (octal size, regular-file
# type, no prefix field), data, padding. ``_plain_run`` finds such a run in a read block with a
# few numpy passes over the block's headers and ``_plain_samples`` groups it into samples with
# list operations, instead of a loop iteration per member. Both give up (None) on anything out of
# the ordinary: the general loop then parses those members, with every check and error it has.

_OCTAL_WEIGHTS = np.array([8**k for k in range(10, -1, -1)], dtype=np.int64)  # an 11-digit size field
# The checksum field's 6 digits (less 48 each) times this: (the value they spell, their sum).
_CHECKSUM_WEIGHTS = np.stack([_OCTAL_WEIGHTS[-6:], np.ones(6, np.int64)], axis=1)
# What a plain header holds, its fields read as little-endian 8-byte words (word k is bytes
# 8k..8k+7), masked and compared all at once: the size field's 11 octal digits (bytes 124..134: the
# top 4 bytes of word 15, the low 7 of word 16) and the checksum's 6 (148..153: the top 4 of word
# 18, the low 2 of word 19), then NUL and a space as writers put them (154, 155). An octal digit is
# a byte b with b & 0xF8 == 0x30. Byte by byte: after the size (135) NUL or space or any control
# byte, as the general loop takes; the member's kind (156) one of _PLAIN_KINDS; no POSIX prefix (345).
_FIELD_WORDS = np.array([15, 16, 18, 19], dtype=np.intp)
_FIELD_MASKS = np.array([0xF8F8F8F8_00000000, 0x00F8F8F8_F8F8F8F8, 0xF8F8F8F8_00000000, 0xFFFF_F8F8], dtype=np.uint64)
_FIELD_VALUES = np.array([0x30303030_00000000, 0x00303030_30303030, 0x30303030_00000000, 0x2000_3030], dtype=np.uint64)  # (2 digits, NUL, space)
_PLAIN_KINDS = np.zeros(256, bool)
_PLAIN_KINDS[[48, 0, 55, 120]] = True  # regular file ('0', NUL), contiguous ('7'), pax header ('x')


def _octal_sizes(fields: np.ndarray) -> np.ndarray:
    """Size fields (bytes 124..134 of headers, a row each) read as 11 octal digits. Bytes that are
    not digits wrap around to large values, never negative ones: a walk by these sizes always
    moves forward."""
    return (fields - 48).astype(np.int64) @ _OCTAL_WEIGHTS


class _Run:
    """A run of plain members in a block: where each header, its data and its padding start and
    end (relative to the block), keys and extensions; ``spread``: the run's bytes over its bytes
    less its pax headers and their payloads (1.0 with none, 1.8 in webdataset's small samples)."""

    __slots__ = ("positions", "starts", "stops", "ends", "keys", "exts", "spread")

    def __init__(
        self,
        positions: list[int],
        starts: list[int],
        stops: list[int],
        ends: list[int],
        keys: Sequence[str],
        exts: Sequence[str],
        spread: float = 1.0,
    ):
        self.positions, self.starts, self.stops, self.ends, self.keys, self.exts = positions, starts, stops, ends, keys, exts
        self.spread = spread

    def cut(self, first: int, last: int) -> _Run:
        """Members ``first:last`` of the run."""
        return _Run(
            self.positions[first:last],
            self.starts[first:last],
            self.stops[first:last],
            self.ends[first:last],
            self.keys[first:last],
            self.exts[first:last],
        )


# Bytes 257..261 ("ustar", every writer's magic but v7's) in word 32 (bytes 256..263).
_MAGIC = (np.uint64(0xFF_FFFF_FFFF << 8), np.uint64(int.from_bytes(b"\0ustar", "little")))
_MAGIC_WORD = 32


def _walk(blocks: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The headers a member-by-member walk from block 0 visits, each member all within the
    ``count`` blocks (a header at block ``i`` of size s is followed by one at ``i + 1 + ceil(s / 512)``,
    s as ``_octal_sizes`` reads it): their block indices, their rows (copied out of ``blocks``) and
    their sizes. The blocks with a ustar magic (every writer's but v7's) are taken for the headers
    as far as each one's member ends where the next begins, at once (their rows gathered once, the
    run path's rows too); the walk goes on one member at a time from where they do not (a v7
    header, a data block that looks like a header), so the result is the walk's, whatever the data."""
    words = blocks.view(np.uint64)
    candidates = np.flatnonzero((words[:, _MAGIC_WORD] & _MAGIC[0]) == _MAGIC[1])
    chain: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    i = 0
    if len(candidates) and candidates[0] == 0:
        rows = blocks.take(candidates, axis=0)
        sizes = _octal_sizes(rows[:, 124:135])
        follows = candidates + 1 + (sizes + (BLOCK - 1)) // BLOCK
        breaks = follows[:-1] != candidates[1:]
        chained = int(breaks.argmax()) if breaks.any() else len(candidates) - 1  # candidates[:chained + 1] chain
        if follows[chained] > count:  # the last one's member is not all in the block
            chained -= 1  # (every earlier one ends at the next's start, within the block)
        if chained >= 0:
            chain = candidates[: chained + 1], rows[: chained + 1], sizes[: chained + 1]
            i = int(follows[chained])
    rest: list[int] = []
    steps: list[int] | None = None  # every block's next, once the walk takes more than a step here
    while i < count:
        if steps is None and (rest or i == 0):
            steps = (np.arange(1, count + 1) + (_octal_sizes(blocks[:, 124:135]) + (BLOCK - 1)) // BLOCK).tolist()
        j = steps[i] if steps is not None else i + 1 + (int(_octal_sizes(blocks[i, 124:135])) + (BLOCK - 1)) // BLOCK
        if j > count:  # not all in the block: the general loop decides
            break
        rest.append(i)
        i = j
    if not rest:
        return chain if chain is not None else (np.zeros(0, np.intp), blocks[:0], np.zeros(0, np.int64))
    more = np.asarray(rest, dtype=np.intp)
    more_rows = blocks.take(more, axis=0)
    more_sizes = _octal_sizes(more_rows[:, 124:135])
    if chain is None:
        return more, more_rows, more_sizes
    return np.concatenate((chain[0], more)), np.concatenate((chain[1], more_rows)), np.concatenate((chain[2], more_sizes))


def _plain_run(buf: bytes | bytearray, pos: int, stop: int, large_member: int) -> _Run | None:
    """The run of plain members from ``pos`` (a header) up to ``stop`` (relative to ``buf``): each
    header's size field 11 octal digits then NUL or space, type '0', NUL or '7', no POSIX prefix,
    its checksum right and written as writers write it (6 octal digits, NUL, space); each member
    smaller than ``large_member`` and padded within ``stop``; each name UTF-8, relative, with no
    '..', not ``__meta__``, and split into key and extension at the first dot of its last
    component (as ``split_name`` does where it needs no regex). A member may be preceded by one pax
    header ('x', with the same size and checksum fields; its name does not matter) whose records
    are all harmless (``_harmless_pax``: mtime, atime, uid... never path or size), as webdataset's
    TarWriter (a float mtime), GNU tar's and bsdtar's pax formats write before every member: the
    member's position is then the pax header's, as the general loop reports it. The run ends
    before the first member that is not so; None where that leaves nothing, or where a name is
    not so."""
    count = (stop - pos) // BLOCK
    if count < 2:
        return None
    blocks = np.frombuffer(buf, np.uint8, count=count * BLOCK, offset=pos).reshape(count, BLOCK)
    # Every block read as a header: the index of the block after its member. Digits wrap around
    # to large values, never negative ones, so the walk always moves forward; the headers it
    # visits are checked below, and it stops before the first one that is not plain.
    at, rows, member_sizes = _walk(blocks, count)
    if not len(at):
        return None
    words = rows.view(np.uint64)
    kinds = rows[:, 156]
    pax = kinds == 120
    has_pax = bool(pax.any())
    plain = ((words[:, _FIELD_WORDS] & _FIELD_MASKS) == _FIELD_VALUES).all(axis=1)
    plain &= rows[:, 135] <= 32
    plain &= _PLAIN_KINDS[kinds]
    plain &= (rows[:, 345] == 0) | pax if has_pax else rows[:, 345] == 0  # (a pax header's name, and so its prefix, is not read)
    plain &= member_sizes < large_member
    stored, digits = ((rows[:, 148:154] - 48) @ _CHECKSUM_WEIGHTS).T
    # The unsigned sum of the header with its checksum field as 8 spaces; in a plain header that
    # field is 6 digits (their sum, plus 48 each), NUL and a space.
    plain &= rows.sum(axis=1, dtype=np.uint32) - (digits + 6 * 48 + 32) + 8 * 32 == stored
    if has_pax:
        # A pax header belongs to the member after it: that one must be a plain member (not
        # another pax header, not past the run's end), and its records harmless.
        plain[:-1] &= ~pax[:-1] | (plain[1:] & ~pax[1:])
        plain[-1] &= not pax[-1]
        cut = len(plain) if plain.all() else int(plain.argmin())
        where = np.flatnonzero(pax[:cut])
        if len(where):
            good = _harmless_pax(blocks, at[where] + 1, member_sizes[where])
            if good < len(where):
                plain[where[good]] = False
    if not plain.all():
        cut = int(plain.argmin())
        if not cut:
            return None
        at, rows, member_sizes, pax = at[:cut], rows[:cut], member_sizes[:cut], pax[:cut]
    first_headers = at
    if has_pax:
        if not len(pax) % 2 and pax[0::2].all() and not pax[1::2].any():  # a pax header before every member
            first_headers, at, member_sizes, rows = at[0::2], at[1::2], member_sizes[1::2], rows[1::2]
        else:
            member = ~pax
            after_pax = np.concatenate(([False], pax[:-1]))
            first_headers = np.where(after_pax, np.concatenate((at[:1], at[:-1])), at)[member]
            at, member_sizes, rows = at[member], member_sizes[member], rows[member]
    names = np.ascontiguousarray(rows[:, :100]).view("S100").ravel().tolist()  # up to the trailing NULs
    joined = b"\0".join(names)
    if joined.count(0) != len(names) - 1:  # a NUL inside a name: the name ends there
        return None
    try:
        text = joined.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if text[:1] == "/" or "\0/" in text or ".." in text or text[:2] == "__" or "\0__" in text or not all(names):
        return None
    # The dots and separators alone, in order: ".\0.\0...." when every name has exactly one dot.
    split = _split_names(text, joined.translate(None, _NOT_DOT_OR_NUL) == b".\0" * (len(names) - 1) + b".")
    if split is None:
        return None
    keys, exts = split
    starts = at * BLOCK + (pos + BLOCK)
    ends = starts + (member_sizes + (BLOCK - 1)) // BLOCK * BLOCK
    spread = 1.0
    if has_pax:
        span = int(ends[-1]) - pos - int(first_headers[0]) * BLOCK
        spread = span / (span - int((at - first_headers).sum()) * BLOCK)
    return _Run((first_headers * BLOCK + pos).tolist(), starts.tolist(), (starts + member_sizes).tolist(), ends.tolist(), keys, exts, spread)


def _overruns(buf: bytes | bytearray, pos: int, stop: int) -> bool:
    """Whether the header at ``pos`` (relative to ``buf``) has a size field, read as octal, whose
    member ends past ``stop``: no run starts there (``_plain_run`` would walk no member and
    return None), so its numpy calls are skipped. What follows a large member read on its own: a
    small block whose first header is the next large member (29 us a block otherwise)."""
    try:
        size = int(buf[pos + 124 : pos + 135], 8)
    except ValueError:  # (not octal: ``_plain_run`` decides, as ever)
        return False
    return size >= 0 and pos + BLOCK + size > stop


# Pax records that change nothing the parser reads (a member's name, size, type or contents):
# times, owners, comments, device/inode numbers, file flags, extended attributes. Anything else
# (path, size, linkpath, hdrcharset, GNU.sparse.*, a keyword no one wrote yet) is the general
# loop's to apply or refuse.
_HARMLESS_PAX_KEYWORDS = frozenset(
    [b"mtime", b"atime", b"ctime", b"uid", b"gid", b"uname", b"gname", b"comment"]
    + [b"LIBARCHIVE.creationtime", b"SCHILY.dev", b"SCHILY.ino", b"SCHILY.nlink", b"SCHILY.fflags"]
)
_HARMLESS_PAX_PREFIXES = (b"SCHILY.xattr.", b"LIBARCHIVE.xattr.")
# The keywords of up to 8 bytes as numbers (their bytes, NUL-padded, read as one uint64).
_SHORT_KEYWORDS = np.array(sorted(np.frombuffer(k.ljust(8, b"\0"), np.uint64)[0] for k in _HARMLESS_PAX_KEYWORDS if len(k) <= 8), dtype=np.uint64)
_PAX_LENGTH_DIGITS = 5  # records up to 99999 bytes


def _harmless_pax(blocks: np.ndarray, first: np.ndarray, sizes: np.ndarray) -> int:
    """How many of the pax payloads (``sizes[i]`` bytes from block ``first[i]`` of ``blocks``),
    from the first, are records ``_parse_pax`` reads without an error that all have harmless
    keywords: each record "<decimal length> <keyword>=<value>\\n", no NUL anywhere, no newline
    in a value. All of them at once: the payloads joined, every newline taken for a record's end,
    and each record's length field checked against the bytes to its newline (so a newline inside
    a value, which the length would skip, sends that payload to the loop)."""
    n = len(first)
    if int(sizes.max()) <= BLOCK:  # (what writers write: one block each) cut out of the blocks at once
        widest = int(sizes.max())
        payloads = blocks[first, :widest]
        if _one_harmless_record_each(payloads, sizes):
            return n
        data = payloads[_COLUMNS[:widest] < sizes[:, None]]
        if _short_harmless_records(data, sizes):
            return n
    else:
        flat = blocks.reshape(-1)
        data = np.concatenate([flat[a * BLOCK : a * BLOCK + b] for a, b in zip(first.tolist(), sizes.tolist())])
    ends = np.cumsum(sizes)
    bad = n
    # Each payload ends with a newline (a record's end), so no record spans two payloads.
    last = data[np.maximum(ends - 1, 0)] if len(data) else np.zeros(n, np.uint8)
    wrong = (sizes == 0) | (last != 10)
    if wrong.any():
        bad = int(wrong.argmax())
        if not bad:
            return 0
        data = data[: ends[bad - 1]]
    nuls = np.flatnonzero(data == 0)
    if len(nuls):
        bad = min(bad, int(np.searchsorted(ends, nuls[0], side="right")))
    record_end = np.flatnonzero(data == 10)
    record_start = np.concatenate(([0], record_end[:-1] + 1))
    top = len(data) - 1
    spaces = np.flatnonzero(data == 32)
    k = np.searchsorted(spaces, record_start)
    ok = k < len(spaces)
    space = spaces[np.minimum(k, len(spaces) - 1)] if len(spaces) else record_end
    width = space - record_start
    ok &= (space < record_end) & (width >= 1) & (width <= _PAX_LENGTH_DIGITS)
    value = np.zeros(len(record_end), np.int64)
    for j in range(min(int(width.max()), _PAX_LENGTH_DIGITS)):
        inside = j < width
        digit = data[np.minimum(record_start + j, top)].astype(np.int64) - 48
        ok &= ~inside | ((digit >= 0) & (digit <= 9))
        value = np.where(inside, value * 10 + digit, value)
    ok &= value == record_end - record_start + 1
    equals = np.flatnonzero(data == 61)
    k = np.searchsorted(equals, space)
    ok &= k < len(equals)
    equal = equals[np.minimum(k, len(equals) - 1)] if len(equals) else record_end
    keyword_len = equal - space - 1
    ok &= (equal < record_end) & (keyword_len >= 1)
    columns = np.arange(8)
    short = data[np.minimum(space[:, None] + 1 + columns, top)]
    short[columns >= keyword_len[:, None]] = 0
    numbers = short.view(np.uint64).ravel()
    known = (_SHORT_KEYWORDS[np.minimum(np.searchsorted(_SHORT_KEYWORDS, numbers), len(_SHORT_KEYWORDS) - 1)] == numbers) & (keyword_len <= 8)
    for r in np.flatnonzero(ok & ~known).tolist():  # longer keywords (rare): one at a time
        keyword = data[space[r] + 1 : equal[r]].tobytes()
        ok[r] = keyword in _HARMLESS_PAX_KEYWORDS or keyword.startswith(_HARMLESS_PAX_PREFIXES)
        if not ok[r]:
            break
    if not ok.all():
        bad = min(bad, int(np.searchsorted(ends, record_start[int(ok.argmin())], side="right")))
    return bad


def _length_fields() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a payload of s bytes (s < 1000) that is one record: its first 4 bytes as a little-endian
    uint32 must be ``value[s]`` under ``mask[s]`` (the decimal digits of s, then a space); its
    keyword starts at byte ``start[s]``."""
    value, mask, start = np.zeros(1000, np.uint32), np.zeros(1000, np.uint32), np.zeros(1000, np.int64)
    for s in range(1000):
        field = b"%d " % s
        value[s] = int.from_bytes(field, "little")
        mask[s] = (1 << (8 * len(field))) - 1
        start[s] = len(field)
    return value, mask, start


_LENGTH_VALUE, _LENGTH_MASK, _KEYWORD_START = _length_fields()
_COLUMNS = np.arange(BLOCK)


def _one_harmless_record_each(payloads: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether every payload (row ``i`` of ``payloads``, its first ``sizes[i]`` bytes) is one
    record "<its own length> <keyword>=<value>\\n" with the same harmless keyword, no NUL, no
    other newline and no other control byte below 11: what webdataset's TarWriter writes ("27 mtime=1795748319.707674\\n"), checked
    in about a dozen numpy calls. A subset of what ``_harmless_pax``'s general check accepts (a record whose
    length field is its own length, spelt without leading zeros); False sends the payloads to it."""
    n, widest = payloads.shape
    shortest, longest = int(sizes.min()), int(sizes.max())
    if shortest < 10 or longest >= 100 or widest < longest:  # (what writers write: 10 to 99 bytes, "NN " then the keyword)
        return _one_harmless_record_each_any(payloads, sizes)
    # Each payload's first byte below 11 is its last byte, a newline (so no NUL, tab or other newline in it).
    rows = _ROWS[:n] if n <= len(_ROWS) else np.arange(n)
    last = (payloads < 11).argmax(axis=1)
    if not (last == sizes - 1).all() or not (payloads[rows, last] == 10).all():
        return False
    # The length field: the two digits of the payload's size, then a space.
    head = np.ascontiguousarray(payloads[:, :4]).view("<u4").ravel()
    if not ((head & 0xFFFFFF) == _LENGTH_VALUE[sizes]).all():
        return False
    # The keyword: the first payload's, if harmless; every payload's the same, then '='.
    first = payloads[0, :shortest].tobytes()
    equals = first.find(b"=")
    keyword = first[3:equals]
    if equals < 0 or not keyword or (keyword not in _HARMLESS_PAX_KEYWORDS and not keyword.startswith(_HARMLESS_PAX_PREFIXES)):
        return False
    # ('=' before the newline: within the shortest payload, found there)
    return bool((payloads[:, 3 : equals + 1] == np.frombuffer(first[3 : equals + 1], np.uint8)).all())


_ROWS = np.arange(1024)


def _short_harmless_records(data: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether the payloads (``sizes[i]`` bytes each, joined in ``data``) are all records
    "<length> <keyword>=<value>\\n" of 10 to 99 bytes, each length field its own record's length
    (two digits), each keyword one of the harmless ones of up to 8 bytes (atime, ctime, mtime,
    uid...), no NUL and no control byte below 11 but each record's closing newline: what GNU tar's
    and bsdtar's pax formats write before every member ("30 atime=1795759077.833819224\\n30
    ctime=1795759077.833819224\\n"), checked in a few dozen numpy calls for all the records at once.
    A subset of what ``_harmless_pax``'s general check accepts; False sends the payloads to it."""
    if not len(data):
        return False
    newlines = np.flatnonzero(data < 11)  # every control byte: each must close a record
    if not len(newlines) or newlines[-1] != len(data) - 1 or not (data[newlines] == 10).all():
        return False
    if not (data[np.cumsum(sizes) - 1] == 10).all():  # each payload ends with a record (none spans two)
        return False
    starts = np.empty_like(newlines)
    starts[0] = 0
    starts[1:] = newlines[:-1] + 1
    lengths = newlines - starts + 1
    if int(lengths.min()) < 10 or int(lengths.max()) > 99:
        return False
    # Each record's first 12 bytes, cut out at once as 24 (_RECORD_COLUMNS): its length field
    # (bytes 0..3, read as a word) and its keyword of up to 8 bytes (3..10, a word) and an '=' (3..11).
    cut = np.concatenate((data, _PAD))[starts[:, None] + _RECORD_COLUMNS]
    # The length field: two digits spelling the record's length, then a space.
    if not ((cut.view("<u4")[:, 0] & 0xFFFFFF) == _LENGTH_VALUE[lengths]).all():
        return False
    # The keyword: bytes 3.. up to the record's first '=', within 8 bytes and before its newline.
    signs = cut[:, 8:17] == 61
    equals = signs.argmax(axis=1)  # (0 where none: an empty keyword, never harmless)
    if not signs.any(axis=1).all() or not (equals + 4 < lengths).all():
        return False
    numbers = cut.view("<u8")[:, 1] & _KEYWORD_MASKS[equals]
    found = _SHORT_KEYWORDS[np.minimum(np.searchsorted(_SHORT_KEYWORDS, numbers), len(_SHORT_KEYWORDS) - 1)]
    return bool((found == numbers).all())


# A record's bytes 0..3 (its length field and a byte; then 4 unused), 3..10 (a keyword of up to 8
# bytes) and 11 (the '=' after 8 bytes), so that the first two land in words of their own.
_RECORD_COLUMNS = np.array([0, 1, 2, 3, 0, 0, 0, 0, 3, 4, 5, 6, 7, 8, 9, 10] + [11] * 8, dtype=np.intp)
_PAD = np.zeros(16, np.uint8)
_KEYWORD_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], dtype=np.uint64)  # the first k bytes of a word


def _one_harmless_record_each_any(payloads: np.ndarray, sizes: np.ndarray) -> bool:
    """``_one_harmless_record_each`` for payloads of any length under 1000 bytes, however many
    digits their length fields have."""
    n, widest = payloads.shape
    if int(sizes.min()) < 6 or widest >= 1000:  # (6 bytes: the shortest such record with a value, "6 k=v" and a newline)
        return False
    # Each payload's last byte a newline, and no other byte below 11 (newline, NUL, tab...) in any.
    rows = np.arange(n)
    if not bool((payloads[rows, sizes - 1] == 10).all()):
        return False
    if np.count_nonzero((payloads < 11) & (_COLUMNS[:widest] < sizes[:, None])) != n:
        return False
    head = np.ascontiguousarray(payloads[:, :4]).view("<u4").ravel()
    if not bool(((head & _LENGTH_MASK[sizes]) == _LENGTH_VALUE[sizes]).all()):
        return False
    # The keyword: the first payload's, if harmless; every payload's the same, then '='.
    start = _KEYWORD_START[sizes]
    first = payloads[0, : int(sizes[0])].tobytes()
    equals = first.find(b"=")
    keyword = first[int(start[0]) : equals]
    if equals < 0 or not keyword or (keyword not in _HARMLESS_PAX_KEYWORDS and not keyword.startswith(_HARMLESS_PAX_PREFIXES)):
        return False
    spelled = np.frombuffer(keyword + b"=", np.uint8)
    if bool((start + len(spelled) >= sizes).any()):  # ('=' before the newline)
        return False
    return bool((payloads[rows[:, None], start[:, None] + _COLUMNS[: len(spelled)]] == spelled).all())


_NOT_DOT_OR_NUL = bytes(c for c in range(256) if c not in b".\0")


def _split_names(text: str, one_dot: bool) -> tuple[Sequence[str], Sequence[str]] | None:
    """Keys and lower-cased extensions of NUL-separated names, split at the first dot of the
    last component; None if a last component has no dot or starts with one. ``one_dot``: every
    name has exactly one dot (the usual case), so that a split at every dot and NUL alternates
    key, extension, key... (two C calls rather than one per name)."""
    keys: Sequence[str]
    exts: Sequence[str]
    if one_dot:
        parts = text.replace("\0", ".").split(".")
        keys, exts = parts[0::2], parts[1::2]
        if "" not in keys and ("/" not in text or ("/" not in "\0".join(exts) and "/\0" not in "\0".join(keys) + "\0")):
            if any(ext != ext.lower() for ext in set(exts)):
                exts = [ext.lower() for ext in exts]
            return keys, exts
    names = text.split("\0")
    if "/" in text:
        keys, exts = [], []
        for name in names:
            slash = name.rfind("/")
            dot = name.find(".", slash + 1)
            if dot <= slash + 1:
                return None
            keys.append(name[:dot])
            exts.append(name[dot + 1 :])
    else:
        keys, dots, exts = zip(*[name.partition(".") for name in names])
        if dots.count(".") != len(names) or "" in keys:
            return None
    if any(ext != ext.lower() for ext in set(exts)):
        exts = [ext.lower() for ext in exts]
    return keys, exts


def _plain_samples(
    run: _Run,
    buf: bytes | bytearray,
    view: memoryview | None,
    base: int,
    url: str,
    dicts: bool,
    key: str | None,
    key_offset: int,
    key_end: int,
    fields: dict[str, Any],
    seen: set[str],
):
    """Group ``run`` into samples, as the general loop would: members that continue the pending
    sample (``key``, ``fields``) join it, then each new key starts a sample. Returns the complete
    samples (``(key, offset, end, fields)``, or with ``dicts`` the fields with ``__key__`` and
    ``__url__``) and the new pending ``(key, key_offset, key_end, fields)``; ``seen`` and
    ``fields`` change only then. None (nothing changed) for a repeated key or field."""
    keys, exts, n = run.keys, run.exts, len(run.keys)
    if view is None:
        datas = [buf[a:b] for a, b in zip(run.starts, run.stops)]
    else:
        datas = [view[a:b].tobytes() for a, b in zip(run.starts, run.stops)]
    i = 0
    while i < n and keys[i] == key:  # more of the pending sample
        i += 1
    if i and (len(set(exts[:i])) != i or not fields.keys().isdisjoint(exts[:i])):
        return None
    done: list[Any] = []
    pending: tuple[str, int, int, dict[str, Any]] | None = None
    new_keys: set[str] = set()
    if i < n:
        grouped = _regular(run, datas, i, base, url, dicts) or _irregular(run, datas, i, base, url, dicts)
        if grouped is None:
            return None
        done, pending, new_keys = grouped
        if not seen.isdisjoint(new_keys):
            return None
    # Nothing can fail from here: commit.
    if i:
        fields.update(zip(exts[:i], datas[:i]))
        key_end = base + run.ends[i - 1]
    if pending is None:
        return done, key, key_offset, key_end, fields
    if key is not None:  # the sample pending before this run is complete
        if dicts:
            fields["__key__"] = key
            fields["__url__"] = url
            done.insert(0, fields)
        else:
            done.insert(0, (key, key_offset, key_end, fields))
    seen.update(new_keys)
    return (done, *pending)


def _regular(run: _Run, datas: list[Any], i: int, base: int, url: str, dicts: bool):
    """Members ``i:`` as samples that all have the same m fields in the same order (the last one
    maybe cut short by the block's end): sliced, m lists at a time. None if they are not so."""
    keys, exts, n = run.keys, run.exts, len(run.keys)
    first = keys[i]
    m = 1
    while i + m < n and keys[i + m] == first:
        m += 1
    names = tuple(exts[i : i + m])
    if len(set(names)) != m:
        return None
    groups = (n - i) // m
    full = i + groups * m
    group_keys = keys[i:full:m]
    for j in range(m):
        if (j and keys[i + j : full : m] != group_keys) or exts[i + j : full : m].count(names[j]) != groups:
            return None
    tail = keys[full:]
    new_keys = set(group_keys)
    if tail:  # the start of one more sample: same key throughout, a new one, no field twice
        if tail.count(tail[0]) != len(tail) or len(set(exts[full:])) != len(tail):
            return None
        new_keys.add(tail[0])
    if len(new_keys) != groups + (1 if tail else 0):
        return None
    last = full if tail else full - m  # where the pending sample starts
    complete = (last - i) // m
    columns = [datas[i + j : last : m] for j in range(m)]
    if dicts:
        if m == 1:
            (e0,) = names
            done: list[Any] = [{e0: a, "__key__": k, "__url__": url} for k, a in zip(group_keys, columns[0])]
        elif m == 2:
            e0, e1 = names
            done = [{e0: a, e1: b, "__key__": k, "__url__": url} for k, a, b in zip(group_keys, *columns)]
        elif m == 3:
            e0, e1, e2 = names
            done = [{e0: a, e1: b, e2: c, "__key__": k, "__url__": url} for k, a, b, c in zip(group_keys, *columns)]
        else:
            done = [dict(zip(names, row), __key__=k, __url__=url) for k, row in zip(group_keys, zip(*columns))]
    else:
        starts = run.positions[i:last:m]
        ends = run.ends[i + m - 1 : last : m]
        done = [(k, base + s, base + e, dict(zip(names, row))) for k, s, e, row in zip(group_keys, starts, ends, zip(*columns))]
    del done[complete:]  # (zip stopped there already; group_keys may be one longer)
    pending = (keys[last], base + run.positions[last], base + run.ends[n - 1], dict(zip(exts[last:], datas[last:])))
    return done, pending, new_keys


def _irregular(run: _Run, datas: list[Any], i: int, base: int, url: str, dicts: bool):
    """Members ``i:`` grouped one at a time (samples with different fields). None for a key that
    comes back or a field twice in a sample."""
    keys, exts, positions, ends = run.keys, run.exts, run.positions, run.ends
    done: list[Any] = []
    new_keys: set[str] = set()
    current = keys[i]
    start = i
    current_fields: dict[str, Any] = {}
    for j in range(i, len(keys)):
        k = keys[j]
        if k != current:
            if dicts:
                current_fields["__key__"] = current
                current_fields["__url__"] = url
                done.append(current_fields)
            else:
                done.append((current, base + positions[start], base + ends[j - 1], current_fields))
            current, start, current_fields = k, j, {}
        if j == start:
            if k in new_keys:
                return None
            new_keys.add(k)
        elif exts[j] in current_fields:
            return None
        current_fields[exts[j]] = datas[j]
    return done, (current, base + positions[start], base + ends[-1], current_fields), new_keys


def _sparse_pax(pax: dict[str, str] | None) -> bool:
    return pax is not None and ("GNU.sparse.major" in pax or "GNU.sparse.map" in pax or "GNU.sparse.size" in pax)


def iter_sample_dicts(
    read: Callable[[int], bytes],
    *,
    url: str,
    start: int = 0,
    end: int,
    read_size: int = DEFAULT_READ_SIZE,
    require_end_marker: bool = False,
    keep_buffers: Container[str] = (),
    large_member: int = LARGE_MEMBER,
    buffers: BufferPool | None = None,
    reuse_blocks: bool = False,
    join_later: bool = False,
) -> Iterator[list[dict[str, Any]]]:
    """``iter_sample_batches``, each sample as the dict the pipeline passes on: its fields, then
    ``"__key__"`` and ``"__url__"`` (``url``), built once. Same checks, same errors.

    With ``reuse_blocks`` and a stream that has ``readinto`` (a local file), blocks are read into
    one buffer used again and again (the unparsed tail moved to its front): no new memory and no
    join per read. Every field is copied out of it as ``bytes``, as always. The buffer is the one
    this thread's last finished parse grew (``_ARENAS``), so a pass's ranges reuse one.

    With ``join_later``, a member of ``large_member`` bytes or more that is read on its own (not
    all in the current block) and whose extension is not in ``keep_buffers`` is an ``Unjoined``
    (its pieces, not yet joined; ``bytes(value)`` joins them), for a caller that copies each such
    field into its place anyway (a DataLoader worker's hand-off of batches as stored: one copy
    per byte instead of two). Same samples, same reads, same errors; only that field's type."""
    lent = [_ARENAS.__dict__.pop("block", None) or bytearray()] if reuse_blocks else None
    try:
        yield from _parse(
            read,
            url,
            start,
            end,
            read_size,
            require_end_marker,
            keep_buffers,
            large_member,
            buffers,
            dicts=True,
            reuse_blocks=reuse_blocks,
            lent=lent,
            join_later=join_later,
        )
    finally:
        if lent is not None:
            _ARENAS.block = lent[0]


# The reused block of the last parse a thread finished, lent to the next one it starts (one parse at
# a time: a parse started while another holds it makes its own), so that a pass's ranges are read
# into memory already mapped. Fields are copied out of it as ``bytes``, so nothing refers to it
# once its parse is over.
_ARENAS = threading.local()


def iter_sample_batches(
    read: Callable[[int], bytes],
    *,
    url: str,
    start: int = 0,
    end: int,
    read_size: int = DEFAULT_READ_SIZE,
    require_end_marker: bool = False,
    keep_buffers: Container[str] = (),
    large_member: int = LARGE_MEMBER,
    buffers: BufferPool | None = None,
) -> Iterator[list[tuple[str, int, int, dict[str, Any]]]]:
    """Yield lists of complete samples ``(key, offset, end, {ext: data})`` from bytes ``[start, end)``.

    ``read(n)`` returns the next up-to-n bytes of the stream positioned at ``start``; ``end`` is
    the stream's known end (object size, or a range end from the manifest). One list per buffer
    fill (per ``PARSE_WINDOW`` bytes of a larger one), every header in it checksum-verified
    (vectorized). Members are grouped into samples by
    key, as webdataset does: the key is the name up to the first dot of its last component, the
    extension the rest, lower-cased; members without one, and ``__name__/...`` metadata members,
    are skipped. A name is the header's prefix + "/" + name fields unless a GNU long-name or pax
    ``path`` record replaces it; a pax ``size`` record replaces the size field. Sparse members
    (GNU pax 0.0/0.1/1.0, old GNU 'S' with up to 4 chunks) are expanded to their full contents.

    A member larger than one read is assembled from the pieces ``read`` returns in one join
    when all of it is there: every byte is copied a fixed number of times, whatever the number
    of pieces (linear in the member size). A member of ``large_member`` bytes or more that is not
    all in the current block is read on its own. When its extension is in ``keep_buffers``
    (decoders that view a writable buffer in place, e.g. ``.npy``) it is read into a buffer of its
    own, with ``read.readinto`` when the stream has one (one copy per byte), and its value is that
    buffer (a writable ``memoryview``); otherwise its rest is asked for in one read and the pieces
    joined once into ``bytes``. Every other field is ``bytes`` too. ``buffers`` (a pass's
    ``BufferPool``) supplies those buffers, reusing the memory of members no longer referenced.

    Errors (ShardFormatError, naming ``url`` and the byte offset): a size larger than the bytes
    left before ``end`` (checked before anything is allocated), a stream that ends early, a bad
    checksum, a malformed header, an unsafe or non-UTF-8 name, a sparse member that cannot be
    expanded, a repeated field in one sample, or a key that reappears later in the stream (two
    samples mixed up, one would be lost). With ``require_end_marker`` (whole-file reads) a stream
    that stops at a member boundary without the end-of-archive block is truncated, not complete.

    Runs of plain members (``_plain_run``: what writers make) are parsed a run at a time, the
    rest member by member; both give the same samples and errors (``fast=False`` in ``_parse``:
    member by member only, for tests).
    """
    yield from _parse(read, url, start, end, read_size, require_end_marker, keep_buffers, large_member, buffers, dicts=False)


def _parse(
    read: Callable[[int], bytes],
    url: str,
    start: int,
    end: int,
    read_size: int,
    require_end_marker: bool,
    keep_buffers: Container[str],
    large_member: int,
    buffers: BufferPool | None,
    *,
    dicts: bool,
    fast: bool = True,
    reuse_blocks: bool = False,
    lent: list[bytearray] | None = None,
    join_later: bool = False,
) -> Iterator[list[Any]]:
    """The parser behind ``iter_sample_batches`` (samples as tuples) and ``iter_sample_dicts``.
    ``lent``: the reused block to start from (``lent[0]``), replaced there when it grows."""
    buf: bytes | bytearray = b""
    view: memoryview | None = None  # buf's view when it is a fetched block (a bytearray): fields are cut as bytes from it
    base = start  # absolute offset of buf[0]
    pos = 0
    fetched = start  # absolute offset of the next byte read() returns
    long_name: str | None = None
    pax: dict[str, str] | None = None
    pax_size: int | None = None  # a pax 'size' record: the next member's size
    member_start: int | None = None  # first header of a member preceded by long-name/pax headers
    key: str | None = None  # the sample being assembled
    key_offset = key_end = 0
    fields: dict[str, Any] = {}
    seen: set[str] = set()
    readinto = getattr(read, "readinto", None)
    read_next = read_size  # bytes asked for by the next refill (smaller right after a large member)
    arena: bytearray | None = None  # the reused block
    if reuse_blocks and readinto is not None:
        arena = lent[0] if lent is not None else bytearray()
    # Reads into the reused block (and its lists) are this much larger than read_size (and
    # PARSE_WINDOW): the spread of the block's run of members behind pax headers (``_Run``), so
    # that a block holds about as many samples as one of plain members (MAX_SPREAD).
    spread = 1.0
    filled = 0  # bytes of buf that hold the stream (the reused block may be longer)
    big: Any = None  # the current member's data, when it was read on its own: memoryview, bytes or Unjoined
    plain: _Run | None = None  # the run of plain members found in plain_buf
    plain_buf: bytes | bytearray | None = None
    # The list being filled and its window, kept when the fast path resumes within a window.
    resumed: tuple[list[Any], int] | None = None
    while True:
        headers: list[int] = []
        done = False
        need = BLOCK
        limit = end - base  # end, relative to buf
        buflen = filled
        if resumed is None:
            out: list[Any] = []
            # Members that start from here on wait for the next list (same block, no read).
            window_end = pos + (PARSE_WINDOW if spread == 1.0 else int(PARSE_WINDOW * spread))
        else:
            (out, window_end), resumed = resumed, None
        windowed = False
        # A member's pax/long-name headers left pending by a refill: the loop parses that member,
        # then the fast path may take up again (``resume``), in the same list.
        chain = member_start is not None
        resume = False
        if fast and not chain:
            # The block's run of plain members is found once, from the first window that needs it.
            first = -1
            if plain is not None and plain_buf is buf:
                first = bisect_left(plain.positions, pos)
                if first == len(plain.positions) or plain.positions[first] != pos:
                    first = -1
            if first < 0:
                stop = min(buflen, limit)
                plain = None if _overruns(buf, pos, stop) else _plain_run(buf, pos, stop, large_member)
                plain_buf, first = buf, 0
                if plain is not None and arena is not None:
                    spread = min(plain.spread, MAX_SPREAD)
            if plain is not None:
                last = bisect_left(plain.positions, window_end, first)
                run = plain.cut(first, last)
                grouped = _plain_samples(run, buf, view, base, url, dicts, key, key_offset, key_end, fields, seen)
                if grouped is not None:
                    complete, key, key_offset, key_end, fields = grouped
                    if out:
                        out += complete
                    else:
                        out = complete
                    pos = run.ends[-1]
        # The samples the loop adds to ``out`` from here, each with the header that showed it complete
        # (the next key's): the headers' checksums are checked when the loop stops, and a bad one
        # keeps the samples shown complete before it (the bad header may be the last one's member).
        verified, ends = len(out), []
        error: ShardFormatError | None = None  # what ends the parse here, once the samples before it are out
        try:
            while True:
                if pos >= limit:
                    if require_end_marker:
                        raise ShardFormatError(url, base + pos, "no end-of-archive block: the shard is truncated")
                    done = True
                    break
                if buflen - pos < BLOCK:
                    need = BLOCK
                    break
                if pos >= window_end and member_start is None:  # (a member's pax/long-name headers and it: one list)
                    windowed = True
                    break
                if chain and member_start is None and fast:
                    resume = True
                    break
                try:  # fast path: 11 octal digits and a NUL or space, as every common writer emits
                    if buf[pos + 135] > 32:
                        raise ValueError
                    size = int(buf[pos + 124 : pos + 135], 8)
                except ValueError:
                    if buf[pos : pos + BLOCK] == ZERO_BLOCK:
                        done = True
                        break
                    size = _parse_size(buf[pos + 124 : pos + 136], url, base + pos)
                if pax_size is not None and buf[pos + 156] in _DATA_KINDS:  # a pax 'size' record: this member's size
                    size = pax_size
                data_start = pos + BLOCK
                data_end = data_start + size
                padded_end = data_end + (-size % BLOCK)
                if data_end > limit:
                    raise ShardFormatError(url, base + pos, f"member claims {size} bytes but only {limit - data_start} remain (truncated or corrupt)")
                kind = buf[pos + 156]
                if padded_end > buflen:
                    if size < large_member or kind == 83 or kind not in _DATA_KINDS or _sparse_pax(pax):
                        need = padded_end - pos
                        if pax is not None and long_name is None and member_start is not None and member_start >= base and fetched < end:
                            # The member's pax header stays in the block's tail and is parsed again
                            # with it after the refill: the run path then takes both, where the
                            # member alone would go member by member (a block's first member, in
                            # webdataset's shards).
                            back = member_start - base
                            need += pos - back
                            pos = back
                            pax = pax_size = member_start = None
                        break
                    # A large member, read on its own: the part already in this block, then the
                    # rest straight from the stream; then its padding is skipped.
                    _verify_checksums(buf, [pos], url, base)  # a corrupt size is not a reason to read megabytes
                    have = min(size, buflen - data_start)
                    early = (pax.get("path") if pax is not None else None) or long_name or _header_name(buf, pos)
                    if split_name(early)[1] in keep_buffers:  # a writable buffer of its own, filled in place
                        big = _own_buffer(size, buffers)
                        big[:have] = memoryview(buf)[data_start : data_start + have]
                        _fill(big[have:], read, readinto, url, fetched, end)
                    elif join_later:  # the pieces as they come, joined where they land (``Unjoined``)
                        head = memoryview(buf)[data_start : data_start + have]
                        if 2 * have < buflen:  # a view would keep the rest of the block alive with it
                            head = memoryview(head.tobytes())
                        big = _read_unjoined(head, size - have, read, url, fetched, end)
                    else:  # bytes: the pieces as they come (one request for the rest), joined once
                        big = _read_joined(memoryview(buf)[data_start : data_start + have], size - have, read, url, fetched, end)
                    fetched += size - have
                    pad = padded_end - max(data_end, buflen)
                    if pad > 0:
                        _fill(memoryview(bytearray(pad)), read, None, url, fetched, end)
                        fetched += pad
                    read_next = AFTER_LARGE_READ
                headers.append(pos)
                if kind == 48 or kind == 0 or kind == 55 or kind == 83:  # '0', NUL, '7': regular file; 'S': old GNU sparse
                    if long_name is None and pax is None:
                        nul = buf.find(0, pos, pos + 100)
                        name = buf[pos : (pos + 100 if nul < 0 else nul)].decode()
                        if buf[pos + 345] and buf[pos + 257 : pos + 263] == b"ustar\0":  # POSIX prefix field
                            name = buf[pos + 345 : pos + 500].split(b"\0", 1)[0].decode() + "/" + name
                        here = base + pos
                        if name[:1] == "/" or ".." in name or "\0" in name:
                            _check_name(name, url, here)
                        value = big if big is not None else buf[data_start:data_end] if view is None else view[data_start:data_end].tobytes()
                        if kind == 83:
                            name, value = _old_gnu_sparse(buf[pos : pos + BLOCK], value, name, url, here)
                    else:
                        override = pax.get("path") if pax is not None else None
                        name = override or long_name or _header_name(buf, pos)
                        here = member_start if member_start is not None else base + pos
                        _check_name(name, url, base + pos)
                        value = big if big is not None else buf[data_start:data_end] if view is None else view[data_start:data_end].tobytes()
                        if pax is not None and _sparse_pax(pax):
                            name, value = _pax_sparse(pax, value, name, url, here)
                            _check_name(name, url, here)
                        elif kind == 83:
                            name, value = _old_gnu_sparse(buf[pos : pos + BLOCK], value, name, url, here)
                        long_name = pax = pax_size = member_start = None
                    slash = name.rfind("/")
                    dot = name.find(".", slash + 1)
                    if dot > slash + 1:
                        k: str | None = name[:dot]
                        ext = name[dot + 1 :]
                        if not ext.islower():
                            ext = ext.lower()
                    else:  # a hidden last component or no extension: webdataset's regex decides
                        k, ext = split_name(name)  # type: ignore[assignment]
                    if big is not None:  # read on its own above: already the right type
                        big = None
                    elif len(value) >= large_member and ext in keep_buffers:  # all in this block: a buffer of its own
                        own = _own_buffer(len(value), buffers)
                        own[:] = value  # (the expanded contents, for a sparse member)
                        value = own
                    if k is not None and (name[:2] != "__" or not is_meta_name(name)):  # else not sample data (as in webdataset)
                        if k != key:
                            if key is not None:
                                if dicts:
                                    fields["__key__"] = key
                                    fields["__url__"] = url
                                    out.append(fields)
                                else:
                                    out.append((key, key_offset, key_end, fields))
                                ends.append(here)  # (complete: a member of another key starts here)
                            if k in seen:
                                raise ShardFormatError(url, here, f"duplicate key {k!r} (not adjacent to its first occurrence)")
                            seen.add(k)
                            key, key_offset, fields = k, here, {ext: value}
                        elif ext in fields:
                            raise ShardFormatError(url, here, f"duplicate field {ext!r} in sample {k!r}")
                        else:
                            fields[ext] = value
                        key_end = base + padded_end
                elif kind == 76:  # 'L': GNU long name of the next member
                    if member_start is None:
                        member_start = base + pos
                    long_name = buf[data_start:data_end].split(b"\0", 1)[0].decode()
                    pax_size = None
                elif kind == 120:  # 'x': pax header of the next member
                    if member_start is None:
                        member_start = base + pos
                    pax = _parse_pax(buf[data_start:data_end], url, base + pos)
                    pax_size = _pax_int(pax, "size", url, base + pos) if "size" in pax else None
                elif kind != 103 and kind != 75:  # not 'g' (global pax) or 'K' (long link): dirs, links...
                    long_name = pax = pax_size = member_start = None
                else:
                    pax_size = None
                pos = padded_end
        except (UnicodeDecodeError, ShardFormatError) as exc:
            # Deliver the complete samples before the break, then report it; a corrupt header
            # is reported as such rather than as whatever its garbage looked like.
            if headers and headers[-1] == pos:
                headers.pop()  # the header being parsed when it broke: checked on its own below
            bad = _checksum_error(buf, headers, url, base)
            if bad is None:
                error = exc if isinstance(exc, ShardFormatError) else ShardFormatError(url, base + pos, "member name is not UTF-8")
                if buflen - pos >= BLOCK:
                    error = _checksum_error(buf, [pos], url, base) or error
        else:
            bad = _checksum_error(buf, headers, url, base)
        if bad is not None:
            # The samples shown complete before the corrupt header are delivered first, as where
            # the loop itself breaks (and wherever a list or a read happened to end).
            out, error = out[: verified + bisect_left(ends, bad.offset or 0)], bad
        if error is not None:
            if out:
                yield out
            raise error from None
        if resume:
            resumed = (out, window_end)
            continue
        if done:
            if long_name is not None or pax is not None:
                raise ShardFormatError(url, base + pos, "archive ends after a long-name/pax header")
            if key is not None:
                if dicts:
                    fields["__key__"] = key
                    fields["__url__"] = url
                    out.append(fields)
                else:
                    out.append((key, key_offset, key_end, fields))
            if out:
                yield out
            return
        if out:
            yield out
        if windowed:
            continue
        if fetched >= end:
            raise ShardFormatError(url, base + pos, f"shard ends early: expected {end - base - pos} more bytes")
        # Refill: keep the unparsed tail and read at least ``need`` more bytes (a whole pending
        # member), collecting the pieces and joining once, so a member that arrives in many
        # pieces is copied once, not once per piece.
        # (pos is past buflen after a large member read into its own buffer.)
        missing = need - max(0, buflen - pos)
        plain = plain_buf = None
        if arena is not None and readinto is not None:
            tail = buf[pos:buflen] if pos < buflen else b""
            want = len(tail) + min(max(read_next if spread == 1.0 else int(read_next * spread), missing), end - fetched)
            read_next = min(2 * read_next, read_size)
            if len(arena) < want:
                arena = bytearray(-(-want // ARENA_STEP) * ARENA_STEP)
                if lent is not None:
                    lent[0] = arena
            arena[: len(tail)] = tail
            into = memoryview(arena)
            got = len(tail)
            while True:
                n = readinto(into[got:want])
                if not n:
                    raise ShardFormatError(url, fetched, f"stream ended at byte {fetched}, expected {end} (truncated shard)")
                got += n
                fetched += n
                missing -= n
                if missing <= 0 or fetched >= end:
                    break
            buf, view, filled = arena, into, got
            base += pos
            pos = 0
            continue
        parts = [buf[pos:buflen]] if pos < buflen else []
        while True:
            chunk = read(min(max(read_next, missing), end - fetched))
            read_next = min(2 * read_next, read_size)
            if not chunk:
                raise ShardFormatError(url, fetched, f"stream ended at byte {fetched}, expected {end} (truncated shard)")
            fetched += len(chunk)
            parts.append(chunk)
            missing -= len(chunk)
            if missing <= 0 or fetched >= end:
                break
        # One fetched block (bytes, or the bytearray an S3 GET was read into) is parsed where it
        # lies; pieces are joined once. Fields are always cut out as bytes.
        if len(parts) == 1 and (type(parts[0]) is bytes or type(parts[0]) is bytearray):
            buf = parts[0]
        else:
            buf = b"".join(parts)
        view = None if type(buf) is bytes else memoryview(buf)
        filled = len(buf)
        base += pos
        pos = 0


def iter_samples(read: Callable[[int], bytes], **kwargs) -> Iterator[tuple[str, int, int, dict[str, Any]]]:
    """``iter_sample_batches`` flattened: one ``(key, offset, end, {ext: data})`` at a time."""
    for batch in iter_sample_batches(read, **kwargs):
        yield from batch
