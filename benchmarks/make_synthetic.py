"""Generate a small synthetic image-classification dataset in the ImageFolder layout.

    python benchmarks/make_synthetic.py DIR --classes 10 --per-class 100 --size 32

Writes DIR/class_XX/NNNNNN.png plus a .json sidecar per image. Each class has its own colour and
stripe pattern plus noise, so a tiny model can learn it. Deterministic for a given --seed.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from PIL import Image


def make_image(rng: np.random.Generator, label: int, classes: int, size: int) -> np.ndarray:
    hue = np.array([(label * 97) % 256, (label * 53 + 80) % 256, (label * 29 + 160) % 256], np.float32)
    yy, xx = np.mgrid[0:size, 0:size]
    stripes = ((xx * (label % 4 + 1) + yy * (label // 4 + 1)) // 4 % 2).astype(np.float32)[..., None]
    img = hue * (0.6 + 0.4 * stripes) + rng.normal(0, 12, (size, size, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--format", choices=["png", "jpg"], default="png")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    count = 0
    for label in range(args.classes):
        folder = os.path.join(args.dest, f"class_{label:02d}")
        os.makedirs(folder, exist_ok=True)
        for i in range(args.per_class):
            stem = os.path.join(folder, f"{i:06d}")
            Image.fromarray(make_image(rng, label, args.classes, args.size)).save(f"{stem}.{args.format}")
            with open(f"{stem}.json", "w") as f:
                json.dump({"index": i, "class": label}, f)
            count += 1
    print(f"wrote {count} images in {args.classes} classes to {args.dest}")


if __name__ == "__main__":
    main()
