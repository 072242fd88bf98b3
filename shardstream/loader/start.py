"""How a loader's worker processes start: the start method, and what is checked before any starts.

``fork()`` copies one thread of a process that may have many: a child forked while another thread
holds a lock (OpenMP's, CUDA's, an allocator's) can deadlock before it runs a line of Python. So
worker processes start from ``forkserver`` by default (Python 3.14's default on Linux): a
single-threaded server forks each worker, which receives the dataset pickled (what it cannot import
goes by value: portable.py). The server preloads torch and shardstream (multiprocessing's public
``set_forkserver_preload``), so a worker starts without importing them. ``fork`` and ``spawn`` are
there when asked for. Workers that are not forked import the main script again (as
``__mp_main__``): a script whose loader starts outside ``if __name__ == "__main__":`` is told so
before any worker starts, instead of failing in every worker.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import multiprocessing
import os
import pickle
import sys
from typing import Any

from shardstream.errors import ConfigError

logger = logging.getLogger(__name__)

START_METHODS = ("auto", "fork", "forkserver", "spawn")
ENV_START_METHOD = "SHARDSTREAM_START_METHOD"  # read by make_loader when start_method="auto"
PRELOAD = ("torch", "numpy", "shardstream.loader.procs")
# Preloaded as well where a loader over object storage asks first: the S3 client's modules, which
# each new worker would otherwise import at its first read (botocore's credential chain 0.3-0.8 s).
REMOTE_PRELOAD = ("botocore.session", "botocore.credentials", "obstore.store")
_preload: list[str] = list(PRELOAD)


def resolve_start_method(start_method: str) -> tuple[str, str]:
    """(the start method, why) for ``make_loader``'s ``start_method``: ``"auto"`` is ``forkserver``
    unless ``SHARDSTREAM_START_METHOD`` names another (read by each loader); a method asked for is given."""
    if start_method not in START_METHODS:
        raise ConfigError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
    method, why = start_method, "asked for"
    if start_method == "auto":
        asked = os.environ.get(ENV_START_METHOD, "").strip()
        if asked and asked not in START_METHODS[1:]:
            raise ConfigError(f"{ENV_START_METHOD} must be one of {', '.join(START_METHODS[1:])}, got {asked!r}")
        method, why = (asked, f"{ENV_START_METHOD}={asked}") if asked else ("forkserver", "the default: no fork of a process that has threads")
    if method == "fork" and not hasattr(os, "fork"):
        raise ConfigError("start_method='fork': this platform has no fork()")
    return method, why


def context(method: str, remote: bool = False) -> Any:
    """The multiprocessing context for ``method``; a forkserver's server (not started yet) preloads
    torch and shardstream, and the S3 client's modules where a loader reads remote data (it makes no
    request: its children make their own clients)."""
    if method == "forkserver":
        if remote:
            _preload.extend(m for m in REMOTE_PRELOAD if m not in _preload)
        multiprocessing.set_forkserver_preload(list(_preload))
    return multiprocessing.get_context(method)


def check_picklable(method: str, why: str, **parts: Any) -> None:
    """Workers that are not forked receive the dataset and the loader's functions pickled: say which
    part cannot be, and what to do, before any worker starts."""
    for name, obj in parts.items():
        if obj is None:
            continue
        try:
            pickle.dumps(obj)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"the loader's worker processes start with {method!r} here ({why}), so the {name} is sent to them pickled, and it "
                f"cannot be: {exc}. An object that holds an open file, a lock, a socket or a generator cannot travel: "
                f"create it in the transform (or in worker_init_fn) instead, or pass start_method='fork' to make_loader"
            ) from exc


def main_without_file() -> None:
    """``python -`` sets ``__main__.__file__`` to ``"<stdin>"``, which every worker that is not
    forked would try to run as the main script (FileNotFoundError before it starts): such a main is
    treated as ``python -c``'s, which has no ``__file__``; the attribute is removed, once."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str) or getattr(main, "__spec__", None) is not None:
        return
    if not os.path.isfile(path):
        logger.debug("shardstream: __main__.__file__ %r names no file (python -): removed, as for python -c", path)
        del main.__file__


def check_main_guarded(method: str) -> None:
    """ConfigError when workers that start with ``method`` (forkserver, spawn) are about to start
    from the main script's top level, outside ``if __name__ == "__main__":``: each would import the
    script again, run that code and fail starting workers of its own. An unreadable script is not judged."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:  # an interactive session, python -c: nothing is imported again
        return
    line = _main_line(path, vars(main))
    if line is None:  # called from a function the script's guard (or another module) called
        return
    guards = _main_guards(path)
    if guards is None or any(first <= line <= last for first, last in guards):
        return
    raise ConfigError(
        f"{path}, line {line}: worker processes start here from the script's top level, and a worker started with "
        f"{method} imports the script again and would run this code too (then fail starting workers of its own): "
        f"add `if __name__ == '__main__':` around your training code (workers start from {method} here, see docs/training.md)"
    )


def _main_line(path: str, main_globals: dict[str, Any]) -> int | None:
    """The line of the main script's top level this call comes from, None if from inside a function.
    The frame is let go before returning: one held in its own function's local is a reference cycle
    that keeps the callers' frames (the loader, its workers) until the next garbage collection."""
    frame = inspect.currentframe()
    try:
        while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is main_globals and frame.f_code.co_filename == path):
            frame = frame.f_back
        return frame.f_lineno if frame is not None else None
    finally:
        del frame


@functools.lru_cache(maxsize=8)
def _main_guards(path: str) -> tuple[tuple[int, int], ...] | None:
    """The line ranges of the script's top-level ``if __name__ == "__main__":`` blocks (None:
    unreadable or not Python), read once per script."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    return tuple((n.lineno, n.end_lineno or n.lineno) for n in tree.body if isinstance(n, ast.If) and _tests_main(n.test))


def _tests_main(test: ast.expr) -> bool:
    """Whether an ``if`` test compares ``__name__`` with ``"__main__"`` (either way round, maybe within an and/or)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(isinstance(p, ast.Name) and p.id == "__name__" for p in parts) and any(
                isinstance(p, ast.Constant) and p.value == "__main__" for p in parts
            ):
                return True
    return False
