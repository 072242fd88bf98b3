"""Every private name of multiprocessing and s3fs that shardstream uses, here: four, each essential.

``NAMES`` says what each reaches and why no public way does it. A name is looked up at its first
use: where a release has removed or renamed it, the use raises ``PrivateNameGone`` naming it and
the versions installed, not an ``AttributeError`` deep in a worker. ``check()`` resolves them all
(tests/test_private.py, on every combination of .ci/matrix). multiprocessing's undocumented names
without an underscore count too. Nothing of torch's is used, and no function of torch,
multiprocessing or the C library is replaced or wrapped (loader/ is built on public parts).
"""

from __future__ import annotations

import importlib
import platform
import sys
from typing import Any

from shardstream.errors import ShardstreamError


class PrivateNameGone(ShardstreamError, RuntimeError):
    """A private name shardstream relies on is missing from the installed torch, Python or library."""


# name -> (module, dotted attribute path, why no public way exists)
NAMES: dict[str, tuple[str, str, str]] = {
    "multiprocessing.context.get_spawning_popen": (
        "multiprocessing.context",
        "get_spawning_popen",
        "whether an object is being pickled for a new process (its shared counters and lock travel) or copied "
        "(pickle, deepcopy: a copy of its own); pickle offers no way to tell",
    ),
    "multiprocessing.reduction.DupFd": (
        "multiprocessing.reduction",
        "DupFd",
        "a file descriptor pickled for a new process as it starts (the epoch clock's lock, shared.py): the one way to "
        "hand a descriptor to a spawned or forkserver process through its start",
    ),
    # s3fs, fsspec
    "s3fs.S3FileSystem._call_s3": (
        "s3fs",
        "S3FileSystem._call_s3",
        "s3fs's GET with its retries and error mapping, on its own client (a ranged GET with our own deadline)",
    ),
    "s3fs.S3FileSystem._cache": ("s3fs", "S3FileSystem._cache", "fsspec's instance cache, held across a fork so a worker's copy is not finalized"),
}

_resolved: dict[str, Any] = {}


def gone(name: str, detail: str = "") -> PrivateNameGone:
    parts = [f"Python {platform.python_version()}"]
    parts += [f"{m} {getattr(sys.modules[m], '__version__', '?')}" for m in ("torch", "s3fs", "botocore") if m in sys.modules]
    return PrivateNameGone(
        f"shardstream relies on {name} ({NAMES[name][2] if name in NAMES else ''}), which this installation lacks"
        f"{': ' + detail if detail else ''} ({', '.join(parts)}); install a supported version (see pyproject.toml) or report it"
    )


def resolve(name: str) -> Any:
    """The object ``name`` of NAMES stands for, looked up once (``PrivateNameGone`` if missing)."""
    if name not in _resolved:
        module, path, _ = NAMES[name]
        try:
            obj: Any = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise gone(name, str(exc)) from None
        _resolved[name] = obj
    return _resolved[name]


# -- multiprocessing --------------------------------------------------------------------------------
def spawning() -> bool:
    """Whether this thread pickles for a new process's start (spawn, forkserver), not a copy."""
    return resolve("multiprocessing.context.get_spawning_popen")() is not None


def dup_fd(fd: int) -> Any:
    """``fd`` for the new process being pickled for: its ``detach()`` there is the same open file."""
    return resolve("multiprocessing.reduction.DupFd")(fd)


# -- s3fs, fsspec ----------------------------------------------------------------------------------
async def s3_call(fs: Any, method: str, **params: Any) -> Any:
    resolve("s3fs.S3FileSystem._call_s3")
    return await fs._call_s3(method, **params)


def cached_s3_filesystems(s3fs: Any) -> list[Any]:
    return list(getattr(s3fs.S3FileSystem, "_cache", {}).values())


def check() -> list[str]:
    for name in NAMES:
        resolve(name)
    return list(NAMES)
