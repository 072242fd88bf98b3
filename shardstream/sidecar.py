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
_NP_WEIGHTS = None  # WEIGHTS as a numpy array, made on first use (this module imports no numpy)


def block_fingerprints(block: bytes, headers: Sequence[int]) -> list[int]:
    """The fingerprints of the 512-byte headers at byte positions ``headers`` of ``block`` (a
    whole number of 512-byte blocks), as ``format.members.fingerprints`` computes them. numpy is
    imported here, on first use: a pack worker forked from the main process has it already, a
    spawned one imports it once, at its first shard's first block."""
    global _NP_WEIGHTS
    import numpy as np

    if _NP_WEIGHTS is None:
        _NP_WEIGHTS = np.array(WEIGHTS, dtype=np.uint64)
    rows = np.frombuffer(block, dtype="<u8", count=len(block) // 8).reshape(-1, 64)
    at = np.asarray(headers, dtype=np.int64) >> 9
    return np.matmul(rows.take(at, axis=0), _NP_WEIGHTS).tolist()


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
    """A shard's members as its writer appends them, for its member sidecar.

    ``write.members.encode_members(key, fields, log, at)`` appends each member's data start, size
    and extension as it builds the headers (``extend`` does for members encoded elsewhere); the
    writer then ``keep``s the sample (``key``) or ``drop``s what it appended. ``flushed(block,
    base)``, for each block the writer writes (whole samples, from shard byte ``base`` on), takes
    the fingerprints of the headers in it, all at once; ``encoded(offsets, size, sha256)`` gives
    the sidecar. A sample whose layout is not known (``unknown``) or a member of
    ``LARGE_MEMBER`` bytes or more: no sidecar (None), the shard is parsed."""

    __slots__ = ("firsts", "starts", "sizes", "exts", "keys", "fps", "sliceable")

    def __init__(self) -> None:
        self.firsts = [0]
        self.starts: list[int] = []
        self.sizes: list[int] = []
        self.exts: list[str] = []
        self.keys: list[str] = []
        self.fps: list[int] = []
        self.sliceable = True

    def extend(self, at: int, layout: Sequence[tuple[int, int]], extensions: Sequence[str]) -> None:
        """Members encoded elsewhere (a pack worker's): ``(data start within the sample, size)`` per
        member, with their extensions, for the sample written at byte ``at``."""
        self.starts += [at + start for start, _ in layout]
        self.sizes += [n for _, n in layout]
        self.exts += extensions

    def keep(self, key: str) -> None:
        self.keys.append(key)
        self.firsts.append(len(self.starts))

    def drop(self) -> None:
        """Forget the members appended since the last ``keep`` (a sample left out)."""
        del self.starts[self.firsts[-1] :], self.sizes[self.firsts[-1] :], self.exts[self.firsts[-1] :]

    def unknown(self) -> None:
        self.sliceable = False

    def flushed(self, block: bytes, base: int) -> None:
        done = len(self.fps)
        if self.sliceable and len(self.starts) > done:
            self.fps += block_fingerprints(block, [start - base - 512 for start in self.starts[done:]])

    def encoded(self, offsets: Sequence[int], size: int, sha256: str | None) -> bytes | None:
        """The sidecar, or None (no samples, or a shard not to slice)."""
        if not self.sliceable or not self.keys or len(offsets) != len(self.keys) + 1 or len(self.fps) != len(self.starts):
            return None
        if self.sizes and max(self.sizes) >= LARGE_MEMBER:
            return None
        names: dict[str, int] = {}
        ext_ids = [names[e] if e in names else names.setdefault(e, len(names)) for e in self.exts]
        return encode_member_table(offsets, self.firsts, self.starts, self.sizes, self.fps, ext_ids, list(names), self.keys, size, sha256)
