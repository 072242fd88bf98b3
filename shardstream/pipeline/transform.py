"""The user's transform over lists of samples, and seeded per-sample randomness for decoders and
transforms that ask for it (``bind_sample``).

Record shape in: lists of decoded samples. Out: lists of whatever the transform returns (None drops
the sample, counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from shardstream.errors import SampleError
from shardstream.policy import ErrorPolicy


def sample_name(sample: Mapping[str, Any]) -> str:
    """Shard file name and key: the same wherever the dataset is stored."""
    url = str(sample.get("__url__", ""))
    return f"{url.rsplit('/', 1)[-1]}/{sample.get('__key__', '')}"


def bind_per_sample(decoder: Callable[[dict], dict], transform: Callable[[dict], Any] | None):
    """Decoders and transforms with ``bind_sample(name)`` (seeded augmentation) get the sample's
    name before each call, so their randomness is a function of (seed, epoch, sample): the same
    after a resume and under any topology."""
    keyed = [fn for fn in getattr(decoder, "decoders", {}).values() if hasattr(fn, "bind_sample")]
    if keyed:
        inner = decoder

        def decoder(sample: dict) -> dict:
            name = sample_name(sample)
            for fn in keyed:
                fn.bind_sample(name)
            return inner(sample)

    if transform is not None and hasattr(transform, "bind_sample"):
        bound, plain = transform, transform

        def transform(sample: dict) -> Any:
            bound.bind_sample(sample_name(sample))
            return plain(sample)

    return decoder, transform


def transform_samples(
    chunks: Iterable[list[dict[str, Any]]], transform: Callable[[dict[str, Any]], Any], counters: Any, filtered: list[int], policy: ErrorPolicy
) -> Iterator[list[Any]]:
    """Apply the user's transform to lists of samples; a None result drops the sample (counted).
        A transform that raises fails its sample under the user's policy, as a decode error does: a
        SampleError naming the shard and key, raised, or skipped, counted and logged (``policy``, with
        its tolerance of consecutive failures counted across chunks here). The time spent in it is
    counted (``transform_us``), a list at a time."""
    run = 0  # consecutive samples whose transform failed
    for chunk in chunks:
        began = time.perf_counter()
        out = []
        for x in chunk:
            url, key = x.get("__url__", "?"), x.get("__key__", "?")  # before the transform changes the sample
            valid = x.get("__valid__")  # pad mode's mark: kept on a dict the transform returns without it
            try:
                y = transform(x)
                if valid is not None and isinstance(y, dict) and "__valid__" not in y:
                    y["__valid__"] = valid
                out.append(y)
            except Exception as exc:  # noqa: BLE001 - the user's transform: its failure goes to the error policy, named
                error = exc if isinstance(exc, SampleError) else SampleError(url, key, f"transform failed: {type(exc).__name__}: {exc}")
                if error is not exc:
                    error.__cause__ = exc  # raise ... from exc
                run += 1
                policy.failed(error, consecutive=run)
                continue
            run = 0
        counters.add("transform_us", int((time.perf_counter() - began) * 1e6))
        kept = [y for y in out if y is not None]
        if len(kept) != len(out):
            counters.add("samples_filtered", len(out) - len(kept))
            filtered[0] += len(out) - len(kept)
        if kept:
            yield kept
