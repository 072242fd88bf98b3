"""Check every shard against its manifest: exists, size, sha256, sample count, offsets (the
offset sidecar of a version-2 manifest: size, count, increasing, each offset at a sample's first
tar header), and (deep) that every field decodes. Collects every problem instead of stopping at the first."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shardstream.errors import SampleError, ShardstreamError
from shardstream.format.compression import UNKNOWN_END, decompressing, shard_compression
from shardstream.format.manifest import Manifest
from shardstream.format.tar import iter_sample_batches
from shardstream.pipeline.decode import Decoder, default_decoders
from shardstream.storage import fs as storage

READ_SIZE = 8 << 20


@dataclass(frozen=True)
class Problem:
    shard: str
    what: str
    key: str | None = None

    def __str__(self) -> str:
        return f"{self.shard}" + (f" [{self.key}]" if self.key else "") + f": {self.what}"


def verify_shard(manifest: Manifest, index: int, *, deep: bool = False, storage_options: Mapping[str, Any] | None = None,
                 progress: Callable[[int], None] | None = None, max_problems: int = 100) -> list[Problem]:
    info = manifest.shards[index]
    url = manifest.shard_url(index)
    fs, path = storage.get_fs(url, storage_options)
    problems: list[Problem] = []
    try:
        size = fs.size(path)
    except FileNotFoundError:
        return [Problem(url, "missing (listed in the manifest, not found in storage)")]
    except PermissionError as exc:
        return [Problem(url, storage.explain_denied(fs, path, exc))]
    if size != info.bytes:
        problems.append(Problem(url, f"size is {size} bytes, the manifest says {info.bytes}"))
    digest = hashlib.sha256()
    f = fs.open(path, "rb", block_size=READ_SIZE)

    def read(n: int) -> bytes:
        chunk = f.read(n)
        digest.update(chunk)
        if progress is not None:
            progress(len(chunk))
        return chunk

    decoder = Decoder(default_decoders()) if deep else None
    offsets: list[int] = []
    data_end = 0
    with f:
        try:
            compression = shard_compression(url)  # a compressed shard's offsets are in its decompressed stream
            tar_read = decompressing(read, url, compression) if compression else read
            for batch in iter_sample_batches(tar_read, url=url, start=0, end=UNKNOWN_END if compression else size,
                                             require_end_marker=True):
                for key, offset, end, fields in batch:
                    offsets.append(offset)
                    data_end = end
                    if decoder is not None and len(problems) < max_problems:
                        fields["__key__"], fields["__url__"] = key, url
                        try:
                            decoder(fields)
                        except SampleError as exc:
                            problems.append(Problem(url, exc.what, key))
        except ShardstreamError as exc:
            problems.append(Problem(url, f"unreadable after {len(offsets)} samples: {exc}"))
            return problems
        while read(READ_SIZE):
            pass
    offsets.append(data_end)
    if len(offsets) - 1 != info.samples:
        problems.append(Problem(url, f"holds {len(offsets) - 1} samples, the manifest says {info.samples}"))
    else:
        problems += _check_offsets(manifest, index, offsets, storage_options)
    if info.sha256 and digest.hexdigest() != info.sha256:
        problems.append(Problem(url, f"sha256 is {digest.hexdigest()}, the manifest says {info.sha256}"))
    return problems


def _check_offsets(manifest: Manifest, index: int, found: list[int], storage_options) -> list[Problem]:
    """The manifest's span and the shard's offsets (its sidecar: size, count, increasing) against
    the sample starts the scan found, so every offset points at a sample's first tar header."""
    url = manifest.shard_url(index)
    span = (int(manifest.spans[index, 0]), int(manifest.spans[index, 1]))
    if found and span != (found[0], found[-1]):
        return [Problem(url, f"the manifest's span is {list(span)}, the samples run over {[found[0], found[-1]]}")]
    where = "the manifest" if manifest.version == 1 else f"the offset sidecar {manifest.sidecar_url(index)}"
    try:
        listed = manifest.offsets(index, storage_options).tolist()
    except ShardstreamError as exc:
        return [Problem(url, str(exc))]
    if listed != found:
        bad = next(i for i, (a, b) in enumerate(zip(found, listed)) if a != b)
        return [Problem(url, f"offset of sample #{bad} is {found[bad]}, {where} says {listed[bad]}")]
    return []


def verify_dataset(manifest: Manifest, *, deep: bool = False, storage_options: Mapping[str, Any] | None = None,
                   progress: Callable[[int], None] | None = None, threads: int = 4) -> list[Problem]:
    """Every problem found in every shard, in manifest order."""
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        results = pool.map(lambda i: verify_shard(manifest, i, deep=deep, storage_options=storage_options, progress=progress),
                           range(len(manifest.shards)))
        return [p for problems in results for p in problems]
