"""Shard URLs: whether a string names shards (a .tar URL, a brace pattern, a glob) or a dataset
root, and expanding patterns into sorted URLs. The one place that decides it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardstream.format.compression import is_shard_name
from shardstream.storage import fs as storage

PATTERN_CHARS = "{*?["


def is_shard_pattern(source: str) -> bool:
    """True for a .tar (or .tar.gz, .tgz, ...) URL, a brace pattern or a glob; False for a dataset
    root or manifest URL."""
    return is_shard_name(source) or any(c in source for c in PATTERN_CHARS)


def expand_urls(pattern: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """A brace pattern, a glob, or a single URL -> sorted shard URLs (existing files only for globs)."""
    import braceexpand

    urls: list[str] = []
    for url in braceexpand.braceexpand(pattern):
        if any(c in url for c in "*?["):
            fs, path = storage.get_fs(url, storage_options)
            urls += [storage.full_url(fs, p) for p in sorted(fs.glob(path))]
        else:
            urls.append(url)
    return urls
