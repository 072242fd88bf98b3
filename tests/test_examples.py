"""examples/train_ddp.py run as a user runs it (one gloo rank, 2 DataLoader workers, a real
checkpoint and restart): it prints the worker count it runs with, and one resume summary of the
kind it makes (exact with the same topology, elastic with another)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import free_port, write_image_folder

from shardstream.write.pack import pack

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"


def _train(data: Path, checkpoint: Path, workers: int) -> str:
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(EXAMPLE), str(data), "--epochs", "1", "--batch-size", "4", "--workers", str(workers),
                           "--checkpoint", str(checkpoint), "--checkpoint-every", "4"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_train_ddp_prints_its_worker_count_and_one_summary_of_its_resume(tmp_path):
    write_image_folder(tmp_path / "images", classes=3, per_class=8, with_json=False)
    pack(str(tmp_path / "images"), str(tmp_path / "ds"), label_from_dir=True, max_count=6)  # 24 samples: 6 batches of 4
    checkpoint = tmp_path / "ckpt"

    first = _train(tmp_path / "ds", checkpoint, workers=2)  # saves after 4 of 6 batches
    assert "2 workers per rank" in first and "1 workers per rank" not in first
    assert "resum" not in first and "[rank 0] epoch 0: 6 batches" in first

    exact = _train(tmp_path / "ds", checkpoint, workers=2)  # the same topology: an exact resume
    assert "2 workers per rank" in exact and "1 workers per rank" not in exact
    assert exact.count("resuming epoch 0") == 1 and "resuming epoch 0 exactly after 4 of 6 batches" in exact
    assert "elastically" not in exact and "[rank 0] epoch 0: 2 batches" in exact

    elastic = _train(tmp_path / "ds", checkpoint, workers=1)  # another worker count: elastic
    assert "1 workers per rank" in elastic and "2 workers per rank" not in elastic
    assert elastic.count("resuming epoch 0") == 1 and "resuming epoch 0 elastically" in elastic and "exactly" not in elastic


def test_train_ddp_runs_120_short_epochs_on_2_ranks_with_new_workers_every_epoch(tmp_path):
    """The demo's command, run for 120 epochs: 2 gloo ranks under torchrun, 1 DataLoader worker
    each, started anew every epoch, beside gloo's native threads. Forking there once hung the demo
    (CPython gh-112275); every epoch boundary is a chance, so this finishes every time or fails
    (the loader's watchdog, then this test's bound) with every rank's stack."""
    write_image_folder(tmp_path / "images", classes=2, per_class=8, size=8, with_json=False)
    pack(str(tmp_path / "images"), str(tmp_path / "ds"), label_from_dir=True, max_count=4)  # 16 samples, 4 shards
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                           "--master-port", str(free_port()), str(EXAMPLE), str(tmp_path / "ds"), "--epochs", "120",
                           "--batch-size", "4", "--workers", "1"],
                          capture_output=True, text=True, env=env, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] epoch 119: 2 batches" in done.stdout, done.stdout[-2000:]
