"""The offset sidecar's layout and its encoding without numpy (``format.offsets`` reads it).

Its own module, importing nothing of shardstream's, so a pack worker that writes whole shards of a
local tree (``write/localshards.py``) writes their sidecars without importing numpy or the format
package (which imports pyarrow): the same reason ``shardstream.ustar`` is apart from the reader.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

MAGIC = b"SSOFFS\x00\x01"
HEADER = struct.Struct("<8sQ")
SUFFIX = ".idx"


def encode_offsets(offsets: Sequence[int]) -> bytes:
    """The sidecar bytes for ``samples + 1`` offsets (each an unsigned 64-bit little-endian)."""
    if len(offsets) < 1:
        raise ValueError("offsets need samples + 1 >= 1 entries")
    return HEADER.pack(MAGIC, len(offsets) - 1) + struct.pack(f"<{len(offsets)}Q", *offsets)
