"""Pack sources: list the samples of a dataset as small picklable items, then load each one.

Listing is cheap and happens once, in the main process, so the sample order (and a shuffle of
it) is fixed before any bytes are read; loading runs in worker processes. Kinds:

    dir     a directory tree; files group into samples by path without extension
            (``cat/0001.jpg`` + ``cat/0001.json`` -> key ``cat/0001``); ``label_from_dir`` adds
            ``cls`` from the first-level folder name
    jsonl   one JSON object per line: ``__key__`` plus fields; a field holding
            ``{"$file": "path"}`` embeds that file (relative to the JSONL file)
    shards  existing tar shards (a packed dataset root, a .tar URL, a brace pattern or a glob)
    parquet a .parquet file, a glob of them, or a directory of them (detected when every file in it
            is one): a row per sample, columns as fields by type (``write/parquet.py``); rows of
            one row group load together (``load_items``)

An item is ``(where, payload)``; ``load_item`` turns it into ``(key, {ext: bytes})`` or raises
SourceError naming ``where``. A local tree's items hold plain paths (``("local", ...)``, read by
``localfiles`` with no filesystem object); a remote tree's hold its root's URL (``("dir", ...)``).

Listing and loading follow a ``StorageConfig`` (``list_source(config=)``, and in the processes that
load, ``set_worker_storage_options(options, config)``): every listing, probe and read of remote
storage is one try per call under shardstream's retry policy (``storage_call``, ``expand_retried``;
shard ranges through ``storage.ranges``), so an unreachable source fails within ``config.deadline`` with the tries and
time it took, and a shards source's manifest may list shards under ``config.allow_roots``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from shardstream.errors import ConfigError, SourceError
from shardstream.format.compression import decompressing, shard_compression
from shardstream.format.manifest import load_manifest
from shardstream.format.scan import scan_shard
from shardstream.format.tar import iter_samples, split_name
from shardstream.storage import fs as storage
from shardstream.storage.classify import release_frames
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig
from shardstream.storage.fs import expand_retried, storage_call
from shardstream.storage.ranges import open_object, open_range
from shardstream.storage.urls import canonical_url, is_shard_pattern
from shardstream.write.encode import check_key, encode_value
from shardstream.write.localfiles import load_local, printable, read_error, read_local, special_kind
from shardstream.write.parquet import group_of, is_parquet_source, list_parquet, load_group

Item = tuple[str, tuple]


def _is_file(fs, path: str) -> bool:
    if storage.is_local(fs):
        return fs.isfile(path)
    try:  # not fs.isfile, which answers False for any failure (an unreachable endpoint too)
        return fs.info(path)["type"] == "file"
    except FileNotFoundError as exc:
        release_frames(exc)  # (s3fs's error holds the callers' frames in a cycle)
        return False


def detect_kind(src: str, storage_options: Mapping[str, Any] | None = None, config: StorageConfig = DEFAULT_STORAGE) -> str:
    if src.endswith(".jsonl") or src.endswith(".jsonl.gz"):
        return "jsonl"
    if is_parquet_source(src):
        return "parquet"
    if is_shard_pattern(src):
        return "shards"
    if storage_call(storage.join(src, "index.json"), _is_file, storage_options, config):
        return "shards"
    return "dir"


class Listing:
    """The items of a source plus what the manifest should know about them."""

    def __init__(self, items: list[Item], label_map: dict[str, int] | None = None, errors: list[tuple[str, str]] | None = None):
        self.items = items
        self.label_map = label_map
        self.errors = errors or []  # (where, what) found while listing
        self.temp: Any = None  # a TemporaryDirectory holding decompressed copies of compressed shards (removed with the listing)
        self.kind = ""  # the source kind listed
        self.hidden = 0  # files left out unread because a part of their path starts with "." (said at the end of pack)


def list_source(
    src: str,
    kind: str = "auto",
    *,
    label_from_dir: bool = False,
    columns: Sequence[str] | None = None,
    key: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    config: StorageConfig = DEFAULT_STORAGE,
    allow_outside: Sequence[str] = (),
) -> Listing:
    """The items of ``src`` (see the module docstring), listed under ``config``: its retry policy
    and deadline for every listing and read, its ``allow_roots`` for a shards source's manifest.
    ``columns`` and ``key`` select a Parquet source's columns and name its key column.

    A source reads only inside its own root (a directory tree's folder, a JSONL file's folder or
    bucket prefix): a ``$file`` reference or a symlink that leads elsewhere is a listing error
    (``Listing.errors``: raised or skipped by pack's ``on_error``) unless it lies under one of the
    URL prefixes or folders ``allow_outside`` names."""
    if isinstance(allow_outside, str):
        raise ConfigError("allow_outside is a sequence of folders or URL prefixes, not one string")
    roots = tuple(_root_of(r) for r in allow_outside)
    storage.check_url(src)  # (before index.json is joined to it)
    auto = kind == "auto"
    if auto:
        kind = detect_kind(src, storage_options, config)
    if label_from_dir and kind != "dir":
        raise SourceError(src, "--label-from-dir needs a directory tree source")
    if (columns or key) and kind not in ("parquet", "dir"):
        raise SourceError(src, "--columns and --key apply to a Parquet source")
    listing: Listing | None = None
    if kind == "dir":
        listing = _list_dir(src, label_from_dir, storage_options, config, parquet_ok=auto and not label_from_dir, allow=roots)
        if listing is None:
            kind = "parquet"
        elif columns or key:
            raise SourceError(src, "--columns and --key apply to a Parquet source")
    if kind == "parquet":
        listing = Listing(list_parquet(src, columns=columns, key=key, storage_options=storage_options, config=config))
    elif kind == "jsonl":
        listing = _list_jsonl(src, storage_options, config, allow=roots)
    elif kind == "shards":
        listing = _list_shards(src, storage_options, config)
    if listing is None:
        raise SourceError(src, f"unknown source kind {kind!r}")
    listing.kind = kind
    return listing


# -- the source's root: what a source may read -------------------------------------------------
def _root_of(url: str) -> str:
    """One spelling of a root: canonical (``canonical_url``), a local one with its symlinks resolved."""
    root = canonical_url(url)
    return os.path.realpath(root) if "://" not in root else root


def _under(url: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return url == root or url.startswith(root if root.endswith("/") else root + "/")


def _outside(target: str, root: str, allow: tuple[str, ...]) -> str | None:
    """Why ``target`` (canonical) may not be read from a source rooted at ``root``, or None. A
    local target is judged by where its symlinks lead."""
    if "://" not in target:
        real = os.path.realpath(target)
        if any(_under(real, r) for r in (_root_of(root), *allow)):
            return None
        if any(_under(target, r) for r in (canonical_url(root), *allow)):
            return f"is a symlink to {printable(real)}, outside"
        return "is outside"
    if any(_under(target, r) for r in (root, *allow)):
        return None
    return "is outside"


# -- directory trees ---------------------------------------------------------------------------
def _local_tree(root: str) -> tuple[list[str], dict[str, str]]:
    """Every file below the local directory ``root``, sorted, as fsspec's ``find`` lists them (a
    symlink is a file, never followed), and for each plain regular file (not a symlink) the real
    path of its folder: ``os.scandir`` gives both without a call per file, where ``fs.find`` made
    one ``stat`` per file and the confinement check one ``realpath`` (a ``lstat`` per part)."""
    files: list[str] = []
    plain: dict[str, str] = {}
    folders = [root]
    while folders:
        folder = folders.pop()
        real = os.path.realpath(folder)
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry.path)
                continue
            files.append(entry.path)
            if entry.is_file(follow_symlinks=False):
                plain[entry.path] = real
    files.sort()
    return files, plain


def _tree(fs, path: str) -> list[str] | str:
    """Every file below the directory ``path``, sorted; else what is wrong with ``path`` as a
    source (a mistyped path is said to be missing, not "not a directory")."""
    if fs.isdir(path):
        return sorted(fs.find(path.rstrip("/")))
    if fs.exists(path):
        return "source is not a directory, a .jsonl file or tar shards"
    return "source does not exist (a directory, a .jsonl file or tar shards)"


def _list_dir(
    src: str, label_from_dir: bool, storage_options, config: StorageConfig, parquet_ok: bool = False, allow: tuple[str, ...] = ()
) -> Listing | None:
    """A directory tree's items; None when ``parquet_ok`` and every file in it is a .parquet file
    (a Parquet source, listed as one). Hidden files are left out and counted; on local disk, a
    file that is not a regular file (FIFO, socket, device), a symlink leading out of the tree (or
    to such a file) and a name that is not UTF-8 are listing errors, found by ``os.stat`` and
    never opened."""
    fs, root = storage.get_fs(src, storage_options, config)  # (names the files: no request)
    local = storage.is_local(fs)
    found: list[str] | str | None = None
    plain: dict[str, str] = {}
    if local and fs.isdir(root):
        try:
            found, plain = _local_tree(root.rstrip("/") or "/")
        except OSError:  # (a folder that cannot be read: said as fsspec's listing says it)
            found = None
    if found is None:
        found = storage_call(src, _tree, storage_options, config)
    if isinstance(found, str):
        raise SourceError(src, found)
    root = root.rstrip("/")
    files: list[str] = found
    real_root = _root_of(root) if local else ""
    if parquet_ok:
        visible = [p for p in files if not _hidden(p[len(root) + 1 :])]
        if visible and all(p.endswith(".parquet") for p in visible):
            return None
    inside: dict[str, bool] = {}  # a folder's real path: under the root (or ``allow``)?
    groups: dict[str, dict[str, str]] = {}
    errors: list[tuple[str, str]] = []
    bad: set[str] = set()
    hidden = 0
    for path in files:
        rel = path[len(root) + 1 :]
        if _hidden(rel):
            hidden += 1  # hidden files and our own partial files
            continue
        if local and not _plainly_inside(path, plain, real_root, allow, inside):
            problem = _local_file_problem(path, root, allow)
            if problem is not None:
                errors.append((printable(path), problem))
                continue
        key, ext = split_name(rel)
        if key is None or ext is None:
            errors.append((storage.full_url(fs, path), "file name has no extension to name its field"))
            continue
        fields = groups.setdefault(key, {})
        if ext in fields:
            errors.append((storage.full_url(fs, path), f"same key {key!r} and extension {ext!r} as {storage.full_url(fs, fields[ext])}"))
            bad.add(key)
            continue
        fields[ext] = path
    label_map = None
    if label_from_dir:
        classes = sorted({k.split("/", 1)[0] for k in groups if "/" in k})
        label_map = {name: i for i, name in enumerate(classes)}
        for key in [k for k in groups if "/" not in k]:
            errors.append((storage.full_url(fs, groups[key][next(iter(groups[key]))]), "file is not inside a class folder (--label-from-dir)"))
            bad.add(key)
    items: list[Item] = []
    for key in sorted(groups):
        if key in bad:
            continue
        fields = groups[key]
        if label_from_dir and "cls" in fields:
            errors.append((storage.full_url(fs, fields["cls"]), "a .cls file clashes with --label-from-dir"))
            continue
        label = label_map[key.split("/", 1)[0]] if label_map is not None else None
        where = storage.full_url(fs, next(iter(fields.values())))
        if local:  # plain paths, read with no filesystem object (``localfiles``: what a lean pack worker loads)
            items.append((where, ("local", key, tuple(sorted(fields.items())), label)))
        else:
            items.append((where, ("dir", src, key, tuple(sorted(fields.items())), label)))
    listing = Listing(items, label_map, errors)
    listing.hidden = hidden
    return listing


def _hidden(rel: str) -> bool:
    """Whether a part of the relative path ``rel`` starts with "."."""
    return rel.startswith(".") or "/." in rel


def _plainly_inside(path: str, plain: dict[str, str], real_root: str, allow: tuple[str, ...], inside: dict[str, bool]) -> bool:
    """True for a plain regular file (``_local_tree``) of a UTF-8 name whose real path (its folder's
    real path and its name) lies under the source's real root or ``allow``: what
    ``_local_file_problem`` finds fine, known without a call. Any other file goes to it. A file's
    real path lies under a root exactly when its folder's does (or is the root): ``inside`` keeps
    that answer per folder, so a folder of many files is checked once."""
    folder = plain.get(path)
    if folder is None:
        return False
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    known = inside.get(folder)
    if known is None:
        real = folder.rstrip("/") or "/"
        known = inside[folder] = any(_under(real, r) for r in (real_root, *allow))
    return known


def _local_file_problem(path: str, root: str, allow: tuple[str, ...]) -> str | None:
    """Why a file of a local tree may not be packed, or None (lstat/stat only: nothing is opened)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "file name is not UTF-8 (a key must be): rename it"
    try:
        # where it really is (a symlink, or a symlinked folder on its way, may lead out of the tree)
        where = _outside(canonical_url(path), root, allow)
        if where is not None:
            return f"{where} the source's root {root}/: not read (pass --allow-outside ROOT to trust it)"
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"cannot stat: {exc.strerror}"
    kind = special_kind(mode)
    return None if kind is None else f"is {kind}, not a regular file: not read"


# -- JSONL ------------------------------------------------------------------------------------
def _list_jsonl(src: str, storage_options, config: StorageConfig, allow: tuple[str, ...] = ()) -> Listing:
    """A JSONL file's items; each ``$file`` reference resolved (relative to the file's folder or
    bucket prefix) and confined to that root or ``allow`` (``_resolve_ref``)."""
    compression = "gzip" if src.endswith(".gz") else None

    def read(fs, path: str) -> list[str]:
        with fs.open(path, "rt", encoding="utf-8", compression=compression) as f:
            return f.read().splitlines()

    try:
        lines = storage_call(src, read, storage_options, config)
    except (FileNotFoundError, PermissionError, UnicodeDecodeError) as exc:
        raise SourceError(src, f"cannot read: {exc}") from exc
    base = src.rsplit("/", 1)[0] if "/" in src else "."
    root = canonical_url(base)
    items: list[Item] = []
    errors: list[tuple[str, str]] = []
    for lineno, line in enumerate(lines, 1):
        where = f"{src}:{lineno}"
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append((where, f"malformed JSON ({exc.msg} at column {exc.colno})"))
            continue
        if not isinstance(record, dict):
            errors.append((where, "line is not a JSON object"))
            continue
        key = record.pop("__key__", f"{lineno:09d}")
        if not isinstance(key, str):
            errors.append((where, "__key__ must be a string"))
            continue
        try:
            check_key(key, where)
            for ext, value in record.items():
                if isinstance(value, dict) and set(value) == {"$file"}:
                    record[ext] = {"$file": _resolve_ref(value["$file"], ext, base, root, allow)}
        except SourceError as exc:
            errors.append((where, exc.what))
            continue
        items.append((where, ("jsonl", base, key, json.dumps(record))))
    return Listing(items, None, errors)


def _resolve_ref(ref: Any, ext: str, base: str, root: str, allow: tuple[str, ...]) -> str:
    """The URL a ``$file`` reference names, if it lies inside the JSONL file's ``root`` (or under
    ``allow``); else a SourceError saying why. A caption file from a third party must not copy
    local or private data (``/etc/passwd``, ``../``, ``file://``, another bucket) into a dataset."""
    if not isinstance(ref, str) or not ref:
        raise SourceError("", f"field {ext!r}: $file must be a non-empty string")
    absolute = "://" in ref or ref.startswith(("/", "~", "\\"))
    target = canonical_url(ref if absolute else storage.join(base, ref))
    if "://" not in root and "://" not in target:
        pass  # both local: judged below by where the symlinks lead
    elif ("://" in root) != ("://" in target) and not any(_under(target, r) for r in allow):
        how = "a file:// URL" if ref.startswith("file://") else ("a local path" if "://" not in target else "a remote URL")
        raise SourceError(
            "",
            f"field {ext!r}: $file {printable(ref)!r} is {how}, outside the source's root {root}/: not read (pass --allow-outside ROOT to trust it)",
        )
    why = _outside(target, root, allow)
    if why is not None:
        how = "a file:// URL" if ref.startswith("file://") else "an absolute path or URL" if absolute else "a path that climbs out with '..'"
        if why.startswith("is a symlink"):
            how = why.removesuffix(", outside")
        raise SourceError(
            "",
            f"field {ext!r}: $file {printable(ref)!r} ({how}) is outside the source's root {root}/: not read (pass --allow-outside ROOT to trust it)",
        )
    return target


# -- existing shards ---------------------------------------------------------------------------
def _list_shards(src: str, storage_options, config: StorageConfig) -> Listing:
    """Items of existing shards: one (url, start, end) byte range per sample. A compressed shard
    cannot be read by byte range, so it is decompressed once into a local temporary plain tar
    that the items point to (removed when the listing is dropped). A dataset root's manifest is
    confined to its root and ``config.allow_roots`` (``load_manifest``)."""
    items: list[Item] = []
    listing = Listing(items)

    def add(url: str, offsets: list[int] | None = None) -> None:
        source = url
        if shard_compression(url):
            source = _decompressed_copy(url, storage_options, listing, config)
            offsets = None  # offsets of the copy are those of the decompressed stream: scanned below
        if offsets is None:
            offsets = list(scan_shard(source, storage_options if source == url else None, config=config).offsets or ())
        for j in range(len(offsets) - 1):
            items.append((f"{url} sample #{j}", ("tar", source, offsets[j], offsets[j + 1])))

    if not is_shard_pattern(src):
        manifest = load_manifest(src, storage_options, config=config)
        for i in range(len(manifest.paths)):
            url = manifest.shard_url(i)
            add(url, None if shard_compression(url) else manifest.offsets(i).tolist())
        listing.label_map = manifest.label_map
        return listing
    urls = expand_retried(src, storage_options, config)
    if not urls:
        raise SourceError(src, "no shards match")
    for url in urls:
        add(url)
    return listing


def _decompressed_copy(url: str, storage_options, listing: Listing, config: StorageConfig) -> str:
    if listing.temp is None:
        listing.temp = tempfile.TemporaryDirectory(prefix="shardstream-unpacked-")
    target = os.path.join(listing.temp.name, f"{len(os.listdir(listing.temp.name)):06d}.tar")
    try:
        _, raw, close = open_object(url, storage_options, config=config)  # retried and resumed under config
    except FileNotFoundError:
        raise SourceError(url, "shard not found") from None
    try:
        with open(target, "wb") as out:
            read = decompressing(raw, url, shard_compression(url) or "")
            while chunk := read(8 << 20):
                out.write(chunk)
    finally:
        close()
    return target


# -- loading (runs in worker processes) ---------------------------------------------------------
_STORAGE_OPTIONS: dict[str, Any] = {}
_STORAGE_CONFIG: list[StorageConfig] = [DEFAULT_STORAGE]
_FILESYSTEMS: dict[str, Any] = {}  # a source root's filesystem, resolved once (under the options above)


def set_worker_storage_options(options: Mapping[str, Any] | None, config: StorageConfig = DEFAULT_STORAGE) -> None:
    """The storage options and policy ``load_item`` reads with, in this process."""
    _STORAGE_OPTIONS.clear()
    _STORAGE_OPTIONS.update(options or {})
    _STORAGE_CONFIG[0] = config
    _FILESYSTEMS.clear()


def _fs_of(root: str) -> Any:
    """The filesystem of a source root, resolved once per root: resolving it (fsspec's
    ``url_to_fs``) for every file was 60% of loading a small file."""
    fs = _FILESYSTEMS.get(root)
    if fs is None:
        fs = _FILESYSTEMS[root] = storage.get_fs(root, _STORAGE_OPTIONS, _STORAGE_CONFIG[0])[0]
    return fs


def load_items(items: Sequence[Item]) -> Iterator[tuple[bool, str, Any]]:
    """Load items in order: ``(True, key, fields)`` or ``(False, where, what)`` each. Consecutive
    items of one group (a Parquet row group's span) are loaded together, with one read."""
    i = 0
    while i < len(items):
        group = group_of(items[i][1])
        if group is None:
            try:
                key, fields = load_item(items[i])
                yield True, key, fields
            except SourceError as exc:
                yield False, exc.where, exc.what
            i += 1
            continue
        j = i + 1
        while j < len(items) and group_of(items[j][1]) == group:
            j += 1
        yield from load_group(items[i:j], _STORAGE_OPTIONS, _STORAGE_CONFIG[0])
        i = j


def batches_of(items: Sequence[Item], singles: int = 16) -> list[Sequence[Item]]:
    """``items`` cut for a pool: a group's items together (one read), other items ``singles`` at a time."""
    out: list[Sequence[Item]] = []
    i = 0
    while i < len(items):
        group = group_of(items[i][1])
        j = i + 1
        while j < len(items) and j - i < (len(items) if group is not None else singles) and group_of(items[j][1]) == group:
            j += 1
        out.append(items[i:j])
        i = j
    return out


def load_item(item: Item) -> tuple[str, dict[str, bytes]]:
    where, payload = item
    kind = payload[0]
    if kind == "parquet":
        ((ok, a, b),) = load_group([item], _STORAGE_OPTIONS, _STORAGE_CONFIG[0])
        if not ok:
            raise SourceError(a, b)
        return a, b
    if kind == "local":
        return load_local(where, payload)
    try:
        if kind == "dir":
            return _load_dir(payload)
        if kind == "jsonl":
            return _load_jsonl(where, payload)
        if kind == "tar":
            return _load_tar(payload)
    except SourceError:
        raise
    except (OSError, ValueError, TypeError) as exc:
        raise SourceError(where, f"{type(exc).__name__}: {exc}") from exc
    raise SourceError(where, f"unknown item kind {kind!r}")


def _cat(fs, path: str) -> bytes:
    if storage.is_local(fs):
        return read_local(path)
    return fs.cat_file(path)


def _read_file(url: str, where: str, fs=None) -> bytes:
    """A whole file's bytes; ``fs``: a local filesystem ``url`` is a path on (no URL to resolve)."""
    try:
        if fs is not None and storage.is_local(fs):
            return _cat(fs, url)
        return storage_call(url, _cat, _STORAGE_OPTIONS, _STORAGE_CONFIG[0])
    except OSError as exc:
        error = read_error(exc, url, where)
        if error is None:
            raise
        raise error from None


def _load_dir(payload) -> tuple[str, dict[str, bytes]]:
    _, src, key, files, label = payload
    fs = _fs_of(src)  # (names the files: no request)
    fields = {ext: _read_file(storage.full_url(fs, path), storage.full_url(fs, path), fs) for ext, path in files}
    if label is not None:
        fields["cls"] = str(label).encode("ascii")
    return key, fields


def _load_jsonl(where: str, payload) -> tuple[str, dict[str, bytes]]:
    _, base, key, text = payload
    record = json.loads(text)
    fields: dict[str, bytes] = {}
    for ext, value in record.items():
        if ext.startswith("_"):
            continue
        if not ext or "/" in ext:
            raise SourceError(where, f"field name {ext!r} is not an extension")
        if isinstance(value, dict) and set(value) == {"$file"}:
            ref = value["$file"]
            url = ref if ("://" in ref or ref.startswith("/")) else storage.join(base, ref)
            local = "://" not in url and "://" not in base  # a local path: the base's filesystem, resolved once
            fields[ext.lower()] = _read_file(url, f"{where} field {ext!r}", _fs_of(base) if local else None)
            continue
        try:
            fields[ext.lower()] = encode_value(ext.lower(), value)
        except (TypeError, ValueError) as exc:
            raise SourceError(where, f"field {ext!r}: {exc}") from exc
    if not fields:
        raise SourceError(where, "no fields")
    return key, fields


def _load_tar(payload) -> tuple[str, dict[str, bytes]]:
    _, url, start, end = payload
    read_range, close = open_range(url, start, end, _STORAGE_OPTIONS, config=_STORAGE_CONFIG[0], hint="")  # retried and resumed under config
    parts = []
    left = end - start
    try:
        while left > 0 and (chunk := read_range(left)):  # (a local file's reader runs on to its end: ask for no more)
            parts.append(bytes(chunk))
            left -= len(chunk)
    finally:
        close()
    data = b"".join(parts)
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        chunk = data[pos : pos + n]
        pos += len(chunk)
        return chunk

    samples = list(iter_samples(read, url=url, start=start, end=end))
    if len(samples) != 1:
        raise SourceError(f"{url} at byte {start}", f"expected one sample in the range, found {len(samples)}")
    key, _, _, fields = samples[0]
    return key, fields
