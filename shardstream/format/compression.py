"""Compressed shards (``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz``, ``.tar.zst``): which URLs are
compressed (the suffix table lives with the other URL rules, ``storage/urls.py``, and is
re-exported here), and a streaming decompressor behind the same ``read(n)`` the tar parser takes.

A compressed shard is described in its manifest like any other: ``bytes`` and ``sha256`` are the
object's (compressed) size and hash, the sample ``offsets`` are positions in the *decompressed*
tar stream. A compressed stream cannot be entered at an offset, so a range that starts at
sample ``i`` decompresses the shard from its start and drops the bytes before ``offsets[i]``.

gzip, bz2 and xz come with Python; zstd needs the ``zstandard`` package (the ``zstd`` extra):
without it a ``.tar.zst`` shard raises ShardFormatError saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardstream.errors import ShardFormatError

# Which names are (compressed) shards is decided with the other URL rules (storage/urls.py).
from shardstream.storage.urls import SHARD_SUFFIXES as SHARD_SUFFIXES
from shardstream.storage.urls import SUFFIXES as SUFFIXES
from shardstream.storage.urls import is_shard_name as is_shard_name
from shardstream.storage.urls import shard_compression as shard_compression

SKIP_BLOCK = 4 << 20
MAX_PIECE = 16 << 20  # most decompressed bytes per read(): a stream reader allocates what it is asked for
UNKNOWN_END = 1 << 62  # the parser's ``end`` for a whole decompressed stream (its size is not known ahead)


class _Source:
    """File-like ``read(n)`` over a ``read`` function, for the stdlib/zstandard stream readers."""

    def __init__(self, read: Callable[[int], bytes]):
        self._read = read

    def read(self, n: int = -1) -> bytes:
        return self._read(n if n is not None and n >= 0 else SKIP_BLOCK)

    def readable(self) -> bool:
        return True


def _stream(kind: str, source: _Source, url: str) -> Any:
    if kind == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=source, mode="rb")  # type: ignore[arg-type,call-overload,unused-ignore]
    if kind == "bz2":
        import bz2

        return bz2.BZ2File(source, mode="rb")  # type: ignore[arg-type,call-overload,unused-ignore]
    if kind == "xz":
        import lzma

        return lzma.LZMAFile(source, mode="rb")  # type: ignore[arg-type,call-overload,unused-ignore]
    if kind == "zstd":
        try:
            import zstandard
        except ImportError:
            raise ShardFormatError(url, 0, "a .tar.zst shard needs the 'zstandard' package: pip install 'shardstream[zstd]'") from None
        return zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True)  # type: ignore[arg-type,unused-ignore]
    raise ValueError(f"unknown compression {kind!r}")


def decompressing(read: Callable[[int], bytes], url: str, kind: str, *, skip: int = 0) -> Callable[[int], bytes]:
    """``read(n)`` over the decompressed stream of ``read``'s compressed bytes, positioned after
    the first ``skip`` decompressed bytes. Corrupt or cut compressed data raises
    ShardFormatError naming ``url`` and the decompressed offset reached."""
    stream = _stream(kind, _Source(read), url)
    position = 0

    def read_decompressed(n: int) -> bytes:
        nonlocal position
        try:
            data = stream.read(min(n, MAX_PIECE))
        except ShardFormatError:
            raise
        except Exception as exc:  # gzip.BadGzipFile, EOFError, zlib/lzma/zstd errors, OSError
            raise ShardFormatError(url, position, f"compressed ({kind}) shard is corrupt or truncated: {type(exc).__name__}: {exc}") from exc
        position += len(data)
        return data

    while skip > 0:
        chunk = read_decompressed(min(skip, SKIP_BLOCK))
        if not chunk:
            raise ShardFormatError(url, position, f"compressed shard ends after {position} bytes, before offset {position + skip}")
        skip -= len(chunk)
    return read_decompressed
