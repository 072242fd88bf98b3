"""examples/train_jsonl_captions.py with images smaller than its 32x32 crop (a thumbnail, a thin
strip, a single pixel) next to larger ones: the transform scales a small image up until the crop
fits, so every sample becomes a 3x32x32 uint8 image, and the example trains through them (its
main, packing the JSONL and running 2 epochs) instead of failing on torch.randint's range."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_jsonl_captions.py"
SIZES = [(48, 48), (20, 12), (8, 40), (1, 1), (32, 31), (31, 64)]  # (height, width)


def _example():
    spec = importlib.util.spec_from_file_location("train_jsonl_captions", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_image_smaller_than_the_crop_is_scaled_up_to_cover_it():
    example = _example()
    transform = example.CaptionTransform()
    transform.bind(0, 0, 0)
    for h, w in SIZES:
        image = torch.full((3, h, w), 200, dtype=torch.uint8)
        out, tokens = transform({"jpg": image, "txt": "a red square"})
        assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
        assert int(out.min()) == int(out.max()) == 200  # a flat image stays flat: scaled, not padded
        assert tokens.tolist()[:3] == [example.word_id(x) for x in ("a", "red", "square")]


def test_the_example_trains_through_small_images(tmp_path):
    example = _example()
    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    lines = []
    for i in range(24):
        h, w = SIZES[i % len(SIZES)]
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(tmp_path / "images" / f"{i:03d}.jpg")
        lines.append(json.dumps({"__key__": f"{i:03d}", "jpg": {"$file": f"images/{i:03d}.jpg"}, "txt": f"a caption {i}"}))
    (tmp_path / "captions.jsonl").write_text("\n".join(lines) + "\n")
    result = example.main([str(tmp_path / "captions.jsonl"), str(tmp_path / "out"), "--epochs", "2", "--batch-size", "8", "--workers", "0"])
    assert result["batches"] == 3 and result["filtered"] == 0
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))
