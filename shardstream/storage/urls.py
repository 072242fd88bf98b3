"""Shard URLs: whether a string names shards (a .tar URL, plain or compressed, a brace pattern, a
glob) or a dataset root, and expanding patterns into sorted URLs (``fs.expand_urls``, which globs
through storage). The one place that decides which names are shards: ``format.compression``
takes its suffix table from here.

Imports ``storage.fs`` and nothing of ``format``: format sits above storage (the layer contract in
pyproject.toml, checked by ``lint-imports``)."""

from __future__ import annotations

import os
import posixpath

from shardstream.storage.fs import expand_urls as expand_urls

PATTERN_CHARS = "{*?["

# Compressed shard suffixes and their compression, longest first: ".tar.gz" before ".gz".
SUFFIXES = (
    (".tar.gz", "gzip"),
    (".tgz", "gzip"),
    (".tar.bz2", "bz2"),
    (".tbz2", "bz2"),
    (".tbz", "bz2"),
    (".tar.xz", "xz"),
    (".txz", "xz"),
    (".tar.zst", "zstd"),
    (".tzst", "zstd"),
    (".tar.zstd", "zstd"),
)
SHARD_SUFFIXES = (".tar", *(suffix for suffix, _ in SUFFIXES))


def shard_compression(url: str) -> str | None:
    """ "gzip", "bz2", "xz" or "zstd" for a compressed shard URL (by its suffix), else None."""
    lower = url.lower()
    for suffix, kind in SUFFIXES:
        if lower.endswith(suffix):
            return kind
    return None


def is_shard_name(url: str) -> bool:
    """Whether a URL names a tar shard, plain or compressed, by its suffix."""
    return url.lower().endswith(SHARD_SUFFIXES)


def is_shard_pattern(source: str) -> bool:
    """True for a .tar (or .tar.gz, .tgz, ...) URL, a brace pattern or a glob; False for a dataset
    root or manifest URL."""
    return is_shard_name(source) or any(c in source for c in PATTERN_CHARS)


def canonical_url(url: str) -> str:
    """One spelling per location: a local path absolute and normalised (``./x``, ``x``, ``a/../x``,
    ``file:///.../x`` alike), a remote URL with its ``.``/``..`` segments and doubled slashes resolved."""
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}"
    return os.path.abspath(url)
