"""Hand batches to the GPU: copy the next batch on a side CUDA stream while the current one trains.

Rules followed: copies are ``non_blocking`` from pinned memory on a dedicated stream; before a
batch is used the consumer's stream waits on the copy stream; every tensor is
``record_stream``-ed on the consumer's stream so the caching allocator does not reuse its memory
while kernels still read it. Elsewhere batches are moved as they come (a copy there is not
asynchronous), unless ``copy_ahead=1`` asks for the same one-batch copy-ahead anyway.

The batch held copied ahead was received from the loader but not yet by the training loop, so
``state_dict`` asks the loader for its state one batch earlier (``loader.state_dict(batches=)``):
the held batch is delivered again after a resume, whatever the state holds (one dataset or a mix).

A device this machine does not have (``"cuda"`` under a CPU-only torch or with no GPU visible,
``"cuda:3"`` with two) is refused when ``to_device`` is called, by one ``ConfigError`` naming it and
the devices there are, not by torch's error at the first copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from shardstream.errors import ConfigError


def move_to(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``obj`` with every tensor in it moved to ``device``: tensors at any depth of dicts (and other
    mappings), lists, tuples and namedtuples, the containers rebuilt as their own types; any other
    value (strings, numbers, bytes, arrays) is left as it is. A container with no tensor in it is
    returned as is, not copied."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (str, bytes, bytearray, int, float, bool, type(None))):
        return obj
    if isinstance(obj, Mapping):
        moved = {k: move_to(v, device, non_blocking) for k, v in obj.items()}
        if all(moved[k] is v for k, v in obj.items()):
            return obj
        if type(obj) is dict:
            return moved
        try:
            return type(obj)(moved)  # type: ignore[call-arg]  # OrderedDict and the like; a plain dict where the type will not take one
        except TypeError:
            return moved
    if isinstance(obj, (list, tuple)):
        items = [move_to(v, device, non_blocking) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if hasattr(obj, "_fields"):  # a namedtuple: its fields, positionally
            return type(obj)(*items)
        if type(obj) in (list, tuple):
            return type(obj)(items)
        try:
            return type(obj)(items)
        except TypeError:
            return items if isinstance(obj, list) else tuple(items)
    return obj


# Accelerator kinds torch can say are there: (type, is_available, device_count).
def _kinds() -> list[tuple[str, Any, Any]]:
    kinds = [("cuda", torch.cuda.is_available, torch.cuda.device_count)]
    xpu = getattr(torch, "xpu", None)
    if xpu is not None:
        kinds.append(("xpu", xpu.is_available, xpu.device_count))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None:
        kinds.append(("mps", mps.is_available, lambda: 1))
    return kinds


def available_devices() -> list[str]:
    """The devices batches can be moved to here: "cpu" and each accelerator torch sees."""
    found = ["cpu"]
    for kind, is_available, count in _kinds():
        if is_available():
            found += [kind] if kind == "mps" else [f"{kind}:{i}" for i in range(count())]
    return found


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, or ConfigError where this machine has no such device."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"to_device: {device!r} is not a device ({exc}); available here: {', '.join(available_devices())}") from None
    for kind, is_available, count in _kinds():
        if dev.type != kind:
            continue
        if not is_available():
            why = (
                f"this torch ({torch.__version__}) is built without CUDA"
                if kind == "cuda" and torch.version.cuda is None and torch.version.hip is None
                else f"no {kind} device is visible"
            )
        elif dev.index is not None and dev.index >= count():
            why = f"{count()} {kind} device(s) visible"
        else:
            break
        raise ConfigError(f"to_device: no device {str(dev)!r} here ({why}); available: {', '.join(available_devices())}")
    return dev


def _record(obj: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(obj, torch.Tensor):
        obj.record_stream(stream)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _record(v, stream)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _record(v, stream)


class DevicePrefetcher:
    """Iterate ``loader`` with each batch already on ``device``; ``copy_ahead`` batches (0 or 1)
    copied ahead: by default 1 on CUDA, 0 elsewhere."""

    def __init__(self, loader: Iterable[Any], device: str | torch.device, copy_ahead: int | None = None):
        self.loader = loader
        self.device = check_device(device)
        if copy_ahead not in (None, 0, 1):
            raise ValueError(f"copy_ahead is 0 or 1 batches, got {copy_ahead!r}")
        self.copy_ahead = (1 if self.device.type == "cuda" else 0) if copy_ahead is None else copy_ahead
        self._held = 0  # batches taken from the loader but not yet yielded

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def remaining(self) -> int:
        """The loader's ``remaining``, with the batch copied ahead and not yet yielded still to come."""
        return self.loader.remaining + self._held  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        """The loader's state, less the batch copied ahead and not yet handed to the loop (it is
        delivered again after a resume)."""
        loader: Any = self.loader
        if self._held:
            return loader.state_dict(batches=loader.received - self._held)
        return loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        if not self.copy_ahead:
            for batch in self.loader:
                yield move_to(batch, self.device)
            return
        cuda = self.device.type == "cuda"
        copy_stream = torch.cuda.Stream(self.device) if cuda else None
        it = iter(self.loader)

        def preload():
            try:
                batch = next(it)
            except StopIteration:
                return None, False
            with torch.cuda.stream(copy_stream) if copy_stream is not None else contextlib.nullcontext():
                return move_to(batch, self.device, non_blocking=cuda), True

        nxt, more = preload()
        try:
            while more:
                batch = nxt
                if copy_stream is not None:
                    compute = torch.cuda.current_stream(self.device)
                    compute.wait_stream(copy_stream)
                    _record(batch, compute)
                nxt, more = preload()  # the next copy overlaps the caller's work on this batch
                self._held = int(more)
                yield batch
        finally:
            self._held = 0


def to_device(loader: Iterable[Any], device: str | torch.device, copy_ahead: int | None = None) -> DevicePrefetcher:
    """``for batch in to_device(loader, "cuda"):`` batches arrive on the device, copied ahead."""
    return DevicePrefetcher(loader, device, copy_ahead)
