"""A sample's tar members: each field's header, bytes and padding, sorted by extension.

Where a sample is loaded (a pack worker, or the one process) it is encoded here, so the process
that writes the shards only writes. Imports only ``shardstream.ustar``: a pack worker that loads
local files needs nothing heavier (``write/loading.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from shardstream.ustar import member_header, padding


def encode_members(key: str, fields: Mapping[str, bytes]) -> tuple[list[bytes], int]:
    """A sample's tar members (header, data, padding per field, sorted by extension) and their size."""
    pieces: list[bytes] = []
    size = 0
    for ext in sorted(fields):
        data = fields[ext]
        hdr = member_header(f"{key}.{ext}", len(data))
        pad = padding(len(data))
        pieces += (hdr, data, pad) if pad else (hdr, data)
        size += len(hdr) + len(data) + len(pad)
    return pieces, size
