"""The tar format, both ways: deterministic headers for writing, a fast checked parser for reading.

Writing: ``member_header(name, size)`` builds a ustar header with fixed mode, owner and mtime, so
the same input always packs to the same bytes; names that do not fit ustar fall back to a pax
header, which webdataset and GNU tar read.

Reading: ``iter_sample_batches`` parses 512-byte headers straight out of large buffered reads
(no ``tarfile`` per member), validates checksums a buffer at a time with numpy, follows GNU long
names and pax headers, never trusts a size field beyond the bytes that are really there, and
groups members into samples by key, as webdataset does, in the same pass.

Record shapes:
    iter_sample_batches -> [(key: str, offset: int, end: int, fields: {ext: bytes}), ...]  a list per read
                           offset = the sample's first header (long-name/pax included),
                           end = after the padding of its last member
    iter_samples        -> (key, offset, end, fields)                                     flattened
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Callable, Container, Iterator
from typing import Any

import numpy as np

from shardstream.buffers import BufferPool
from shardstream.errors import ShardFormatError

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
DEFAULT_READ_SIZE = 4 << 20
# A member at least this large that is not all in the current read block gets a buffer of its own,
# filled straight from the stream (``readinto``): its bytes are copied once, not read into a block,
# joined and cut out again. After one, reads restart at AFTER_LARGE_READ bytes and double back up
# to read_size, so little of the next large member lands in a shared block.
LARGE_MEMBER = 1 << 20
AFTER_LARGE_READ = 64 << 10
MAX_OCTAL_SIZE = 0o77777777777

# Fixed header fields: mode 0644, uid/gid 0, mtime 0, empty owner names (deterministic output).
_MODE = b"0000644\0"
_ID = b"0000000\0"
_MTIME = b"00000000000\0"


def _ustar_template() -> tuple[bytearray, int]:
    hdr = bytearray(BLOCK)
    hdr[100:108] = _MODE
    hdr[108:116] = _ID
    hdr[116:124] = _ID
    hdr[136:148] = _MTIME
    hdr[148:156] = b"        "
    hdr[156:157] = b"0"
    hdr[257:263] = b"ustar\0"
    hdr[263:265] = b"00"
    hdr[329:337] = _ID
    hdr[337:345] = _ID
    return hdr, sum(hdr)


_TEMPLATE, _TEMPLATE_SUM = _ustar_template()


def member_header(name: str, size: int) -> bytes:
    """Header block(s) for one regular file member; deterministic for a given name and size."""
    raw = name.encode("utf-8")
    if len(raw) <= 100 and size <= MAX_OCTAL_SIZE and raw.isascii():
        hdr = _TEMPLATE[:]
        hdr[0 : len(raw)] = raw
        size_field = b"%011o\0" % size
        hdr[124:136] = size_field
        chksum = _TEMPLATE_SUM + sum(raw) + sum(size_field)  # template's name/size fields are NUL
        hdr[148:156] = b"%06o\0 " % chksum
        return bytes(hdr)
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def padding(size: int) -> bytes:
    return bytes(-size % BLOCK)


END_OF_ARCHIVE = bytes(2 * BLOCK)


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
        raise ShardFormatError(url, offset, f"size field is not octal: {field!r}") from None


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
        raise ShardFormatError(url, offset, f"old GNU sparse member {name!r} with more than 4 chunks is not supported; "
                                            "repack it without --sparse or with --format=pax")
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
    asked for each time (one request on S3); a stream that ends first is a truncated shard."""
    while left > 0:
        piece = read(left)
        if not piece:
            raise ShardFormatError(url, at, f"stream ended at byte {at}, expected {end} (truncated shard)")
        yield piece
        left -= len(piece)
        at += len(piece)


def _fill(view: memoryview, read: Callable[[int], bytes], readinto: Callable[[memoryview], int] | None,
          url: str, at: int, end: int) -> None:
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


def _sparse_pax(pax: dict[str, str] | None) -> bool:
    return pax is not None and ("GNU.sparse.major" in pax or "GNU.sparse.map" in pax or "GNU.sparse.size" in pax)


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
    fill, every header in it checksum-verified (vectorized). Members are grouped into samples by
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
    """
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
    big: memoryview | bytes | None = None  # the current member's data, when it was read on its own
    while True:
        out: list[tuple[str, int, int, dict[str, Any]]] = []
        headers: list[int] = []
        done = False
        need = BLOCK
        limit = end - base  # end, relative to buf
        buflen = len(buf)
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
                    raise ShardFormatError(
                        url, base + pos, f"member claims {size} bytes but only {limit - data_start} remain (truncated or corrupt)"
                    )
                kind = buf[pos + 156]
                if padded_end > buflen:
                    if size < large_member or kind == 83 or kind not in _DATA_KINDS or _sparse_pax(pax):
                        need = padded_end - pos
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
                        value = big if big is not None else buf[data_start:data_end] if view is None else bytes(view[data_start:data_end])
                        if kind == 83:
                            name, value = _old_gnu_sparse(buf[pos : pos + BLOCK], value, name, url, here)
                    else:
                        override = pax.get("path") if pax is not None else None
                        name = override or long_name or _header_name(buf, pos)
                        here = member_start if member_start is not None else base + pos
                        _check_name(name, url, base + pos)
                        value = big if big is not None else buf[data_start:data_end] if view is None else bytes(view[data_start:data_end])
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
                                out.append((key, key_offset, key_end, fields))
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
            _verify_checksums(buf, headers, url, base)
            error = exc if isinstance(exc, ShardFormatError) else ShardFormatError(url, base + pos, "member name is not UTF-8")
            if buflen - pos >= BLOCK:
                try:
                    _verify_checksums(buf, [pos], url, base)
                except ShardFormatError as checksum_error:
                    error = checksum_error
            if out:
                yield out
            raise error from None
        _verify_checksums(buf, headers, url, base)
        if done:
            if long_name is not None or pax is not None:
                raise ShardFormatError(url, base + pos, "archive ends after a long-name/pax header")
            if key is not None:
                out.append((key, key_offset, key_end, fields))
            if out:
                yield out
            return
        if out:
            yield out
        if fetched >= end:
            raise ShardFormatError(url, base + pos, f"shard ends early: expected {end - base - pos} more bytes")
        # Refill: keep the unparsed tail and read at least ``need`` more bytes (a whole pending
        # member), collecting the pieces and joining once, so a member that arrives in many
        # pieces is copied once, not once per piece.
        # (pos is past buflen after a large member read into its own buffer.)
        missing = need - max(0, buflen - pos)
        parts = [buf[pos:]] if pos < buflen else []
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
        base += pos
        pos = 0


def iter_samples(read: Callable[[int], bytes], **kwargs) -> Iterator[tuple[str, int, int, dict[str, Any]]]:
    """``iter_sample_batches`` flattened: one ``(key, offset, end, {ext: data})`` at a time."""
    for batch in iter_sample_batches(read, **kwargs):
        yield from batch
