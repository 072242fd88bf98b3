"""A sample's tar members: each field's header, bytes and padding, sorted by extension.

Where a sample is loaded (a pack worker, or the one process) it is encoded here, so the process
that writes the shards only writes; with a ``sidecar.MemberLog`` it also notes where each
member's data lies, for the shard's member sidecar. Imports only ``shardstream.ustar`` and
``shardstream.sidecar``: a pack worker that loads local files needs nothing heavier
(``write/loading.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from shardstream.sidecar import MemberLog
from shardstream.ustar import member_header, padding


def encode_members(key: str, fields: Mapping[str, bytes], log: MemberLog | None = None, at: int = 0) -> tuple[list[bytes], int]:
    """A sample's tar members (header, data, padding per field, sorted by extension) and their
    size. ``log``: each member's data start (the sample written at shard byte ``at``), size and
    extension appended to it; the caller then keeps or drops the sample (``MemberLog``)."""
    pieces: list[bytes] = []
    size = 0
    if log is None:
        for ext in sorted(fields):
            data = fields[ext]
            hdr = member_header(f"{key}.{ext}", len(data))
            pad = padding(len(data))
            pieces += (hdr, data, pad) if pad else (hdr, data)
            size += len(hdr) + len(data) + len(pad)
        return pieces, size
    starts, sizes, exts = log.starts.append, log.sizes.append, log.exts.append
    for ext in sorted(fields):
        data = fields[ext]
        hdr = member_header(f"{key}.{ext}", len(data))
        pad = padding(len(data))
        pieces += (hdr, data, pad) if pad else (hdr, data)
        size += len(hdr)
        starts(at + size)
        sizes(len(data))
        exts(ext)
        size += len(data) + len(pad)
    return pieces, size
