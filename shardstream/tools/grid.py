"""A picture of a batch (``shardstream show URL --grid batch.png``): the first batch as the model
will see it, after decoding and the user's transform, one tile per sample with its key and label.

The batch comes from ``ShardStream`` itself (no shuffling, one rank, no workers), so decoding,
the transform and collation are the ones training uses. Its images are found wherever they are: a
dict batch's image field (by extension first, then any field that holds images), a tuple's first
image-like element, or the batch itself; batched as ``[N, C, H, W]`` (torch's layout: the default
decoder's CHW uint8 tensors) or ``[N, H, W, C]``, ``[N, H, W]`` for grayscale, or a list of
per-sample images (tensors, arrays, PIL images). Values are drawn as they are where they are
uint8, times 255 where they are floats in [0, 1], and otherwise (normalised floats, other integer
ranges) rescaled per tile from its lowest to its highest value. A batch with no image raises
ConfigError naming what each field holds.

Tiles are ``tile`` x ``tile`` pixels (the image fitted inside, aspect kept, upscaled by
nearest-neighbour so pixels stay visible) above a ``CAPTION``-pixel caption with the key and the
label; ``columns`` = ceil(sqrt(N)) of them per row.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardstream.errors import ConfigError
from shardstream.format.extensions import kind_of
from shardstream.sources import import_transform
from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig

CAPTION = 28  # pixels under each tile: the key, then the label
LABEL_FIELDS = ("cls", "label", "labels", "target", "targets", "y")


@dataclass
class Grid:
    """What ``draw_batch_grid`` drew: the tiles' count, size and layout, and where the images came from."""

    path: str
    tiles: int
    columns: int
    tile: tuple[int, int]  # a tile's (width, height): the image square and its caption
    field: str  # where the images were found in the batch ("png", "[0]", "batch")
    keys: list[str]
    labels: list[str | None]


def load_transform(spec: str) -> Callable[[Any], Any]:
    """``module:function`` (``module.sub:Class.method`` too) as a callable; the working directory
    is searched first, as ``python -m`` would. ConfigError when it cannot be found."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--transform {spec!r}: expected module:function (e.g. mytransforms:augment)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    return import_transform(spec)


class _KeyRecorder:
    """The user's transform (or none), noting the key of every sample it lets through, in order:
    the keys of the batch where the transform returns no dict (a tuple, a tensor) to carry them."""

    def __init__(self, fn: Callable[[Any], Any] | None):
        self.fn = fn
        self.keys: list[str] = []
        if fn is not None and hasattr(fn, "bind_sample"):  # seeded augmentation (pipeline.transform.bind_per_sample)
            self.bind_sample = fn.bind_sample

    def __call__(self, sample: dict[str, Any]) -> Any:
        out = self.fn(sample) if self.fn is not None else sample
        if out is not None:
            self.keys.append(str(sample.get("__key__")))
        return out


def first_batch(
    url: str,
    batch_size: int,
    transform: Callable[[Any], Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    config: StorageConfig = DEFAULT_STORAGE,
) -> tuple[Any, list[str], Any]:
    """The dataset's first batch as training sees it (decoded, transformed, collated; manifest
    order), the keys of its samples, and the stream (its manifest names the labels)."""
    from shardstream.dataset import ShardStream
    from shardstream.options import Store
    from shardstream.plan.topology import World

    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
    recorder = _KeyRecorder(transform)
    probe = ShardStream(url, batch_size=1, shuffle=False, world=World(0, 1), store=Store(options=storage_options, config=config))
    size = max(1, min(batch_size, sum(m.total_samples for m in probe.sources.manifests)))  # a small dataset still gives one batch
    stream = ShardStream(
        url, batch_size=size, shuffle=False, world=World(0, 1), transform=recorder, store=Store(options=storage_options, config=config)
    )
    batch = next(iter(stream), None)
    if batch is None:
        raise ConfigError(f"{url}: no batch of {size} (the transform dropped every sample?)")
    return batch, recorder.keys[:size], stream


def _array(value: Any) -> np.ndarray | None:
    """A tensor or array as a numpy array (None for anything else)."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        return value.detach().cpu().float().numpy() if str(value.dtype) == "torch.bfloat16" else value.detach().cpu().numpy()
    return None


def _is_image(x: Any) -> bool:
    """One sample's image: a PIL image, or a 2-D (grayscale) or 3-D array with 1, 3 or 4 channels first or last."""
    if type(x).__module__.startswith("PIL"):
        return True
    a = _array(x)
    if a is None or a.dtype.kind not in "uifb" or min(a.shape, default=0) < 1:
        return False
    if a.ndim == 2:
        return min(a.shape) >= 2
    return a.ndim == 3 and (a.shape[0] in (1, 3, 4) or a.shape[-1] in (1, 3, 4)) and sorted(a.shape)[1] >= 2


def _per_sample(value: Any, n: int) -> list[Any] | None:
    """``value`` as ``n`` per-sample images (a batched array split, or a list of images), or None."""
    a = _array(value)
    if a is not None:
        if a.ndim in (3, 4) and a.shape[0] == n and _is_image(a[0]):
            return [(v, type(value).__module__.startswith("torch")) for v in a]
        return None
    if isinstance(value, (list, tuple)) and len(value) == n and all(_is_image(v) for v in value):
        return [(v, type(v).__module__.startswith("torch")) for v in value]
    return None


def _describe(value: Any) -> str:
    a = _array(value)
    if a is not None:
        return f"{type(value).__name__}{list(a.shape)} {a.dtype}"
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"{type(value).__name__} of {len(value)} {'/'.join(kinds) or 'nothing'}"
    return type(value).__name__


def _batch_size_of(batch: Any, keys: list[str]) -> int:
    if isinstance(batch, Mapping) and "__key__" in batch:
        return len(batch["__key__"])
    return len(keys)


def find_images(batch: Any, n: int) -> tuple[str, list[tuple[Any, bool]]]:
    """Where the images are in a batch of ``n`` and each sample's image (with whether it came
    from a torch tensor: channels first). ConfigError, naming what the batch holds, when none."""
    candidates: list[tuple[str, Any]]
    if isinstance(batch, Mapping):
        fields = [(str(k), v) for k, v in batch.items() if not str(k).startswith("__")]
        candidates = sorted(fields, key=lambda kv: kind_of(kv[0].rsplit(".", 1)[-1]) != "image")
        held = ", ".join(f"{k}: {_describe(v)}" for k, v in fields) or "no field"
    elif isinstance(batch, (list, tuple)) and not _per_sample(batch, n):
        candidates = [(f"[{i}]", v) for i, v in enumerate(batch)]
        held = ", ".join(f"{k}: {_describe(v)}" for k, v in candidates) or "nothing"
    else:
        candidates = [("batch", batch)]
        held = _describe(batch)
    for name, value in candidates:
        images = _per_sample(value, n)
        if images is not None:
            return name, images
    raise ConfigError(
        f"the first batch has no image field to draw ({held}); --grid draws images: [N, C, H, W] or "
        "[N, H, W, C] tensors or arrays, [N, H, W] grayscale, or lists of images"
    )


def find_labels(batch: Any, n: int, image_field: str, label_map: Mapping[str, int] | None) -> list[str | None]:
    """Each sample's label as text (``3 cat`` where the manifest names class 3), or None."""
    value: Any = None
    if isinstance(batch, Mapping):
        value = next((batch[k] for k in LABEL_FIELDS if k in batch), None)
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            if f"[{i}]" != image_field and _labels(v, n) is not None:
                value = v
                break
    found = _labels(value, n) if value is not None else None
    if found is None:
        return [None] * n
    names = {index: name for name, index in (label_map or {}).items()}
    return [f"{v} {names[v]}" if isinstance(v, int) and v in names else str(v) for v in found]


def _labels(value: Any, n: int) -> list[Any] | None:
    a = _array(value)
    if a is not None:
        if a.ndim == 1 and len(a) == n:
            return [int(v) if a.dtype.kind in "iub" else round(float(v), 4) for v in a]
        if a.ndim == 2 and len(a) == n and a.shape[1] > 1:  # one-hot or scores: the top class
            return [int(i) for i in a.argmax(axis=1)]
        return None
    if isinstance(value, (list, tuple)) and len(value) == n and all(isinstance(v, (int, str)) for v in value):
        return list(value)
    return None


def to_pil(image: Any, channels_first: bool):
    """One sample's image as an RGB PIL image: CHW (torch) or HWC, grayscale, uint8 as it is,
    floats in [0, 1] times 255, anything else rescaled from its lowest to its highest value."""
    from PIL import Image

    if type(image).__module__.startswith("PIL"):
        return image.convert("RGB")
    a = _array(image)
    assert a is not None
    if a.ndim == 3:
        first = a.shape[0] in (1, 3, 4)
        last = a.shape[-1] in (1, 3, 4)
        if first and (channels_first or not last):
            a = np.moveaxis(a, 0, -1)
        if a.shape[-1] == 1:
            a = a[..., 0]
        elif a.shape[-1] == 4:
            a = a[..., :3]
    if a.dtype == np.bool_:
        a = a.astype(np.uint8) * 255
    elif a.dtype != np.uint8:
        f = a.astype(np.float64)
        f = np.nan_to_num(f, nan=0.0, posinf=0.0, neginf=0.0)
        low, high = float(f.min()), float(f.max())
        if a.dtype.kind == "f" and low >= 0.0 and high <= 1.0:
            f = f * 255.0
        elif a.dtype.kind in "iu" and low >= 0 and high <= 255:
            pass
        elif high > low:  # normalised (mean/std) or another range: this tile's own lowest..highest
            f = (f - low) * (255.0 / (high - low))
        else:
            f = np.full_like(f, 128.0)
        a = np.clip(np.rint(f), 0, 255).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(a)).convert("RGB")


def draw_batch_grid(
    url: str,
    path: str,
    *,
    batch_size: int = 16,
    transform: Callable[[Any], Any] | None = None,
    tile: int = 128,
    storage_options: Mapping[str, Any] | None = None,
    config: StorageConfig = DEFAULT_STORAGE,
) -> Grid:
    """Draw the first batch of ``url`` (after decoding and ``transform``) into the PNG ``path``
    (see the module docstring) and say what was drawn."""
    from PIL import Image, ImageDraw

    if tile < 16:
        raise ConfigError(f"--tile must be at least 16 pixels, got {tile}")
    batch, recorded, stream = first_batch(url, batch_size, transform, storage_options, config)
    n = _batch_size_of(batch, recorded)
    field, images = find_images(batch, n)
    keys = [str(k) for k in batch["__key__"]] if isinstance(batch, Mapping) and "__key__" in batch else recorded
    labels = find_labels(batch, n, field, stream.manifest.label_map)
    columns = math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    width, height = tile, tile + CAPTION
    canvas = Image.new("RGB", (columns * width, rows * height), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (image, channels_first) in enumerate(images):
        x0, y0 = (i % columns) * width, (i // columns) * height
        pic = to_pil(image, channels_first)
        scale = tile / max(pic.size)
        fitted = pic.resize((max(1, round(pic.size[0] * scale)), max(1, round(pic.size[1] * scale))), Image.Resampling.NEAREST)
        canvas.paste(fitted, (x0 + (tile - fitted.size[0]) // 2, y0 + (tile - fitted.size[1]) // 2))
        key = keys[i] if i < len(keys) else f"#{i}"
        draw.text((x0 + 2, y0 + tile + 2), _fit(key, width), fill="black")
        if labels[i] is not None:
            draw.text((x0 + 2, y0 + tile + 14), _fit(f"label {labels[i]}", width), fill=(40, 40, 160))
    canvas.save(path, format="PNG")
    return Grid(path=path, tiles=n, columns=columns, tile=(width, height), field=field, keys=keys[:n], labels=labels)


def _fit(text: str, width: int) -> str:
    most = max(4, width // 6)  # the default bitmap font is about 6 pixels a character
    return text if len(text) <= most else "..." + text[-(most - 3) :]


__all__: Sequence[str] = ["Grid", "draw_batch_grid", "find_images", "load_transform", "to_pil", "CAPTION"]
