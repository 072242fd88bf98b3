"""examples/train_gpt.py as a user runs it: 2 gloo ranks under torchrun, 2 DataLoader workers
each, on a corpus packed with a tokenizer trained here. The whole job (torchrun, ranks, workers)
is killed with SIGKILL after a checkpoint, then started again with the same ``--checkpoint``: the
steps the checkpoint holds plus the resumed run's are, rank by rank and bit for bit, the steps
of one uninterrupted epoch (the steps past the checkpoint that the kill cut short are trained
again, as after any preemption), so every sequence of the epoch is trained on once."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port, scaled
from test_tokens import corpus_texts, train_tokenizer

import shardstream

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
ARGS = ["--seq-len", "15", "--batch-size", "2", "--workers", "2", "--dim", "16", "--layers", "1", "--heads", "2", "--checkpoint-every", "10"]


def _torchrun(data: str, checkpoint: Path, record: Path) -> subprocess.Popen:
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    command += [str(EXAMPLE), data, *ARGS, "--checkpoint", str(checkpoint), "--record", str(record)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _tree(pid: int) -> set[int]:
    """``pid`` and every process under it (torchrun starts each rank in a session of its own, so
    no process group holds the whole job): from the parent ids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += children.get(p, [])
    return tree


def _kill_job(pid: int) -> None:
    """kill -9 of the whole job at once, as a preempted node loses it: stopped first, so that no
    rank writes another checkpoint or starts another process while the others die."""
    stopped: set[int] = set()
    while (tree := _tree(pid)) - stopped:
        for p in tree - stopped:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(p, signal.SIGSTOP)
        stopped |= tree
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _steps(record: Path, rank: int) -> list[tuple[int, list[str]]]:
    path = Path(f"{record}.{rank}")
    if not path.exists():
        return []
    lines = [line.split() for line in path.read_text().split("\n")[:-1]]  # whole lines: a kill may cut the last
    return [(int(step), hashes) for step, *hashes in lines]


def _packed_corpus(tmp_path: Path) -> str:
    """The test corpus packed with a tokenizer trained on it, 40 documents a shard: its root."""
    texts = corpus_texts()
    tokenizer = train_tokenizer(texts, str(tmp_path / "tokenizer.json"))
    data = str(tmp_path / "tokens")
    shardstream.pack_tokens(iter(texts), data, tokenizer=tokenizer, eos=True, max_count=40)
    return data


def _hashes(batch: dict) -> list[str]:
    return [hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest() for row in batch["input_ids"].numpy()]


@pytest.mark.slow
def test_train_gpt_killed_after_a_checkpoint_resumes_the_epoch_exactly(tmp_path):
    data = _packed_corpus(tmp_path)
    checkpoint = tmp_path / "ckpt" / "gpt.pt"

    job = _torchrun(data, checkpoint, tmp_path / "first")
    deadline = time.monotonic() + scaled(120)

    # Killed past the first checkpoint (step 10) with steps left in the epoch (97 a rank), and
    # only while every rank is well inside a checkpoint interval: a poll that came late, as a
    # checkpoint was written, would kill the job with no step past it to train again.
    def inside_an_interval() -> bool:
        counts = [len(_steps(tmp_path / "first", r)) for r in (0, 1)]
        return all(13 <= n <= 77 and 3 <= n % 10 <= 7 for n in counts)

    while not (checkpoint.exists() and inside_an_interval()):
        assert job.poll() is None, f"the first run ended before it was killed:\n{job.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.01)
    _kill_job(job.pid)
    job.wait(timeout=scaled(30))
    assert job.returncode == -signal.SIGKILL
    saved = torch.load(checkpoint, weights_only=True)
    done = saved["step"]
    assert done >= 10 and done % 10 == 0

    again = _torchrun(data, checkpoint, tmp_path / "second")
    out, _ = again.communicate(timeout=scaled(180))
    assert again.returncode == 0, out[-3000:]
    assert f"resumed from {checkpoint} at step {done}" in out and "exactly" in out

    # The epoch as one uninterrupted run yields it on each rank (the same plan: seed 0, 2 workers).
    seen = []
    for rank in (0, 1):
        ds = shardstream.ShardStream(shardstream.Tokens(data, seq_len=15), batch_size=2, seed=0, world=shardstream.World(rank, 2))
        whole = [_hashes(b) for b in shardstream.make_loader(ds, num_workers=2)]
        first = _steps(tmp_path / "first", rank)
        assert len(first) > done  # the kill came after steps the checkpoint does not hold: trained again
        committed = [hashes for step, hashes in first if step <= done]
        resumed = _steps(tmp_path / "second", rank)
        assert [step for step, _ in resumed] == list(range(done + 1, len(whole) + 1))
        assert committed + [hashes for _, hashes in resumed] == whole
        seen += [h for hashes in whole for h in hashes]
        assert f"[rank {rank}] {len(whole) - done} steps to step {len(whole)}" in out
    assert len(seen) == len(set(seen)) == 2 * len(whole) * 2  # each sequence of the epoch once, over both ranks
    assert json.loads(saved["loader"])["loader_epoch"] == 0


@pytest.mark.slow
def test_train_gpt_runs_a_budget_of_tokens(tmp_path):
    """``--tokens T``: T // (2 ranks * batch 2 * seq_len 15) steps on every rank, across passes."""
    data = _packed_corpus(tmp_path)
    one_pass = len(shardstream.ShardStream(shardstream.Tokens(data, seq_len=15), batch_size=2, world=shardstream.World(0, 2)))
    budget = 3 * one_pass * 2 * 2 * 15 + 50  # three passes' worth and a part of a step
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    command += [str(EXAMPLE), data, *ARGS[:-2], "--workers", "1", "--tokens", f"{budget:.0f}", "--record", str(tmp_path / "steps")]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = budget // (2 * 2 * 15)
    assert steps == 3 * one_pass
    for rank in (0, 1):
        assert len(_steps(tmp_path / "steps", rank)) == steps
        assert f"[rank {rank}] {steps} steps to step {steps}" in done.stdout + done.stderr
