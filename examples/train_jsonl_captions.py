"""Train from JSONL image-caption pairs: pack once, then stream with your own transform.

    python examples/train_jsonl_captions.py captions.jsonl data/captions --epochs 2
    python examples/train_jsonl_captions.py --synthetic 200 data/captions     # makes its own pairs

Each JSONL line is ``{"__key__": "0001", "jpg": {"$file": "images/0001.jpg"}, "txt": "a red square"}``
(``txt`` may be missing: such samples are dropped by the transform, returning None). The transform
turns a decoded sample into the tuple the model takes, ``(image, tokens)``: a random crop and
flip of the uint8 image (one smaller than the crop is scaled up to cover it first), and the
caption as a fixed-length tensor of word ids. The default collate batches tuples position by
position, so the loop reads ``for images, tokens in loader``.
The model is a toy (an image encoder trained to predict the caption's words), enough to show a
real loss going down.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardstream

VOCAB = 512
MAX_WORDS = 8
COLORS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 220), "yellow": (230, 220, 40)}
SHAPES = ("square", "stripe")


def word_id(word: str) -> int:
    return 1 + zlib.crc32(word.encode()) % (VOCAB - 1)  # 0 is padding


class CaptionTransform:
    """decoded sample -> (uint8 image 3x32x32, int64 word ids); None drops a sample without caption.

    A class with ``bind`` so shardstream seeds it per (epoch, rank, worker): the crops are
    reproducible, and differ between workers and epochs.
    """

    def __init__(self, size: int = 32):
        self.size = size
        self.rng = torch.Generator()

    def __getstate__(self) -> dict:
        # what each worker gets (pickled for a worker process, copied for a thread worker): the
        # size only; each worker makes its own torch.Generator, and bind() seeds it
        return {"size": self.size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def bind(self, epoch: int, rank: int, worker: int) -> None:
        self.rng.manual_seed(hash((epoch, rank, worker)) & 0xFFFFFFFF)

    def __call__(self, sample: dict):
        caption = sample.get("txt")
        if not caption:
            return None
        image = sample["jpg"]  # uint8 CHW tensor from the default decoder
        _, h, w = image.shape
        if min(h, w) < self.size:  # smaller than the crop: scaled up until its shorter side fits it
            scale = self.size / min(h, w)
            h, w = max(self.size, round(h * scale)), max(self.size, round(w * scale))
            image = F.interpolate(image[None].float(), size=(h, w), mode="bilinear", align_corners=False)[0]
            image = image.round().clamp(0, 255).to(torch.uint8)
        top = int(torch.randint(0, h - self.size + 1, (1,), generator=self.rng))
        left = int(torch.randint(0, w - self.size + 1, (1,), generator=self.rng))
        image = image[:, top : top + self.size, left : left + self.size]
        if torch.rand(1, generator=self.rng) < 0.5:
            image = image.flip(-1)
        ids = [word_id(x) for x in caption.lower().split()][:MAX_WORDS]
        tokens = torch.zeros(MAX_WORDS, dtype=torch.int64)
        tokens[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
        return image, tokens


class CaptionNet(nn.Module):
    """An image encoder that scores every vocabulary word (multi-label: is it in the caption?)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def make_synthetic(folder: str, n: int) -> str:
    """n coloured-shape images with captions (every 10th without one) as images/ + captions.jsonl."""
    import numpy as np
    from PIL import Image

    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        color = list(COLORS)[i % len(COLORS)]
        shape = SHAPES[(i // len(COLORS)) % len(SHAPES)]
        img = rng.integers(0, 40, (40, 40, 3), dtype=np.uint8)
        if shape == "square":
            img[8:32, 8:32] = COLORS[color]
        else:
            img[16:24, :] = COLORS[color]
        Image.fromarray(img).save(os.path.join(folder, "images", f"{i:05d}.jpg"), quality=90)
        record = {"__key__": f"{i:05d}", "jpg": {"$file": f"images/{i:05d}.jpg"}}
        if i % 10:
            record["txt"] = f"a {color} {shape}"
        lines.append(json.dumps(record))
    path = os.path.join(folder, "captions.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jsonl", nargs="?", help="the JSONL file of pairs (omit with --synthetic)")
    parser.add_argument("out", help="where the packed shards go")
    parser.add_argument("--synthetic", type=int, metavar="N", help="make N synthetic pairs first")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    jsonl = make_synthetic(os.path.join(args.out, "src"), args.synthetic) if args.synthetic else args.jsonl
    if jsonl is None:
        parser.error("give a JSONL file or --synthetic N")

    shards = os.path.join(args.out, "shards")
    packed = shardstream.pack(jsonl, shards, max_count=64, overwrite=True)
    print(f"packed {packed.samples} samples into {packed.shards} shards", flush=True)

    dataset = shardstream.ShardStream(shards, batch_size=args.batch_size, transform=CaptionTransform())
    loader = shardstream.make_loader(dataset, num_workers=args.workers)
    model = CaptionNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for epoch in range(args.epochs):  # each pass is a new epoch (new order) by itself
        started, total, batches = time.perf_counter(), 0.0, 0
        for images, tokens in loader:
            target = torch.zeros(len(tokens), VOCAB).scatter_(1, tokens, 1.0)
            target[:, 0] = 0  # padding is not a word
            loss = F.binary_cross_entropy_with_logits(model(images.float() / 255), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        losses.append(total / max(1, batches))
        print(f"epoch {epoch}: {batches} batches, loss {losses[-1]:.4f}, {time.perf_counter() - started:.1f} s", flush=True)
    stats = loader.stats()
    print(f"samples dropped by the transform: {stats['samples_filtered']}", flush=True)
    return {"losses": losses, "batches": batches, "filtered": stats["samples_filtered"]}


if __name__ == "__main__":
    main()
