"""A tiny GPT trained under DDP on a token corpus: ShardStream(Tokens(root, seq_len)) -> make_loader.

    shardstream pack corpus.jsonl ./tokens --tokenizer tokenizer.json --text-field text --eos
    torchrun --nproc-per-node 2 examples/train_gpt.py ./tokens --seq-len 255 --checkpoint ckpt/gpt.pt

gloo on CPU, nccl on GPU. The model is small on purpose (a few causal Transformer layers,
``--dim`` wide): what this shows is the data path. Each batch is ``input_ids`` and
``position_ids``, int64 ``[batch, seq_len + 1]``: the inputs are the first ``seq_len`` tokens,
the targets the last ``seq_len``; the positions restart at every document, and the attention
mask is built from them, so no token attends to another document (docs/tokens.md).

A run is one pass over the corpus, or ``--steps N`` steps on every rank (a run counted in steps:
``Schedule(steps=N)``, drawn from passes back to back), or ``--tokens T`` tokens trained on over
all ranks (``Schedule(tokens=T)``: T // (ranks * batch_size * seq_len) steps on every rank).

Preemption: with ``--checkpoint PATH`` rank 0 writes the model, optimizer, step and loader state
to PATH every ``--checkpoint-every`` steps (a temp file renamed over PATH: a kill mid-write
leaves the previous checkpoint), and a restart with the same ``--checkpoint`` resumes from it:
the same sequences, bit for bit, with the same world size and ``--workers``; every sequence not
yet trained on, once, on another. ``--record PREFIX`` appends one line per step to ``PREFIX.RANK``:
the step and a hash of each sequence of the batch (the example's test checks with it that a
killed and resumed run trains on every sequence of the epoch once).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardstream


class TinyGPT(nn.Module):
    """Token and position embeddings, causal Transformer layers, a head tied to the embedding."""

    def __init__(self, vocab: int, width: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(width, dim)  # position ids restart at each document: never above seq_len
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position(positions)
        x = self.blocks(x, mask=document_mask(positions, self.heads))
        return self.norm(x) @ self.embed.weight.T


def document_mask(positions: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal attention within each document: True where a query may not attend to a key, one
    [L, L] mask per sequence and head (``[B * heads, L, L]``, what ``nn.TransformerEncoder`` takes)."""
    document = (positions == 0).cumsum(dim=1)  # each token's document within its row
    n = positions.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril()
    allowed = (document[:, :, None] == document[:, None, :]) & causal
    return (~allowed).repeat_interleave(heads, dim=0)


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, loader_state: dict, step: int, rank: int) -> None:
    """Rank 0 writes (every rank received the same number of batches, so its loader state is
    everyone's); atomic: a temp file renamed over the old checkpoint. Then every rank waits for it."""
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": json.dumps(loader_state), "step": step}, tmp)
        os.replace(tmp, path)
    if torch.cuda.is_available():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", help="a token corpus (packed with `shardstream pack --tokenizer`, or written by others), local or s3://")
    parser.add_argument("--field", default=None, help="where the token ids are in a corpus written by others (a Parquet column, a .npy member)")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the manifest's (a corpus packed here names it)")
    parser.add_argument("--seq-len", type=int, default=255)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, metavar="N", help="steps on every rank (default: one pass over the corpus)")
    parser.add_argument("--tokens", type=float, default=None, metavar="T", help="tokens trained on over all ranks, e.g. 2e9 (instead of --steps)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, metavar="PATH", help="save here every N steps; resume from it when present")
    parser.add_argument("--checkpoint-every", type=int, default=100, metavar="N")
    parser.add_argument("--record", default=None, metavar="PREFIX", help="append each step's sequence hashes to PREFIX.RANK")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)  # the same initial model on every rank

    dataset = shardstream.ShardStream(
        shardstream.Tokens(args.data, seq_len=args.seq_len, field=args.field),
        batch_size=args.batch_size,
        seed=args.seed,
        schedule=shardstream.Schedule(steps=args.steps, tokens=args.tokens),
    )
    loader = shardstream.make_loader(dataset, num_workers=args.workers)
    vocab = args.vocab_size or (dataset.manifest.token_info or {}).get("vocab_size")  # the tokenizer's, in the manifest
    if vocab is None:
        parser.error(f"{args.data}: its manifest names no vocabulary size (a corpus written by others): give --vocab-size")
    gpt = TinyGPT(int(vocab), args.seq_len + 1, args.dim, args.layers, args.heads).to(device)
    model = nn.parallel.DistributedDataParallel(gpt, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        gpt.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(json.loads(saved["loader"]))  # one state for every rank, any world size
        step = int(saved["step"])
        resumed = dataset.resume_plan(loader.num_workers)  # exactly or elastically, as the loader's workers will run it
        if rank == 0:
            say(f"resumed from {args.checkpoint} at step {step}: {resumed.summary() if resumed else 'nothing left to run'}")
    elif rank == 0:
        say(dataset.plan(num_workers=loader.num_workers).summary())

    log = open(f"{args.record}.{rank}", "a") if args.record else None
    batches_in = shardstream.to_device(loader, device)
    loss_sum, batches, tokens = torch.zeros((), device=device), 0, 0
    started = time.perf_counter()
    for batch in batches_in:
        ids, positions = batch["input_ids"], batch["position_ids"]
        logits = model(ids[:, :-1], positions[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        batches += 1
        tokens += ids[:, :-1].numel()
        loss_sum += loss.detach()
        if log is not None:
            rows = ids.cpu().numpy()
            log.write(f"{step} {' '.join(hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest() for row in rows)}\n")
            log.flush()
        if args.checkpoint and step % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint, gpt, optimizer, batches_in.state_dict(), step, rank)
    elapsed = time.perf_counter() - started
    say(f"[rank {rank}] {batches} steps to step {step}, {tokens / max(elapsed, 1e-9):.0f} tokens/s, loss {float(loss_sum) / max(batches, 1):.3f}")
    if log is not None:
        log.close()
    dist.destroy_process_group()


def say(line: str) -> None:
    """One line in one write (ranks share the terminal)."""
    print(line + "\n", end="", flush=True)


if __name__ == "__main__":
    main()
