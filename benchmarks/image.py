"""image: the workload users run most: JPEG decode, random-resized-crop to 224, horizontal flip,
uint8 CHW tensors, batches of 64, a 1000-sample shuffle buffer where the loader has one (from
bench_read.py's images).

Peers: ``shardstream`` (its ``RandomResizedCrop`` decoder: the crop chosen from the header, the
JPEG decoded at reduced scale when the crop allows; the flip as ``transform``), ``webdataset``
(``decode("pil")`` + the same crop and flip with PIL), ``litdata`` (chunks of the same JPEG
bytes, the same PIL work as ``transform``), ``torch`` (an ImageFolder-like folder of the same
files, PIL, torch's ``DataLoader``), ``spdl`` (SPDL's thread pipeline, ``spdl.pipeline.PipelineBuilder``,
over the same folder: each file demuxed and decoded by SPDL's own decoder (FFmpeg's) with the
crop, the resize to 224 and the flip as one FFmpeg filter, then batched; ``--workers N`` is its
N threads, and it has no 0). The images: ``--images`` 500x375 JPEGs of blurred noise.
"""

from __future__ import annotations

import io
import math
import os
import random

UNIT = "images/s"
PEERS = ("shardstream", "webdataset", "litdata", "torch", "spdl")
BATCH = 64
SIZE = 224


def add_arguments(p) -> None:
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--images", type=int, default=1_500)
    p.add_argument("--per-shard", type=int, default=500)


def jpegs(n: int):
    import numpy as np
    from PIL import Image, ImageFilter

    rng = np.random.default_rng(0)
    bases = [
        Image.fromarray(rng.normal(128, 60, (375, 500, 3)).clip(0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(1.2)) for _ in range(8)
    ]
    for i in range(n):
        buf = io.BytesIO()
        bases[i % 8].rotate(int(rng.integers(0, 360))).save(buf, format="JPEG", quality=int(rng.integers(80, 95)))
        yield f"{i:08d}", buf.getvalue(), str(i % 1000).encode()


def crop_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (scale 0.08-1, ratio 3/4-4/3), 10 tries then the centre."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            x, y = rng.randint(0, width - w), rng.randint(0, height - h)
            return x, y, x + w, y + h
    side = min(width, height)
    return (width - side) // 2, (height - side) // 2, (width + side) // 2, (height + side) // 2


_rng = random.Random(0)


def pil_crop_flip(img):
    """PIL image -> random-resized-crop 224, flipped half the time, uint8 CHW tensor."""
    import numpy as np
    import torch
    from PIL import Image

    out = img.convert("RGB").resize((SIZE, SIZE), Image.BILINEAR, box=crop_box(img.size[0], img.size[1], _rng))
    x = torch.from_numpy(np.asarray(out).copy()).permute(2, 0, 1)
    return x.flip(-1) if _rng.random() < 0.5 else x


def flip(sample):
    x = sample["jpg"]
    return {"jpg": x.flip(-1) if _rng.random() < 0.5 else x, "cls": sample["cls"]}


def from_bytes(sample):
    from PIL import Image

    return {"jpg": pil_crop_flip(Image.open(io.BytesIO(bytes(sample["jpg"])))), "cls": int(bytes(sample["cls"]))}


def _litdata_items(span):
    start, stop = span
    for key, jpg, cls in jpegs(stop):
        if int(key) >= start:
            yield {"jpg": jpg, "cls": cls}


def make_litdata(config: dict) -> bool:
    import litdata

    n, per = config["n"], config["per_shard"]
    spans = [(s, min(s + per, n)) for s in range(0, n, per)]
    litdata.optimize(fn=_litdata_items, inputs=spans, output_dir=config["root"], chunk_bytes="64MB", num_workers=1, mode="overwrite", verbose=False)
    return True


def skip(peer: str, config: dict) -> bool:
    """SPDL's pipeline runs on threads: there is no loading in the main thread alone (0), and
    ``--runtime`` (a shardstream loader's) is not its to take."""
    return peer == "spdl" and (config["workers"] == 0 or bool(config.get("runtime")))


def spdl_batches(files: list[str], batch: int, threads: int):
    """The pipeline an SPDL user writes (its docs' image examples): a source of paths, a decode
    stage on ``threads`` threads, batches, a sink; iterated until the source ends."""
    import spdl.io
    import torch
    from spdl.pipeline import PipelineBuilder

    def decode(path: str):
        packets = spdl.io.demux_image(path)
        x0, y0, x1, y1 = crop_box(packets.width, packets.height, _rng)
        flip = ",hflip" if _rng.random() < 0.5 else ""
        filter_desc = f"crop={x1 - x0}:{y1 - y0}:{x0}:{y0},scale={SIZE}:{SIZE}:flags=bilinear{flip},format=pix_fmts=rgb24"
        frames = spdl.io.decode_packets(packets, filter_desc=filter_desc)
        image = spdl.io.to_torch(spdl.io.convert_frames(frames))  # HWC uint8
        return image.reshape(SIZE, SIZE, 3).permute(2, 0, 1), int(os.path.basename(os.path.dirname(path))[6:])

    def collate(items):
        return {"jpg": torch.stack([x for x, _ in items]), "cls": torch.tensor([c for _, c in items])}

    pipeline = (
        PipelineBuilder()
        .add_source(files)
        .pipe(decode, concurrency=threads)
        .aggregate(batch, drop_last=False)
        .pipe(collate)
        .add_sink(4)
        .build(num_threads=threads)
    )
    with pipeline.auto_stop():
        yield from pipeline.get_iterator(timeout=600)


def prepare(args, runner, peers: list[str]) -> list[dict]:
    from shardstream import ShardWriter

    data = os.path.join(args.workdir, f"image-{args.images}")
    tars, folder, chunks = (os.path.join(data, x) for x in ("tars", "folder", "litdata"))
    if not os.path.exists(os.path.join(data, "built")):
        with ShardWriter(tars, max_count=args.per_shard, overwrite=True) as w:
            for key, jpg, cls in jpegs(args.images):
                w.write_encoded(key, {"jpg": jpg, "cls": cls})
                os.makedirs(os.path.join(folder, f"class_{int(cls) % 10}"), exist_ok=True)
                with open(os.path.join(folder, f"class_{int(cls) % 10}", f"{key}.jpg"), "wb") as f:
                    f.write(jpg)
        open(os.path.join(data, "built"), "w").close()
    if "litdata" in peers and not os.path.exists(os.path.join(chunks, "index.json")):
        runner.call("litdata", "image", "make_litdata", {"root": chunks, "n": args.images, "per_shard": args.per_shard})
    return [
        {"workers": w, "batch": args.batch, "images": args.images, "runtime": args.runtime, "_tars": tars, "_folder": folder, "_litdata": chunks}
        for w in args.workers
    ]


def measure(config: dict) -> dict:
    from torch.utils.data import DataLoader, Dataset

    from benchmarks.harness import timed_pass

    peer, workers = config["peer"], config["workers"]

    def make():
        if peer == "shardstream":
            from benchmarks.harness import loader_options
            from shardstream import RandomResizedCrop, ShardStream, Shuffle, World, make_loader

            ds = ShardStream(
                config["_tars"],
                batch_size=config["batch"],
                shuffle=Shuffle(1000),
                decode={"jpg": RandomResizedCrop(SIZE)},
                transform=flip,
                world=World(0, 1),
            )
            return make_loader(ds, num_workers=workers, **loader_options(config))
        if peer == "webdataset":
            import webdataset as wds

            root = config["_tars"]
            urls = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))
            ds = (
                wds.WebDataset(urls, shardshuffle=100, nodesplitter=wds.single_node_only, workersplitter=wds.split_by_worker, empty_check=False)
                .shuffle(1000)
                .decode("pil")
                .map(lambda s: {"jpg": pil_crop_flip(s["jpg"]), "cls": int(s["cls"])})
                .batched(config["batch"], partial=True)
            )
            return wds.WebLoader(ds, batch_size=None, num_workers=workers)
        if peer == "litdata":
            import litdata

            ds = litdata.StreamingDataset(input_dir=config["_litdata"], transform=from_bytes, shuffle=True)
            return litdata.StreamingDataLoader(ds, batch_size=config["batch"], num_workers=workers)
        if peer == "torch":
            from PIL import Image

            root = config["_folder"]
            files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)

            class Folder(Dataset):
                def __len__(self):
                    return len(files)

                def __getitem__(self, i):
                    with Image.open(files[i]) as img:
                        return {"jpg": pil_crop_flip(img), "cls": int(os.path.basename(os.path.dirname(files[i]))[6:])}

            return DataLoader(Folder(), batch_size=config["batch"], shuffle=True, num_workers=workers)
        if peer == "spdl":
            root = config["_folder"]
            files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
            random.Random(0).shuffle(files)
            return spdl_batches(files, config["batch"], workers)
        raise SystemExit(f"image: no peer {peer}")

    return timed_pass(make, lambda b: len(b["jpg"]))
