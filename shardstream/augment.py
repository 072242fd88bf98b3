"""Decode-time augmentation: random-resized-crop fused with JPEG decoding at reduced scale.

``RandomResizedCrop(224)`` used as the decoder of an image extension picks the crop from the
image header, lets libjpeg decode at 1/2, 1/4 or 1/8 scale when the crop still covers the output
size at that scale, then crops and resizes: the same result distribution as decoding the full
image and cropping, at a fraction of the work for large photos.

Randomness is reproducible: ShardStream calls ``bind(epoch, rank, worker)`` on decoders and
transforms that define it, at the start of each worker's epoch.
"""

from __future__ import annotations

import io
import math
import random


class RandomResizedCrop:
    """Image bytes -> uint8 CHW tensor of ``size x size`` (torchvision's RandomResizedCrop sampling)."""

    def __init__(self, size: int = 224, *, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), seed: int = 0, reduced_decode: bool = True):
        self.size = size
        self.scale = scale
        self.ratio = ratio
        self.seed = seed
        self.reduced_decode = reduced_decode
        self.rng = random.Random(f"crop:{seed}")

    def bind(self, epoch: int, rank: int, worker: int) -> None:
        self.rng = random.Random(f"crop:{self.seed}:{epoch}:{rank}:{worker}")

    def crop_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * self.rng.uniform(*self.scale)
            aspect = math.exp(self.rng.uniform(*log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                x = self.rng.randint(0, width - w)
                y = self.rng.randint(0, height - h)
                return x, y, w, h
        # fallback: central crop at the clamped aspect ratio
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            w, h = int(round(height * self.ratio[1])), height
        else:
            w, h = width, height
        return (width - w) // 2, (height - h) // 2, w, h

    def __call__(self, data: bytes):
        import numpy as np
        import torch
        from PIL import Image

        img = Image.open(io.BytesIO(data))
        width, height = img.size
        x, y, w, h = self.crop_box(width, height)
        if self.reduced_decode and img.format == "JPEG":
            # Largest DCT reduction (1/2, 1/4, 1/8) that keeps the crop at least size x size.
            shrink = 1
            while shrink < 8 and min(w, h) // (shrink * 2) >= self.size:
                shrink *= 2
            if shrink > 1:
                img.draft("RGB", (math.ceil(width / shrink), math.ceil(height / shrink)))
                sx, sy = img.size[0] / width, img.size[1] / height
                x, y, w, h = x * sx, y * sy, w * sx, h * sy
        if img.mode != "RGB":
            img = img.convert("RGB")
        out = img.resize((self.size, self.size), Image.BILINEAR, box=(x, y, x + w, y + h))
        return torch.from_numpy(np.array(out, copy=True)).permute(2, 0, 1)
