"""The exceptions shardstream raises, as one tree.

    ShardstreamError                 every error shardstream raises on purpose
    ├── ConfigError                  settings that cannot work (named numbers in the message)
    ├── SourceError                  bad pack input: unreadable file, malformed line, key clash
    ├── DestinationError             pack destination missing, refusing access, or not empty
    ├── ManifestError                index.json missing, not JSON, or inconsistent
    ├── StateError                   a resume state from another dataset, seed, mode or version
    ├── StorageError                 a shard cannot be opened or read (names the URL)
    │   └── ChecksumError            a shard's bytes do not match the manifest's sha256
    ├── ShardFormatError             bytes that are not a valid tar shard (names URL and offset)
    └── SampleError                  a sample that cannot be decoded (names URL, key and field)

Each message says what is wrong and where (path, line, shard URL, byte offset), so a user can
act on it without a traceback.
"""

from __future__ import annotations


class ShardstreamError(Exception):
    """Base class of every error shardstream raises on purpose."""


class ConfigError(ShardstreamError, ValueError):
    """Options that cannot work together; raised at construction."""


class SourceError(ShardstreamError):
    """A pack source item cannot be turned into a sample."""

    def __init__(self, where: str, what: str):
        self.where = where
        self.what = what
        super().__init__(f"{where}: {what}")


class DestinationError(ShardstreamError):
    """The pack destination cannot be written as asked."""


class ManifestError(ShardstreamError):
    """A manifest that cannot be trusted."""


class StateError(ShardstreamError, ValueError):
    """A resume state that does not fit this dataset or this shardstream (says which field differs)."""


class StorageError(ShardstreamError):
    """A shard or manifest that cannot be opened or read."""


class ChecksumError(StorageError):
    """A shard whose bytes do not hash to the sha256 the manifest recorded."""

    def __init__(self, url: str, actual: str, expected: str):
        self.url = url
        self.actual = actual
        self.expected = expected
        super().__init__(f"{url}: sha256 {actual} does not match the manifest's {expected} "
                         "(the shard changed after it was packed, or is corrupt)")


class ShardFormatError(ShardstreamError):
    """Bytes that are not a valid tar shard."""

    def __init__(self, url: str, offset: int, what: str):
        self.url = url
        self.offset = offset
        self.what = what
        super().__init__(f"{url} at byte {offset}: {what}")


class SampleError(ShardstreamError):
    """A sample that cannot be decoded or lacks a required field (names the shard URL and key)."""

    def __init__(self, url: str, key: str, what: str):
        self.url = url
        self.key = key
        self.what = what
        super().__init__(f"{url}, sample {key!r}: {what}")
