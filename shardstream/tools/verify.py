"""Check every shard against its manifest: exists, size, sha256, sample count, offsets (the
offset sidecar of a version-2 manifest: size, count, increasing, each offset at a sample's first
tar header), the member sidecar ``shardstream index`` wrote (where the manifest lists one: what a
fresh scan records, byte for byte), and (deep) that every field decodes. Collects every problem instead of stopping at the first."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shardstream.errors import SampleError, ShardstreamError, StorageError, StorageNotFound
from shardstream.format.manifest import Manifest
from shardstream.format.members import REBUILD
from shardstream.format.scan import scan_stream
from shardstream.pipeline.decode import Decoder, default_decoders
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.ranges import object_size, open_range, read_head


@dataclass(frozen=True)
class Problem:
    shard: str
    what: str
    key: str | None = None

    def __str__(self) -> str:
        return f"{self.shard}" + (f" [{self.key}]" if self.key else "") + f": {self.what}"


def verify_shard(
    manifest: Manifest,
    index: int,
    *,
    deep: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    max_problems: int = 100,
    config: StorageConfig = DEFAULT_STORAGE,
) -> list[Problem]:
    info = manifest.shards[index]
    url = manifest.shard_url(index)
    problems: list[Problem] = []
    try:
        size = object_size(url, storage_options, config=config)
    except StorageNotFound:
        return [Problem(url, "missing (listed in the manifest, not found in storage)")]
    except StorageError as exc:
        return [Problem(url, str(exc).removeprefix(f"{url}: "))]
    if size != info.bytes:
        problems.append(Problem(url, f"size is {size} bytes, the manifest says {info.bytes}"))
    decoder = Decoder(default_decoders()) if deep else None

    def decode(key: str, _start: int, _end: int, fields: dict[str, Any]) -> None:
        if decoder is not None and len(problems) < max_problems:
            fields["__key__"], fields["__url__"] = key, url
            try:
                decoder(fields)
            except SampleError as exc:
                problems.append(Problem(url, exc.what or str(exc), key))

    try:
        read, close = open_range(url, 0, size, storage_options, config=config)
        try:
            members = bool(manifest.member_bytes[index] >= 0)
            scan = scan_stream(read, url=url, size=size, on_sample=decode, progress=progress, members=members)
        finally:
            close()
    except ShardstreamError as exc:
        done = getattr(exc, "partial", None)
        problems.append(Problem(url, f"unreadable after {done.samples if done else 0} samples: {exc}"))
        return problems
    if scan.samples != info.samples:
        problems.append(Problem(url, f"holds {scan.samples} samples, the manifest says {info.samples}"))
    else:
        problems += _check_offsets(manifest, index, scan.offsets, storage_options)
        changed = bool(info.sha256) and scan.sha256 != info.sha256  # (the member sidecar names the sha256: it would differ too)
        if members and not problems and not changed:
            problems += _check_members(manifest, index, scan.members, storage_options, config)
    if info.sha256 and scan.sha256 != info.sha256:
        problems.append(Problem(url, f"sha256 is {scan.sha256}, the manifest says {info.sha256}"))
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


def _check_members(manifest: Manifest, index: int, found: bytes | None, storage_options, config: StorageConfig) -> list[Problem]:
    """The shard's member sidecar against the one this scan would write (the same bytes)."""
    url, side = manifest.shard_url(index), manifest.members_url(index)
    try:
        manifest.member_table(index, storage_options, config=config)  # its own checks: size, digest, the shard it names
        stored = read_head(side, int(manifest.member_bytes[index]) + 1, storage_options, config=config)
    except ShardstreamError as exc:
        return [Problem(url, str(exc))]
    if found is None:
        return [
            Problem(
                url,
                f"has a member sidecar {side}, but a scan finds the shard is not one to slice; {REBUILD}",
            )
        ]
    if stored != found:
        return [
            Problem(
                url,
                f"the member sidecar {side} is not what a scan of the shard records; {REBUILD}",
            )
        ]
    return []


def verify_dataset(
    manifest: Manifest,
    *,
    deep: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    threads: int = 4,
    config: StorageConfig = DEFAULT_STORAGE,
) -> list[Problem]:
    """Every problem found in every shard, in manifest order."""
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        results = pool.map(
            lambda i: verify_shard(manifest, i, deep=deep, storage_options=storage_options, progress=progress, config=config),
            range(len(manifest.shards)),
        )
        return [p for problems in results for p in problems]
