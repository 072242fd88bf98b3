"""Every byte read or written goes through here: fsspec access, failure classification, ranged reads
with retry and resume, read-ahead, the local shard cache, and whole-shard scans."""
