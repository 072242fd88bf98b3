"""A rank of the multi-host tests (tests/test_hosts.py), started by torchrun in a network
namespace: gloo DDP over the namespace's interface (GLOO_SOCKET_IFNAME), the data (SOURCE: a
dataset, a weighted mix or a Parquet table, see ``sources``) on the moto S3 server across the
link, 2 DataLoader workers, 2 epochs. Writes every batch's keys to
``WORK/PHASE.keys.RANK``. In phase ``crash`` rank 0 checkpoints after STOP steps of epoch 0, then
every rank says so in ``WORK/ready.RANK`` and waits to be killed; a later phase resumes from the
checkpoint on whatever world it is started with. Phase ``straggler`` runs one epoch with reports
of every rank's data wait (shardstream/ranks.py) and rank 0 writes them to
``WORK/straggler.reports.json``. Phase ``cache`` reads through a cache on each host's own
directory (``WORK/cache.NODE``), shared by that host's ranks.

    python -m torch.distributed.run ... hosts_train.py SOURCE ENDPOINT WORK PHASE
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import shardstream
from shardstream.ranks import WaitMeter

STOP = 3  # steps of epoch 0 before the checkpoint, in phase crash


def sources(spec: str):
    """SOURCE: a dataset URL; ``mix:URL=WEIGHT,URL=WEIGHT``, a weighted mix; ``table:URL``, a
    Parquet table (columns id and x)."""
    if spec.startswith("mix:"):
        parts = [item.rsplit("=", 1) for item in spec[4:].split(",")]
        return [shardstream.Source(url, weight=float(w), name=url.rstrip("/").rsplit("/", 1)[-1]) for url, w in parts]
    if spec.startswith("table:"):
        return shardstream.Table(spec[6:], columns=["id", "x"])
    return spec


def keys_of(batch) -> list:
    """What names each sample of a batch: its source and key (a mix's sources may share keys), or a row's id."""
    if "__key__" not in batch:
        return [str(i) for i in batch["id"].tolist()]
    return [f"{s}/{k}" for s, k in zip(batch.get("__source__", [""] * len(batch["__key__"])), batch["__key__"])]


def main(source: str, endpoint: str, work: str, phase: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("HOSTS_TIMEOUT", "60"))))
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    straggler = phase == "straggler"  # one epoch, shards read as batches are made (no read-ahead), 3 rank reports
    if straggler:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the reports' log lines, to the log
    read = shardstream.Read(readahead_bytes=0) if straggler else shardstream.Read()
    cache = None
    if phase == "cache":  # node-local: one directory per host (torchrun's GROUP_RANK), shared by its ranks
        cache = shardstream.Cache(os.path.join(work, f"cache.{os.environ['GROUP_RANK']}"), 1 << 30)
    store = shardstream.Store(options={"endpoint_url": endpoint}, read=read, cache=cache)
    dataset = shardstream.ShardStream(sources(source), batch_size=4, seed=5, shuffle=shardstream.Shuffle(16), store=store)
    loader = shardstream.make_loader(dataset, num_workers=2, log_interval=60.0 if straggler else None)
    if straggler:
        loader.rank_meter = WaitMeter(every=len(loader) // 3)
    reports: list = []
    checkpoint = os.path.join(work, "checkpoint.pt")
    start = 0
    if phase != "crash" and os.path.exists(checkpoint):
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = json.loads(saved["loader"])
        loader.load_state_dict(state)
        start = state["epoch"]
    with open(os.path.join(work, f"{phase}.keys.{rank}"), "w") as out:
        for epoch in range(start, 1 if straggler else 2):
            loader.set_epoch(epoch)
            batches = 0
            for step, batch in enumerate(loader):
                loss = model((batch["cls"] if "cls" in batch else batch["x"]).float().unsqueeze(1)).sum()
                optimizer.zero_grad()
                loss.backward()  # all-reduce across hosts: unequal batch counts would hang here
                optimizer.step()
                batches += 1
                out.write(json.dumps({"epoch": epoch, "keys": keys_of(batch)}) + "\n")
                if loader.rank_report() is not (reports[-1] if reports else None):
                    reports.append(loader.rank_report())
                out.flush()
                if phase == "crash" and step + 1 == STOP:
                    if rank == 0:
                        tmp = checkpoint + ".tmp"
                        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": json.dumps(loader.state_dict())}, tmp)
                        os.replace(tmp, checkpoint)
                    dist.barrier()
                    with open(os.path.join(work, f"ready.{rank}"), "w"):
                        pass
                    time.sleep(600)  # killed here, mid-epoch, workers and all
            out.write(json.dumps({"epoch": epoch, "batches": batches, "len": len(loader), "world": dist.get_world_size()}) + "\n")
    if rank == 0 and reports:
        with open(os.path.join(work, f"{phase}.reports.json"), "w") as f:
            json.dump(reports, f)
    dist.destroy_process_group()
    # Ended as examples/train_ddp.py's finish() and docs/training.md say: a rank that never
    # finalizes cannot meet gloo's thread at exit ("terminate called without an active exception"
    # aborted a rank of this script once, beside two CPU hogs).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:5])
