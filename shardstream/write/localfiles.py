"""The files of a local directory tree, read for pack: one item is a sample's files by extension.

A local tree lists (``sources._list_dir``) as ``("local", key, ((ext, path), ...), label)`` items
of plain paths, so loading one is a few ``os`` calls: no URL to resolve, no filesystem object,
nothing imported but ``shardstream.errors`` (a pack worker that loads them starts for a fraction
of the CPU of one that imports the storage layer, ``write/loading.py``).

A FIFO, socket or device is refused by ``os.stat`` before it is opened, and again by ``fstat`` of
what was opened (without blocking: a FIFO swapped in between cannot hang the read). A file that
cannot be read is a SourceError naming it, the same words as a remote tree's (``sources``).
"""

from __future__ import annotations

import os
import stat

from shardstream.errors import SourceError


class NotRegular(OSError):
    """A local path that is not a regular file (found by stat, before or right after opening)."""


def special_kind(mode: int) -> str | None:
    """What a file that is not a regular file is ("a FIFO", "a socket", ...), None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file"


def printable(path: str) -> str:
    """A path as a message can print it: a name that is not UTF-8 (held with surrogate escapes)
    with its undecodable bytes as ``\\xNN``."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return os.fsencode(path).decode("utf-8", "backslashreplace")


def read_local(path: str) -> bytes:
    """A local regular file's bytes (NotRegular for anything else, see the module docstring)."""
    kind = special_kind(os.stat(path).st_mode)
    if kind is not None:
        raise NotRegular(f"{kind}, not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    with open(fd, "rb") as f:
        kind = special_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise NotRegular(f"{kind}, not a regular file")
        return f.read()


def read_error(exc: OSError, url: str, where: str) -> SourceError | None:
    """The SourceError a failed read of ``url`` is (for a sample at ``where``), None for others."""
    if isinstance(exc, FileNotFoundError):
        return SourceError(where, f"file not found: {url}")
    if isinstance(exc, PermissionError):
        return SourceError(where, f"permission denied: {url}")
    if isinstance(exc, IsADirectoryError):
        return SourceError(where, f"is a directory: {url}")
    if isinstance(exc, NotRegular):
        return SourceError(where, f"{printable(url)} is {exc}: not read")
    return None


def load_local(where: str, payload: tuple) -> tuple[str, dict[str, bytes]]:
    """A ``("local", key, files, label)`` item's ``(key, {ext: bytes})``; SourceError naming
    ``where`` (or the file) for anything that cannot be read."""
    _, key, files, label = payload
    fields: dict[str, bytes] = {}
    try:
        for ext, path in files:
            try:
                fields[ext] = read_local(path)
            except OSError as exc:
                error = read_error(exc, path, path)
                if error is None:
                    raise
                raise error from None
    except (OSError, ValueError, TypeError) as exc:
        raise SourceError(where, f"{type(exc).__name__}: {exc}") from exc
    if label is not None:
        fields["cls"] = str(label).encode("ascii")
    return key, fields
