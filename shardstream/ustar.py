"""Deterministic ustar headers, the writing half of the tar format (``format.tar`` reads).

``member_header(name, size)`` builds a ustar header with fixed mode, owner and mtime, so the same
input always packs to the same bytes; a name that does not fit ustar falls back to a pax header,
which webdataset and GNU tar read. Its own module, importing nothing of shardstream's, so a pack
worker that loads local files builds its samples' headers without importing numpy or the reader
(``write/loading.py``: a worker process starts for a fraction of the CPU).
"""

from __future__ import annotations

BLOCK = 512
MAX_OCTAL_SIZE = 0o77777777777
END_OF_ARCHIVE = bytes(2 * BLOCK)

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
    import tarfile  # (the rare long or non-ASCII name: not imported by every worker)

    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def header_size(name: str, size: int) -> int:
    """The bytes of ``member_header(name, size)``, built only for a name that needs a pax header."""
    raw = name.encode("utf-8")
    if len(raw) <= 100 and size <= MAX_OCTAL_SIZE and raw.isascii():
        return BLOCK
    return len(member_header(name, size))


def padding(size: int) -> bytes:
    return bytes(-size % BLOCK)
