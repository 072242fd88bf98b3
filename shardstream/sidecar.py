"""The sidecars' layouts and their encoding without numpy: the offset sidecar (``format.offsets``
reads it) and the member sidecar (``format.members`` reads it, and documents its layout).

Its own module, importing nothing of shardstream's, so a pack worker that writes whole shards of a
local tree (``write/localshards.py``) writes their sidecars without importing numpy or the format
package (which imports pyarrow): the same reason ``shardstream.ustar`` is apart from the reader.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from operator import mul

MAGIC = b"SSOFFS\x00\x01"
HEADER = struct.Struct("<8sQ")
SUFFIX = ".idx"


def encode_offsets(offsets: Sequence[int]) -> bytes:
    """The sidecar bytes for ``samples + 1`` offsets (each an unsigned 64-bit little-endian)."""
    if len(offsets) < 1:
        raise ValueError("offsets need samples + 1 >= 1 entries")
    return HEADER.pack(MAGIC, len(offsets) - 1) + struct.pack(f"<{len(offsets)}Q", *offsets)


# -- member sidecars (layout: ``format/members.py``) ---------------------------------------------

MEMBERS_MAGIC = b"SSMEMB\x00\x01"
MEMBERS_HEADER = struct.Struct("<8sQQQII32s")
MEMBERS_SUFFIX = ".members"
LARGE_MEMBER = 1 << 20  # ``format.tar.LARGE_MEMBER``: a shard holding a member this large is parsed, not sliced
MASK = (1 << 64) - 1
# A header's fingerprint: its 64 little-endian words times these odd constants, summed modulo 2**64.
WEIGHTS = tuple(((i * 0x9E3779B97F4A7C15) & MASK) | 1 for i in range(1, 65))
_WORDS = struct.Struct("<64Q")


def header_fingerprint(block: bytes) -> int:
    """The fingerprint of one 512-byte header (``format.members.fingerprints`` computes the same
    for many at once, with numpy)."""
    return sum(map(mul, WEIGHTS, _WORDS.unpack(block))) & MASK


def encode_member_table(
    offsets: Sequence[int],
    firsts: Sequence[int],
    starts: Sequence[int],
    sizes: Sequence[int],
    fps: Sequence[int],
    ext_ids: Sequence[int],
    names: Sequence[str],
    keys: Sequence[str],
    size: int,
    sha256: str | None,
) -> bytes:
    """A member sidecar's bytes: the shard's ``size`` and ``sha256``, its ``offsets`` (samples + 1),
    each sample's first member (``firsts``, samples + 1), each member's data start, size, header
    fingerprint and extension (an index into ``names``), and the samples' ``keys``."""
    ext_blob = "\0".join(names).encode("utf-8")
    key_blob = "\0".join(keys).encode("utf-8")
    sha = bytes.fromhex(sha256) if sha256 else bytes(32)
    m = len(starts)
    body = b"".join(
        (
            MEMBERS_HEADER.pack(MEMBERS_MAGIC, size, len(keys), m, len(ext_blob), len(key_blob), sha),
            struct.pack(f"<{len(offsets)}Q", *offsets),
            struct.pack(f"<{len(firsts)}Q", *firsts),
            struct.pack(f"<{m}Q", *starts),
            struct.pack(f"<{m}Q", *fps),
            struct.pack(f"<{m}I", *sizes),
            struct.pack(f"<{m}H", *ext_ids),
            ext_blob,
            key_blob,
        )
    )
    return body + hashlib.sha256(body).digest()


class MemberLog:
    """A shard's members as its writer appends them, for its member sidecar: ``add(offset, key,
    layout)`` per sample (``layout``: ``(extension, data start within the sample, size,
    header fingerprint)`` per member, in member order; None where the writer cannot say), then
    ``encoded(offsets, size, sha256)``. A shard with a sample of unknown layout or a member of
    ``LARGE_MEMBER`` bytes or more gets no sidecar (None): its reader parses it."""

    __slots__ = ("firsts", "starts", "sizes", "fps", "ext_ids", "names", "keys", "sliceable")

    def __init__(self) -> None:
        self.firsts = [0]
        self.starts: list[int] = []
        self.sizes: list[int] = []
        self.fps: list[int] = []
        self.ext_ids: list[int] = []
        self.names: dict[str, int] = {}
        self.keys: list[str] = []
        self.sliceable = True

    def add(self, offset: int, key: str, layout: Sequence[tuple[str, int, int, int]] | None) -> None:
        if not self.sliceable:
            return
        if layout is None or any(n >= LARGE_MEMBER for _, _, n, _ in layout):
            self.sliceable = False
            self.firsts, self.starts, self.sizes, self.fps, self.ext_ids, self.keys = [0], [], [], [], [], []
            return
        names = self.names
        for ext, start, n, fp in layout:
            self.starts.append(offset + start)
            self.sizes.append(n)
            self.fps.append(fp)
            self.ext_ids.append(names[ext] if ext in names else names.setdefault(ext, len(names)))
        self.keys.append(key)
        self.firsts.append(len(self.starts))

    def encoded(self, offsets: Sequence[int], size: int, sha256: str | None) -> bytes | None:
        """The sidecar, or None (no samples, or a shard not to slice)."""
        if not self.sliceable or not self.keys or len(offsets) != len(self.keys) + 1:
            return None
        names = sorted(self.names, key=self.names.__getitem__)
        return encode_member_table(offsets, self.firsts, self.starts, self.sizes, self.fps, self.ext_ids, names, self.keys, size, sha256)
