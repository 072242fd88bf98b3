"""Objects that reach DataLoader workers started by ``spawn`` or ``forkserver``, wherever the user
defined their functions.

Such a worker receives the dataset pickled, and pickle sends a function or class by reference (its
module and name), which the worker resolves by importing. That fails for what the worker cannot
import: a function or lambda of a Jupyter cell, ``python -``, ``python -c`` (all in a ``__main__``
with no file), a lambda, a closure or a local function anywhere, webdataset's own lambda
decoders. Those are sent by value with cloudpickle instead, as Ray, Dask and loky send them; what
the worker can import still goes by reference.

No pickler is registered process-wide: the loader's own picklable classes (the dataset, its
collate_fn, its worker_init_fn) say in their ``__reduce__`` that their state goes through
``dumps`` here, a subclass of multiprocessing's pickler (so torch's and multiprocessing's own
reductions still apply) whose ``reducer_override`` hands cloudpickle only what plain pickle
could not send. A state that cannot be rebuilt in the worker (a module-level function the worker's
module lacks, a ``__setstate__`` that fails) does not kill the worker before it can speak: it is
rebuilt as a stand-in that raises the worker's own error when used, which the loop then
re-raises in the main process with the worker's traceback.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

import cloudpickle


def by_reference(obj: Any) -> bool:
    """Whether a worker can import ``obj`` (a function or class) by its module and qualified name:
    not in ``__main__`` (which has no file in a notebook, ``python -`` or ``-c``, and whose guarded
    block a worker does not run), not a lambda, a closure's or a local function, and found under
    that name in its module (as pickle itself checks)."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return False
    found = sys.modules.get(module)
    if found is None:
        return False
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found is obj


class _Pickler(ForkingPickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj).__name__ == "Generator" and type(obj).__module__ == "torch._C":
            return _reduce_generator(obj)
        if isinstance(obj, (types.FunctionType, type)) and not by_reference(obj):
            if isinstance(obj, type) and obj.__module__ == "builtins":
                return NotImplemented
            return cloudpickle.loads, (cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),)
        return NotImplemented


def _reduce_generator(gen: Any) -> Any:
    """A CPU ``torch.Generator`` as its state's bytes, for workers that are not forked. torch pickles
    it with its state tensor, which multiprocessing's pickler sends as a shared-memory file that
    the worker then fails to map ("unable to resize file ... Invalid argument"): a transform
    holding a generator (as ``bind`` suggests) killed every forkserver or spawn worker."""
    if gen.device.type != "cpu":
        return gen.__reduce__()
    return _rebuild_generator, (gen.get_state().numpy().tobytes(),)


def _rebuild_generator(state: bytes) -> Any:
    import torch

    gen = torch.Generator()
    gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return gen


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for a worker: by reference what the worker can import, the rest by value."""
    buf = io.BytesIO()
    _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class Unreceived:
    """What a worker has in place of an object whose state it could not rebuild: it raises the
    worker's own error (type and message as the worker saw them) when iterated or called, where
    the worker's loop catches it and hands it to the loop's process."""

    def __init__(self, what: str, error: BaseException):
        self.what, self.error = what, error

    def _raise(self) -> Any:
        raise type(self.error)(*self.error.args) if _rebuildable(self.error) else RuntimeError(str(self.error))

    def __iter__(self) -> Any:
        return self._raise()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._raise()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None  # (the loader's own probes of a worker's dataset: _stats, counters)


def _rebuildable(error: BaseException) -> bool:
    try:
        type(error)(*error.args)
    except Exception:  # noqa: BLE001 - an exception class whose constructor wants other arguments
        return False
    return True


def rebuild(cls: Any, state: bytes) -> Any:
    """In the worker: an instance of ``cls`` with the state ``dumps`` sent, or an ``Unreceived``
    that raises why it could not be rebuilt."""
    try:
        values = pickle.loads(state)
    except Exception as exc:  # noqa: BLE001 - said by the worker, where the loop reports it
        exc.args = (f"{cls.__name__} could not be rebuilt in the worker: {type(exc).__name__}: {exc}",)
        return Unreceived(cls.__name__, exc)
    obj = cls.__new__(cls)
    obj.__dict__.update(values)
    return obj


def reduce_portable(obj: Any) -> tuple[Any, tuple[type, bytes]]:
    """``__reduce__`` for a class whose instances travel to workers with the user's functions."""
    return rebuild, (type(obj), dumps(obj.__dict__))
