"""A DDP rank exits 0, never with "terminate called without an active exception" (SIGABRT).

The cause, found with gdb on a rank that aborted: gloo's worker thread destroyed an all_gather's
work after the interpreter began to exit; dropping the work's Python-made tensors takes the GIL
(torch 2.13 keeps a tensor's Python object alive while C++ holds it), CPython 3.11 ends a thread
that asks for the GIL during finalization with pthread_exit, and its forced unwinding through the
C++ destructor calls std::terminate. examples/train_ddp.py ends its ranks with ``finish()``
(output flushed, ``os._exit(0)``: no finalization for the thread to meet). Here a tiny DDP job on a
real loader with 2 worker processes ends with a burst of such collectives, right before its ranks
exit: with no guard about one run in ten aborted a rank, so one run here is a check that such a
job exits cleanly and prints all it printed, not a sure catch of the abort (three runs cost a
minute and a half of the suite for a 27% catch)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import scaled, write_dataset

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUNS = 1

RANK = """
import sys

import torch
import torch.distributed as dist

from shardstream import ShardStream, World, make_loader

sys.path.insert(0, sys.argv[5])
from train_ddp import finish  # the example's own end


def main(rank, world, store, data):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = ShardStream(data, batch_size=4, world=World(rank, world))
    loader = make_loader(ds, num_workers=2, workers="processes", log_interval=None)
    for batch in loader:
        loss = model(batch["cls"].float().view(-1, 1).expand(-1, 4)).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    for step in range(20):  # collectives on Python-made tensors, the last just before exit
        counts = torch.tensor([step])
        gathered = [torch.zeros_like(counts) for _ in range(world)]
        dist.all_gather(gathered, counts)
    dist.destroy_process_group()
    print("workers", *(proc.pid for proc in loader._runtime.procs))  # (persistent: still running)
    print("rank", rank, "done")  # (not flushed here: finish flushes it)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    finish()
"""


def test_ddp_ranks_exit_cleanly_after_collectives(tmp_path):
    data = write_dataset(tmp_path / "ds", n=64, max_count=16)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    for run in range(RUNS):
        store = tmp_path / f"store.{run}"
        ranks = [
            subprocess.Popen(
                [sys.executable, str(script), str(r), "2", str(store), data, str(EXAMPLES)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(2)
        ]
        try:
            outs = [p.communicate(timeout=scaled(120)) for p in ranks]
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for r, (p, (out, err)) in enumerate(zip(ranks, outs)):
            assert "terminate called" not in err, f"run {run}, rank {r}: {err[-2000:]}"
            lines = out.strip().splitlines()
            assert p.returncode == 0 and lines[-1] == f"rank {r} done", (run, r, p.returncode, err[-2000:])
            workers = [int(pid) for pid in lines[-2].split()[1:]]
            assert len(workers) == 2
            deadline = time.monotonic() + scaled(15)  # a rank's workers end once its socket hangs up
            while any(running(pid) for pid in workers) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not any(running(pid) for pid in workers), f"rank {r}'s workers outlived it: {workers}"


def running(pid):
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
