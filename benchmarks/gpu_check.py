"""The GPU paths that need a real accelerator, checked end to end on one GPU (a lent machine).

    OMP_NUM_THREADS=1 python -m benchmarks.gpu_check [--device cuda] [--out FILE]

Each check writes one JSON line (to stdout and ``--out``) with ``ok`` and what it counted:

  table_to_device   a Parquet table's columnar batches through make_loader (2 workers, pinned)
                    and to_device: every row once, every value on the GPU equal to what was written
  stateful_resume   torchdata's StatefulDataLoader (2 workers, pin_memory) over tar shards, batches
                    moved to the GPU, its state saved after 5 batches and loaded into a new loader:
                    the interrupted and resumed runs together give each sample once
  lightning_gpu     ShardDataModule under a Lightning Trainer on the GPU (1 device, 2 workers):
                    training sees each of its samples once an epoch, validation counts each
                    validation sample once with the padding masked

With ``--device cpu`` it runs the same paths without a GPU (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

import shardstream
from shardstream import ShardStream, Table, make_loader, to_device


def emit(out: list[dict], **fields: object) -> None:
    print(json.dumps(fields), flush=True)
    out.append(dict(fields))


def table_to_device(work: str, device: str) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 48 * 1024  # whole batches: every row is delivered (mode drop)
    ids = np.arange(rows, dtype=np.int64)
    x = (ids % 1000).astype(np.float32) / 7
    root = os.path.join(work, "table")
    os.makedirs(root)
    for f in range(4):
        part = slice(f * rows // 4, (f + 1) * rows // 4)
        pq.write_table(pa.table({"id": ids[part], "x": x[part]}), f"{root}/part{f}.parquet", row_group_size=4096)
    stream = ShardStream(Table(root, columns=["id", "x"]), batch_size=1024, shuffle=shardstream.Shuffle(8192), seed=3)
    loader = make_loader(stream, num_workers=2)
    seen = []
    wrong = 0
    pinned = 0
    batches = 0
    start = time.perf_counter()
    for batch in to_device(loader, device):
        got_id, got_x = batch["id"], batch["x"]
        assert got_id.device.type == torch.device(device).type, got_id.device
        expected = torch.from_numpy(x)[got_id.cpu()]  # what was written, by each row's id
        wrong += int((got_x.cpu() != expected).sum().item())
        seen.append(got_id.cpu())
        batches += 1
    elapsed = time.perf_counter() - start
    for batch in loader:  # a second epoch on the CPU side: pinned?
        pinned += int(batch["id"].is_pinned()) if device != "cpu" else 0
    ids_seen = torch.cat(seen)
    once = sorted(ids_seen.tolist()) == list(range(rows))
    return {
        "rows": rows,
        "rows_seen": len(ids_seen),
        "each_once": bool(once),
        "wrong_values": wrong,
        "batches": batches,
        "pinned_epoch2": pinned,
        "seconds": round(elapsed, 3),
    }


def write_shards(root: str, n: int) -> None:
    with shardstream.ShardWriter(root, max_count=16) as writer:
        for i in range(n):
            writer.write({"__key__": f"s{i:05d}", "cls": i, "npy": np.full(64, i, dtype=np.float32)})


def stateful_resume(work: str, device: str) -> dict:
    from torchdata.stateful_dataloader import StatefulDataLoader

    root = os.path.join(work, "tar")
    write_shards(root, 400)

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(ShardStream(root, batch_size=16, seed=5), batch_size=None, num_workers=2, pin_memory=device != "cpu")

    first = loader()
    keys: list[str] = []
    wrong = 0
    for step, batch in enumerate(first):
        on = batch["npy"].to(device, non_blocking=True)
        wrong += int((on[:, 0] != batch["cls"].to(device).float()).sum().item())
        keys += batch["__key__"]
        if step + 1 == 5:
            state = json.loads(json.dumps(first.state_dict()))
            break
    del first
    resumed = loader()
    resumed.load_state_dict(state)
    for batch in resumed:
        on = batch["npy"].to(device, non_blocking=True)
        wrong += int((on[:, 0] != batch["cls"].to(device).float()).sum().item())
        keys += batch["__key__"]
    return {"samples": 400, "seen": len(keys), "distinct": len(set(keys)), "each_once": len(keys) == len(set(keys)) == 400, "wrong_values": wrong}


def lightning_gpu(work: str, device: str) -> dict:
    import pytorch_lightning as pl

    from shardstream.lightning import ShardDataModule

    train, val = os.path.join(work, "ltrain"), os.path.join(work, "lval")
    write_shards(train, 256)
    with shardstream.ShardWriter(val, max_count=16) as writer:
        for i in range(37):
            writer.write({"__key__": f"v{i:04d}", "cls": i})

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(64, 1)
            self.train_keys: list[str] = []
            self.val_count = 0
            self.val_sum = 0

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            assert batch["npy"].device.type == self.device.type
            self.train_keys += batch["__key__"]
            return self.layer(batch["npy"]).pow(2).mean()

        def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            valid = batch["__valid__"].to(self.device)
            self.val_count += int(valid.sum().item())
            self.val_sum += int((batch["cls"].to(self.device) * valid).sum().item())

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model = Model()
    data = ShardDataModule(train=train, val=val, batch_size=16, num_workers=2, seed=0, shuffle=shardstream.Shuffle(64))
    trainer = pl.Trainer(
        accelerator="gpu" if device != "cpu" else "cpu",
        devices=1,
        max_epochs=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=work,
    )
    trainer.fit(model, data)
    per_epoch = len(model.train_keys) // 2
    epochs = [model.train_keys[:per_epoch], model.train_keys[per_epoch:]]
    return {
        "train_each_once_per_epoch": all(len(e) == len(set(e)) == 256 for e in epochs),
        "validated": model.val_count,
        "validated_sum": model.val_sum,
        "val_exact": model.val_count == 2 * 37 and model.val_sum == 2 * sum(range(37)),
        "global_step": trainer.global_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (use --device cpu for a smoke run)")
    out: list[dict] = []
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "gpu": torch.cuda.get_device_name(0) if args.device != "cpu" else None}
    emit(out, check="environment", **env)
    failed = 0
    for check in (table_to_device, stateful_resume, lightning_gpu):
        with tempfile.TemporaryDirectory() as work:
            try:
                result = check(work, args.device)
                ok = all(v for k, v in result.items() if k.startswith(("each_once", "train_each", "val_exact"))) and not result.get("wrong_values")
            except Exception as exc:  # noqa: BLE001 - a failed check is reported, and the others still run
                result, ok = {"error": f"{type(exc).__name__}: {exc}"}, False
            failed += not ok
            emit(out, check=check.__name__, ok=ok, **result)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(o) + "\n" for o in out)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
