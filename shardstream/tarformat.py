"""The tar format, both ways: deterministic headers for writing, a fast checked parser for reading.

Writing: ``member_header(name, size)`` builds a ustar header with fixed mode, owner and mtime, so
the same input always packs to the same bytes; names that do not fit ustar fall back to a pax
header, which webdataset and GNU tar read.

Reading: ``iter_members`` parses 512-byte headers straight out of large buffered reads (no
``tarfile`` per member), validates checksums a buffer at a time with numpy, follows GNU long names
and pax headers, and never trusts a size field beyond the bytes that are really there.
``iter_samples`` groups members into samples by key, as webdataset does.

Record shapes:
    iter_members  -> (name: str, offset: int, end: int, data: bytes)
                     offset = the member's first header (long-name/pax included), end = after its padding
    iter_samples  -> (key: str, offset: int, fields: {ext: bytes})
"""

from __future__ import annotations

import tarfile
from typing import Callable, Iterable, Iterator

import numpy as np

from .errors import ShardFormatError

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
DEFAULT_READ_SIZE = 4 << 20
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


def split_name(name: str) -> tuple[str | None, str | None]:
    """Split a member name into (key, extension) the way webdataset does.

    The key is everything up to the first dot of the last path component; the extension is the
    rest, lower-cased. Names without such a dot (or starting with one) have no key.
    """
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1:
        return None, None
    return name[:dot], name[dot + 1 :].lower()


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
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


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
    """Check the header checksums of all headers parsed from ``buf`` at once."""
    if not positions:
        return
    blocks = np.frombuffer(buf, np.uint8, count=(len(buf) // BLOCK) * BLOCK).reshape(-1, BLOCK)
    rows = blocks[np.asarray(positions, dtype=np.int64) // BLOCK]
    computed = rows.sum(axis=1, dtype=np.int64) - rows[:, 148:156].sum(axis=1, dtype=np.int64) + 256
    for i in np.nonzero(computed != _stored_checksums(buf, positions))[0]:
        pos = positions[int(i)]
        hdr = buf[pos : pos + BLOCK]
        stored = _stored_checksum(hdr)
        signed = sum(b - 256 if b > 127 else b for b in hdr[:148] + hdr[156:]) + 256
        if stored != signed:
            raise ShardFormatError(url, base + pos, "tar header checksum mismatch (corrupt or not a tar file)")


def _stored_checksum(hdr: bytes) -> int:
    text = hdr[148:156].replace(b"\0", b" ").strip()
    try:
        return int(text, 8)
    except ValueError:
        return -1


def _stored_checksums(buf: bytes, positions: list[int]) -> np.ndarray:
    return np.fromiter((_stored_checksum(buf[p : p + BLOCK]) for p in positions), np.int64, len(positions))


def iter_members(
    read: Callable[[int], bytes],
    *,
    url: str,
    start: int = 0,
    end: int,
    read_size: int = DEFAULT_READ_SIZE,
    regular_only: bool = True,
    require_end_marker: bool = False,
) -> Iterator[tuple[str, int, int, bytes]]:
    """Yield ``(name, offset, end, data)`` for the regular members in bytes ``[start, end)``.

    ``read(n)`` returns the next up-to-n bytes of the stream positioned at ``start``; ``end`` is
    the stream's known end (object size, or a range end from the manifest); with
    ``require_end_marker`` (whole-file reads) a stream that stops at a member boundary without
    the end-of-archive block is truncated, not complete. A size field is
    checked against ``end`` before anything is allocated for it; a stream that ends early, a bad
    checksum or a malformed header raises ShardFormatError naming ``url`` and the byte offset.
    """
    buf = b""
    base = start  # absolute offset of buf[0]
    pos = 0
    fetched = start  # absolute offset of the next byte read() returns
    long_name: str | None = None
    pax: dict[str, str] | None = None
    member_start: int | None = None
    while True:
        out: list[tuple[str, int, int, bytes]] = []
        headers: list[int] = []
        done = False
        need = BLOCK
        while True:
            if base + pos >= end:
                if require_end_marker:
                    raise ShardFormatError(url, base + pos, "no end-of-archive block: the shard is truncated")
                done = True
                break
            if len(buf) - pos < BLOCK:
                need = BLOCK
                break
            hdr = buf[pos : pos + BLOCK]
            if hdr == ZERO_BLOCK:
                done = True
                break
            offset = base + pos
            size = _parse_size(hdr[124:136], url, offset)
            data_start = pos + BLOCK
            padded_end = data_start + size + (-size % BLOCK)
            if base + data_start + size > end:
                raise ShardFormatError(
                    url, offset, f"member claims {size} bytes but only {end - base - data_start} remain (truncated or corrupt)"
                )
            if padded_end > len(buf):
                need = padded_end - pos
                break
            headers.append(pos)
            if member_start is None:
                member_start = offset
            kind = hdr[156:157]
            if kind in (b"0", b"\0", b"7"):
                if pax is not None and "path" in pax:
                    name = pax["path"]
                elif long_name is not None:
                    name = long_name
                else:
                    name = _decode_name(hdr[0:100].split(b"\0", 1)[0], url, offset)
                    if hdr[257:262] == b"ustar" and hdr[345] != 0:
                        prefix = _decode_name(hdr[345:500].split(b"\0", 1)[0], url, offset)
                        name = prefix + "/" + name
                _check_name(name, url, offset)
                out.append((name, member_start, base + padded_end, buf[data_start : data_start + size]))
                long_name = pax = member_start = None
            elif kind == b"L":
                long_name = _decode_name(buf[data_start : data_start + size].split(b"\0", 1)[0], url, offset)
            elif kind == b"x":
                pax = _parse_pax(buf[data_start : data_start + size], url, offset)
                if "size" in pax:
                    raise ShardFormatError(url, offset, "pax size override is not supported")
            elif kind in (b"g", b"K"):
                if member_start == offset:
                    member_start = None
            elif kind == b"S":
                raise ShardFormatError(url, offset, "GNU sparse members are not supported")
            else:  # directories, links, devices: not sample data
                if regular_only:
                    long_name = pax = member_start = None
            pos = padded_end
        _verify_checksums(buf, headers, url, base)
        yield from out
        if done:
            if long_name is not None or pax is not None:
                raise ShardFormatError(url, base + pos, "archive ends after a long-name/pax header")
            return
        if fetched >= end:
            raise ShardFormatError(url, base + pos, f"shard ends early: expected {end - base - pos} more bytes")
        chunk = read(min(max(read_size, need), end - fetched))
        if not chunk:
            raise ShardFormatError(
                url, fetched, f"stream ended at byte {fetched}, expected {end} (truncated shard)"
            )
        fetched += len(chunk)
        buf = buf[pos:] + chunk
        base += pos
        pos = 0


def iter_samples(
    members: Iterable[tuple[str, int, int, bytes]], *, url: str
) -> Iterator[tuple[str, int, dict[str, bytes]]]:
    """Group adjacent members with the same key into ``(key, offset, {ext: data})``.

    A repeated field within one sample, or a key that reappears later in the same stream, is a
    ShardFormatError: both mean two samples were mixed up and one would be silently lost.
    """
    key: str | None = None
    offset = 0
    fields: dict[str, bytes] = {}
    seen: set[str] = set()
    for name, member_offset, _end, data in members:
        k, ext = split_name(name)
        if k is None:
            continue
        if k != key:
            if key is not None:
                yield key, offset, fields
            if k in seen:
                raise ShardFormatError(url, member_offset, f"duplicate key {k!r} (not adjacent to its first occurrence)")
            seen.add(k)
            key, offset, fields = k, member_offset, {}
        elif ext in fields:
            raise ShardFormatError(url, member_offset, f"duplicate field {ext!r} in sample {k!r}")
        fields[ext] = data
    if key is not None:
        yield key, offset, fields
