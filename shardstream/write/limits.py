"""A shard's default limits, in a module of their own: the command line's help names them
without importing the writer (and the storage layer under it)."""

from __future__ import annotations

DEFAULT_MAX_COUNT = 10_000  # samples per shard at most
DEFAULT_MAX_SIZE = 256 * 1000**2  # bytes per shard at most
