"""Group samples into batches of exactly ``batch_size``; the default collate batches dicts, tuples and
lists of tensors, arrays and numbers (nested), like torch's default_collate.

Samples of one batch with different fields (``missing=``, see ``default_collate``): by default
the samples of a mix's different sources may differ, and their batch holds the union of their
fields, each marked where it is missing: ``None`` in a list field, a zero of the right shape and
dtype in a stacked one, and ``batch["__present__"][field]``, a bool tensor (True where the sample
has it) for every field some sample of the batch lacks; ``present(batch, field)`` answers for any
field. Samples of one source (or of a single dataset) that differ are a SampleError: inconsistent
data. A batch whose samples agree pays nothing for this: one key-set comparison per sample, as before.

A worker must yield exactly its planned number of batches (ranks stay in step). If samples were
skipped under the error policy or dropped by the transform (returning None), the last batches are filled by repeating recent good samples;
the number repeated is counted and logged.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from shardstream.buffers import BufferPool, active_pool, batch_buffers
from shardstream.errors import ConfigError, SampleError, TooManyErrors
from shardstream.format.extensions import IMAGE
from shardstream.plan.topology import get_worker_info

logger = logging.getLogger(__name__)

PRESENT = "__present__"  # a union batch's presence masks: {field: bool tensor, True where the sample has it}
MISSING = ("by_source", "union", "error")  # what default_collate does with samples whose fields differ


class Batch(dict):
    """A batch of named fields (a dict). Asking for a field it lacks names the fields it has."""

    __slots__ = ()

    def __missing__(self, name: Any) -> Any:
        raise KeyError(
            f"{name!r}: this batch has fields {sorted(map(str, self))}; a field missing from every "
            f"sample of a batch is not in it (is the extension right? `shardstream show` lists samples; "
            f"in a mix, present(batch, {name!r}) answers for batches without the sources that have it)"
        )


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class _IntOutOfRange(ValueError):
    """An integer leaf that an int64 tensor cannot hold (a uint64 column's value >= 2**63, a Python
    int from a transform): said as a SampleError naming the field and the sample (``_collate_dict``)."""

    def __init__(self, index: int, value: int):
        super().__init__(index, value)
        self.index, self.value = index, value


def _out_of_range(samples: list[Any], name: str, exc: _IntOutOfRange) -> SampleError:
    s = samples[exc.index] if isinstance(samples[exc.index], dict) else {}
    return SampleError(
        s.get("__url__", "?"),
        s.get("__key__", "?"),
        f"field {name!r}: integer {exc.value} does not fit in int64, the dtype per-sample batches give integers "
        "(a uint64 column above 2**63: read the table without a per-sample transform, columnar batches keep uint64, "
        "or convert the value in the transform)",
    )


def _stack_field(samples: list[Any], name: str, values: list[Any]) -> Any:
    try:
        return _stack(values)
    except _IntOutOfRange as exc:
        raise _out_of_range(samples, name, exc) from None


def _stack(values: list[Any]) -> Any:
    """Same-type leaves -> one batched value: tensors and arrays stacked when shapes agree, numbers
    as tensors; anything else (str, bytes, decoded JSON, None) stays a list."""
    import torch

    v = values[0]
    if isinstance(v, torch.Tensor):
        return stack_tensors(values) if all(x.shape == v.shape for x in values) else values
    if isinstance(v, bool):
        return torch.tensor(values, dtype=torch.bool) if all(type(x) is bool for x in values) else values
    if isinstance(v, numbers.Integral):
        # exact-type check first: an ABC isinstance per sample costs ~1 us, a third of the small-sample budget
        ints = all(type(x) is int for x in values) or all(isinstance(x, numbers.Integral) for x in values)
        if not ints:
            return values
        try:
            return torch.tensor(values, dtype=torch.int64)
        except (OverflowError, ValueError, RuntimeError):
            i = next((i for i, x in enumerate(values) if not INT64_MIN <= x <= INT64_MAX), None)
            if i is None:
                raise
            raise _IntOutOfRange(i, values[i]) from None
    if isinstance(v, numbers.Real):
        reals = all(type(x) is float for x in values) or all(isinstance(x, numbers.Real) for x in values)
        return torch.tensor(values, dtype=torch.float64) if reals else values
    if type(v).__module__ == "numpy" and hasattr(v, "shape"):
        return stack_arrays(values) if all(x.shape == v.shape for x in values) else values
    return values


def _collate_dict(samples: list[Any], missing: str = "by_source") -> Batch:
    first = samples[0]
    names = first.keys()
    if not all(s.keys() == names for s in samples):
        return _collate_unlike(samples, missing)
    return Batch({name: _stack_field(samples, name, [s[name] for s in samples]) for name in first})


def _collate_unlike(samples: list[Any], missing: str) -> Batch:
    """Samples whose fields differ: an error (``missing="error"``, or samples of one source under
    ``"by_source"``), else the union of their fields with what is missing marked."""
    if missing == "error":
        _fields_differ(samples)
    if missing == "by_source":
        groups: dict[Any, list[Any]] = {}
        for s in samples:
            groups.setdefault(s.get("__source__"), []).append(s)
        for group in groups.values():
            names = group[0].keys()
            if not all(s.keys() == names for s in group):
                _fields_differ(group)
    every: dict[str, None] = {}
    for s in samples:
        every.update(dict.fromkeys(s))
    out = Batch()
    masks: dict[str, Any] = {}
    for name in every:
        has = [name in s for s in samples]
        if all(has):
            out[name] = _stack_field(samples, name, [s[name] for s in samples])
        else:
            try:
                out[name] = _stack_missing([s.get(name) for s in samples], has)
            except _IntOutOfRange as exc:
                raise _out_of_range(samples, name, exc) from None
            masks[name] = _mask(has)
    out[PRESENT] = masks
    return out


def _mask(has: list[bool]) -> Any:
    import torch

    return torch.tensor(has, dtype=torch.bool)


def _stack_missing(values: list[Any], has: list[bool]) -> Any:
    """A field some samples lack: stacked with a zero of the present values' shape and dtype where
    one is missing (when the present ones stack), else a list with None where one is missing."""
    ref = next(v for v, h in zip(values, has) if h)
    zero = _zero_like(ref)
    if zero is not None:
        filled = [v if h else zero for v, h in zip(values, has)]
        stacked = _stack(filled)
        if stacked is not filled:
            return stacked
    return [v if h else None for v, h in zip(values, has)]


def _zero_like(value: Any) -> Any:
    """A zero of ``value``'s kind (tensor, array, number); None for any other kind."""
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if type(value).__module__ == "numpy" and hasattr(value, "shape"):
        import numpy as np

        return np.zeros_like(value)
    if isinstance(value, numbers.Number):
        try:
            return type(value)()
        except TypeError:
            return None
    return None


def present(batch: Any, field: str) -> Any:
    """Which samples of a (dict) batch have ``field``: a bool tensor, one entry per sample.

    True everywhere for a field every sample has, False everywhere for one none has (a batch of a
    mix holds only the fields of the sources in it), else the batch's ``__present__`` mask. The
    same question for every batch of a mix, whatever sources a batch happens to hold.
    """
    import torch

    masks = batch.get(PRESENT) or {}
    if field in masks:
        return masks[field]
    size = _batch_len(batch)
    return torch.full((size,), field in batch, dtype=torch.bool)


def _batch_len(batch: Any) -> int:
    for name, value in batch.items():
        if name != PRESENT and hasattr(value, "__len__"):
            return len(value)
    raise ConfigError("present(): this batch has no field with a length to count its samples by")


def _fields_differ(samples: list[Any]) -> None:
    """Samples of one batch (of one source) with different fields: which one lacks what, and what to do."""
    every: dict[str, None] = {}
    for s in samples:
        every.update(dict.fromkeys(s))
    for name in every:
        for s in samples:
            if name not in s:
                having = next(x for x in samples if name in x)
                source = s.get("__source__")
                where = f", both from source {source!r}" if source is not None else ""
                images = sorted({name, *(ext for ext in s if ext in IMAGE)}) if name in IMAGE else []
                advice = f"decode=Decode(alias={{'image': {';'.join(images)!r}}}) to read either as one field 'image', or " if len(images) > 1 else ""
                raise SampleError(
                    s.get("__url__", "?"),
                    s.get("__key__", "?"),
                    f"has no field {name!r} while sample {having.get('__key__', '?')!r} of the same batch has it "
                    f"(fields: {sorted(s)}{where}). Samples of one dataset must have the same fields: pass {advice}"
                    f"decode=Decode(required=[{name!r}]) to drop (on_error='skip') or reject samples without it, "
                    f"collate=functools.partial(default_collate, missing='union') to batch the union of the fields "
                    f"(docs/mixing.md), or a transform that fills in or leaves out optional fields",
                )


def _collate_value(values: list[Any], missing: str = "by_source") -> Any:
    v = values[0]
    if isinstance(v, dict):
        return _collate_dict(values, missing)
    if isinstance(v, (tuple, list)):
        return _collate_sequence(values, missing)
    try:
        return _stack(values)
    except _IntOutOfRange as exc:
        raise SampleError("a transform's output", f"#{exc.index} of the batch", f"integer {exc.value} does not fit in int64") from None


def _collate_sequence(samples: list[Any], missing: str = "by_source") -> Any:
    first = samples[0]
    if not all(len(s) == len(first) for s in samples):
        raise ConfigError(
            f"samples of a batch are {type(first).__name__}s of different lengths "
            f"({sorted({len(s) for s in samples})}): return the same structure for every sample, or pass collate="
        )
    columns = [_collate_value(list(col), missing) for col in zip(*samples)]
    if hasattr(first, "_fields"):  # namedtuple
        return type(first)(*columns)
    return tuple(columns) if isinstance(first, tuple) else columns


def default_collate(samples: list[Any], missing: str = "by_source") -> Any:
    """Batch a list of samples of one structure, like torch's default_collate.

    A dict sample (what the decoder gives, and what most transforms return) becomes a ``Batch``
    dict: tensors, numpy arrays and numbers are stacked into tensors (when shapes agree), anything
    else (str, bytes, decoded JSON) comes out as a list, ``__key__`` and ``__url__`` too.
    Tuples and lists (``(image, label)`` for ``model(x, y)``) are batched position by position by
    the same rules, recursively; a bare tensor or number batch is stacked.

    ``missing``: what dict samples of one batch whose fields differ make.
    ``"by_source"`` (the default): samples of a mix's different sources (their ``__source__``
    differs) batch as the union of their fields; samples of one source, or of a single dataset,
    must have the same fields (else a SampleError says which lacks what). ``"union"``: always the
    union (a dataset with optional fields). ``"error"``: never. In a union batch a field some
    samples lack holds ``None`` at their positions (a list field) or a zero of the others' shape
    and dtype (a stacked one), and ``batch["__present__"][field]`` is a bool tensor, True where the
    sample has the field; ``present(batch, field)`` gives that mask for any field of any batch.
    Pass another mode as ``collate=functools.partial(default_collate, missing="union")``.
    """
    if missing not in MISSING:
        raise ConfigError(f"default_collate(missing=...) must be one of {MISSING}, got {missing!r}")
    return _collate_value(samples, missing)


# Batches at least this large are assembled in shared memory when made in a DataLoader worker;
# smaller ones cross the hand-off inline (see loader.pack_batch), where shared memory only costs.
SHARED_MIN_BYTES = 64 * 1024


def _batch_buffer(shape: tuple[int, ...], dtype, nbytes: int):
    """One uninitialised tensor for a whole batch field.

    In a worker process of make_loader's loader it is on a segment of the hand-off's pool, so the
    hand-off sends a descriptor, not the bytes, and a segment is written again once the loop's
    process is done with it (loader/handoff.py). Elsewhere it comes from numpy's
    allocator, which asks the kernel for huge pages on large arrays (``madvise``): filling a fresh
    256 MB batch then takes ~500 page faults instead of ~65,000, about half the CPU time.
    """
    import numpy as np
    import torch

    take = getattr(get_worker_info(), "take", None) if nbytes >= SHARED_MIN_BYTES else None
    if take is not None:
        return torch.from_numpy(take(nbytes)).view(dtype).view(shape)  # on a segment of the worker's pool
    if nbytes >= SHARED_MIN_BYTES and nbytes % torch.empty(0, dtype=dtype).element_size() == 0:
        pool = active_pool()  # the pass's pool: memory of batches nobody holds any more
        memory = pool.take(nbytes) if pool is not None else np.empty(nbytes, np.uint8)
        return torch.from_numpy(memory).view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype)


def stack_tensors(values: list[Any]):
    """``torch.stack`` of same-shape CPU tensors, written straight into one batch buffer
    (shared memory in a worker): each sample's bytes are copied once, into their final place."""
    import torch

    v = values[0]
    if v.device.type != "cpu" or any(x.dtype != v.dtype or x.requires_grad for x in values):
        return torch.stack(values)  # promotion, devices, autograd: torch's own rules, unchanged
    shape = (len(values), *v.shape)
    out = _batch_buffer(shape, v.dtype, len(values) * v.nelement() * v.element_size())
    return torch.stack(values, out=out)


def stack_arrays(values: list[Any]):
    """``torch.from_numpy(np.stack(values))`` of same-shape arrays, written straight into one batch
    buffer (shared memory in a worker)."""
    import numpy as np
    import torch

    v = values[0]
    if any(x.dtype != v.dtype or not x.flags.c_contiguous for x in values) or v.dtype.hasobject or not v.dtype.isnative:
        # numpy's promotion and layout rules (or torch's refusal), unchanged
        return torch.from_numpy(np.stack(values))
    try:
        dtype = torch.from_numpy(np.empty(0, v.dtype)).dtype
    except TypeError:
        return torch.from_numpy(np.stack(values))
    out = _batch_buffer((len(values), *v.shape), dtype, len(values) * v.nbytes)
    np.stack(values, out=out.numpy())
    return out


def finish_upstream(chunks: Iterator[list[dict[str, Any]]], left: int) -> None:
    """Run the upstream stages to their end after the last batch, so that the checks they make
    after their last sample (the manifest's count, the shard's sha256) are not skipped. The
    plan gives each worker exactly its batches' samples, so nothing is normally left."""
    for chunk in chunks:
        left += len(chunk)
    if left:
        logger.debug("%d samples beyond this worker's planned batches were not used", left)


def _repeat(sample: Any) -> Any:
    """A refill's copy of a sample: in pad mode marked ``__valid__=False`` (a repeat, not data)."""
    if isinstance(sample, dict) and "__valid__" in sample:
        return {**sample, "__valid__": False}
    return sample


class BatchStats:
    def __init__(self) -> None:
        self.refilled = 0


def batch_samples(
    chunks: Iterable[list[Any]],
    *,
    batch_size: int,
    num_batches: int,
    collate: Callable[[list[Any]], Any] = default_collate,
    stats: BatchStats | None = None,
    buffers: BufferPool | None = None,
) -> Iterator[Any]:
    """Yield exactly ``num_batches`` collated batches of ``batch_size`` samples. While ``collate``
    runs, the default collate takes batch buffers from ``buffers`` (outside DataLoader workers)."""
    pending: list[dict[str, Any]] = []
    recent: list[dict[str, Any]] = []  # the last full batch: material to refill from
    made = 0
    chunks = iter(chunks)
    for chunk in chunks:
        pending += chunk
        start = 0
        while len(pending) - start >= batch_size:
            recent = pending[start : start + batch_size]
            with batch_buffers(buffers):
                batch = collate(recent)
            yield batch
            start += batch_size
            made += 1
            if made == num_batches:
                finish_upstream(chunks, len(pending) - start)
                return
        del pending[:start]
    if made < num_batches:
        pool = recent + pending
        if not pool:
            raise TooManyErrors(
                f"no sample could be read for this worker: all of its samples failed and were skipped, "
                f"so its {num_batches} batches cannot be filled (see the warnings above for why)"
            )
        missing = (num_batches - made) * batch_size - len(pending)
        if stats is not None:
            stats.refilled += missing
        logger.warning("repeating %d samples to keep %d equal batches (samples were skipped or filtered)", missing, num_batches)
        i = 0
        while made < num_batches:
            pending.append(_repeat(pool[i % len(pool)]))
            i += 1
            if len(pending) == batch_size:
                with batch_buffers(buffers):
                    batch = collate(pending)
                yield batch
                made += 1
                pending = []
