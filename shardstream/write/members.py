"""A sample's tar members: each field's header, bytes and padding, sorted by extension.

Where a sample is loaded (a pack worker, or the one process) it is encoded here, so the process
that writes the shards only writes; with ``layout`` it also says where each member's data lies and
its header's fingerprint, for the shard's member sidecar (``sidecar.MemberLog``). Imports only
``shardstream.ustar`` and ``shardstream.sidecar``: a pack worker that loads local files needs
nothing heavier (``write/loading.py``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from operator import mul

from shardstream.sidecar import MASK, WEIGHTS, header_fingerprint
from shardstream.ustar import BLOCK, TEMPLATE, member_header, padding

# A fast-path header is ``ustar.TEMPLATE`` with only its name (words 0..12, as far as the name
# goes), size (words 15, 16) and checksum (words 18, 19) written: its fingerprint is the template's
# other words' share, fixed per name length, plus those few words' share.
_FILLED = (15, 16, 18, 19)
_TEMPLATE_WORDS = struct.unpack("<64Q", TEMPLATE)
_REST = [sum(WEIGHTS[i] * _TEMPLATE_WORDS[i] for i in range(64) if i >= k and i not in _FILLED) & MASK for k in range(14)]  # by the name's words k
_NAME_WORDS = [struct.Struct(f"<{k}Q") for k in range(14)]
_TWO = struct.Struct("<2Q")
W15, W16, W18, W19 = (WEIGHTS[i] for i in _FILLED)


def _fingerprint(header: bytes, name_bytes: int) -> int:
    """``sidecar.header_fingerprint`` of a fast-path ``member_header`` whose name is ``name_bytes`` long."""
    k = (name_bytes + 7) >> 3
    a, b = _TWO.unpack_from(header, 120)
    c, d = _TWO.unpack_from(header, 144)
    return (_REST[k] + sum(map(mul, WEIGHTS[:k], _NAME_WORDS[k].unpack_from(header))) + W15 * a + W16 * b + W18 * c + W19 * d) & MASK


def encode_members(key: str, fields: Mapping[str, bytes], layout: list[tuple[str, int, int, int]] | None = None) -> tuple[list[bytes], int]:
    """A sample's tar members (header, data, padding per field, sorted by extension) and their
    size. ``layout``: appended to, per member, ``(extension, data start within the sample, size,
    header fingerprint)``."""
    pieces: list[bytes] = []
    size = 0
    for ext in sorted(fields):
        data = fields[ext]
        name = f"{key}.{ext}"
        hdr = member_header(name, len(data))
        pad = padding(len(data))
        pieces += (hdr, data, pad) if pad else (hdr, data)
        if layout is not None:
            # (a header of one block is the fast path's: an ASCII name, as long in bytes as in characters)
            fp = _fingerprint(hdr, len(name)) if len(hdr) == BLOCK else header_fingerprint(hdr[-BLOCK:])
            layout.append((ext, size + len(hdr), len(data), fp))
        size += len(hdr) + len(data) + len(pad)
    return pieces, size
