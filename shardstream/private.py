"""Every private name of multiprocessing and s3fs that shardstream uses, here: four, each essential.

Each accessor below says what it reaches and why no public way does it. A name is looked up at its
first use and checked then: where a Python or s3fs release has removed or renamed it, the use
raises ``PrivateNameGone`` naming the name and the versions installed, instead of an
``AttributeError`` deep in a worker. ``NAMES`` lists them all; ``check()`` resolves every one (the
suite's tests/test_private.py does, on every combination of the version matrix, .ci/matrix).

Here too: multiprocessing's undocumented names without an underscore (``context.get_spawning_popen``,
``reduction.DupFd``), as undocumented as the others. Nothing of torch's is used, and no function of
torch, multiprocessing or the C library is replaced or wrapped: the loader's workers, their hand-off
and their start are built on public parts (loader/).
"""

from __future__ import annotations

import importlib
import platform
import sys
import threading
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
_lock = threading.Lock()


def versions() -> str:
    """The versions the names depend on, for an error message."""
    parts = [f"Python {platform.python_version()}"]
    for module in ("torch", "s3fs", "botocore"):
        mod = sys.modules.get(module)
        if mod is not None:
            parts.append(f"{module} {getattr(mod, '__version__', '?')}")
    return ", ".join(parts)


def gone(name: str, detail: str = "") -> PrivateNameGone:
    why = NAMES[name][2] if name in NAMES else ""
    return PrivateNameGone(
        f"shardstream relies on {name} ({why}), which this installation lacks{': ' + detail if detail else ''} "
        f"({versions()}); install a supported version (see pyproject.toml) or report it"
    )


def resolve(name: str) -> Any:
    """The object ``name`` of NAMES stands for, looked up once; ``PrivateNameGone`` where it is missing."""
    got = _resolved.get(name)
    if got is not None:
        return got
    module, path, _ = NAMES[name]
    with _lock:
        try:
            obj: Any = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise gone(name, str(exc)) from None
        _resolved[name] = obj
    return obj


# -- multiprocessing --------------------------------------------------------------------------------
def spawning() -> bool:
    """Whether this thread is pickling for a new process's start (spawn, forkserver): what such a
    pickle holds reaches that process only (file descriptors travel with it), where a plain pickle or
    deepcopy shares nothing."""
    return resolve("multiprocessing.context.get_spawning_popen")() is not None


def dup_fd(fd: int) -> Any:
    """``fd`` for the new process being pickled for (``spawning()``): the unpickled object's
    ``detach()`` is a descriptor of the same open file in that process."""
    return resolve("multiprocessing.reduction.DupFd")(fd)


# -- s3fs, fsspec ----------------------------------------------------------------------------------
async def s3_call(fs: Any, method: str, **params: Any) -> Any:
    """An S3 call through s3fs's own client, retries and error mapping."""
    resolve("s3fs.S3FileSystem._call_s3")
    return await fs._call_s3(method, **params)


def cached_s3_filesystems(s3fs: Any) -> list[Any]:
    """The S3 filesystems fsspec's instance cache holds."""
    return list(getattr(s3fs.S3FileSystem, "_cache", {}).values())


def check() -> list[str]:
    """Resolve every module-level name of NAMES; returns the names checked."""
    for name in NAMES:
        resolve(name)
    return list(NAMES)
