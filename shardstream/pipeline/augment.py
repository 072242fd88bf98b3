"""Decode-time augmentation: random-resized-crop fused with JPEG decoding at reduced scale.

``RandomResizedCrop(224)`` used as the decoder of an image extension picks the crop from the
JPEG header, decodes with libjpeg-turbo (simplejpeg; fast DCT and upsampling unless
``fast=False``) at 1/2, 1/4 or 1/8 scale when the crop still covers the output size at that
scale, then resizes the crop with torch's uint8 antialiased bilinear kernel. Non-JPEG images go
through PIL. Output: a uint8 CHW tensor of size x size.

Randomness is reproducible: ShardStream calls ``bind(epoch, rank, worker)`` on decoders and
transforms that define it, at the start of each worker's epoch, and ``bind_sample(name)`` before
each sample when they define that too. RandomResizedCrop draws each crop from an RNG seeded by
(seed, epoch, sample name): the crop of a sample does not depend on which rank or worker reads
it or on what that worker read before, so a resumed epoch (exact or elastic) crops every sample
as an uninterrupted run would. Called directly (no ``bind_sample``), it draws from the per-worker
RNG that ``bind`` seeds.
"""

from __future__ import annotations

import math
import random


class RandomResizedCrop:
    """Image bytes -> uint8 CHW tensor of ``size x size``: a random resized crop decoded together
    with the image, as the decoder of an image extension (``decode={"jpg": RandomResizedCrop(224)}``).

    The crop is sampled as torchvision's RandomResizedCrop does: ``scale``, the range of the crop's
    area as a fraction of the image's; ``ratio``, the range of its aspect ratio (width / height).
    ``seed`` makes the crops reproducible (see ``bind`` and ``bind_sample``). A JPEG is decoded at
    1/2, 1/4 or 1/8 scale when the crop still covers ``size`` at that scale (``reduced_decode``),
    with libjpeg-turbo's fast DCT and upsampling unless ``fast=False``; other images go through PIL.
    """

    def __init__(
        self,
        size: int = 224,
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        seed: int = 0,
        reduced_decode: bool = True,
        fast: bool = True,
    ):
        self.size = size
        self.fast = fast
        self.scale = scale
        self.ratio = ratio
        self.seed = seed
        self.reduced_decode = reduced_decode
        self.rng = random.Random(f"crop:{seed}")
        self.epoch = 0

    def bind(self, epoch: int, rank: int, worker: int) -> None:
        """Called by ShardStream at the start of every worker's pass (in that worker): records the
        pass's ``epoch`` for ``bind_sample`` and seeds the crop RNG from (``seed``, epoch, rank,
        worker), so crops drawn without ``bind_sample`` are reproducible per (epoch, rank, worker)."""
        self.epoch = epoch
        self.rng = random.Random(f"crop:{self.seed}:{epoch}:{rank}:{worker}")

    def bind_sample(self, name: str) -> None:
        """Called by ShardStream before each sample with its name (shard file name and key): seeds
        the crop RNG from (``seed``, epoch, name) alone, so a sample gets the same crop whichever rank
        or worker reads it and whatever came before, after a resume (exact or elastic) too."""
        # One string-seeded RNG per sample (a SHA-512 of a short string: microseconds, next to a decode).
        self.rng = random.Random(f"crop:{self.seed}:{self.epoch}:{name}")

    def crop_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """A crop ``(x, y, w, h)`` of a ``width x height`` image drawn from the RNG: up to 10 tries
        of an area in ``scale`` and a log-uniform aspect ratio in ``ratio``, else a central crop at the
        aspect ratio clamped to ``ratio``."""
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
        import torch.nn.functional as F

        from shardstream.pipeline.decode import decode_image_pil, decode_jpeg_array, is_jpeg

        array = None
        if is_jpeg(data):
            import simplejpeg

            try:
                height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            except ValueError:
                height = width = 0
            if width and height:
                x, y, w, h = self.crop_box(width, height)
                shrink = 1
                if self.reduced_decode:
                    # Largest DCT reduction (1/2, 1/4, 1/8) that keeps the crop at least size x size.
                    while shrink < 8 and min(w, h) // (shrink * 2) >= self.size:
                        shrink *= 2
                min_size = (math.ceil(width / shrink), math.ceil(height / shrink)) if shrink > 1 else None
                array = decode_jpeg_array(data, fast=self.fast, min_size=min_size)
        if array is None:
            array = np.asarray(decode_image_pil(data))
            height, width = array.shape[:2]
            x, y, w, h = self.crop_box(width, height)
        sx, sy = array.shape[1] / width, array.shape[0] / height
        x0, y0 = int(x * sx), int(y * sy)
        x1, y1 = max(x0 + 1, round((x + w) * sx)), max(y0 + 1, round((y + h) * sy))
        region = torch.from_numpy(np.ascontiguousarray(array[y0:y1, x0:x1]))
        # HWC -> 1CHW as a channels-last view: torch's uint8 antialiased bilinear fast path.
        out = F.interpolate(region.permute(2, 0, 1).unsqueeze(0), size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False)
        return out[0]
