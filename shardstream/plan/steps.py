"""Training by steps: which batches of which epochs a worker yields when a run counts steps.

With ``steps=N`` every rank yields N batches per loader epoch, drawn from data epochs laid back
to back: global step g (counting from loader epoch e's first, g = e * N + t) is batch g % R of
data epoch g // R, where R is the batches each rank gets per data epoch. Each data epoch is a
fresh plan (a fresh permutation), and no rank ever runs out before another. Workers split a
rank's N steps contiguously, as they split an epoch's batches.
"""

from __future__ import annotations

from shardstream.errors import ConfigError


def worker_steps(steps: int, num_workers: int, worker: int) -> tuple[int, int]:
    """[first, first + count) of a rank's ``steps`` that worker ``worker`` yields."""
    base, extra = divmod(steps, max(1, num_workers))
    first = worker * base + min(worker, extra)
    return first, base + (1 if worker < extra else 0)


def step_windows(first_step: int, count: int, batches_per_epoch: int) -> list[tuple[int, int, int]]:
    """Global steps [first_step, first_step + count) as (data epoch, first batch, batches) windows."""
    if batches_per_epoch < 1:
        raise ConfigError(f"an epoch of 0 batches per rank cannot feed steps (batches_per_epoch={batches_per_epoch})")
    out = []
    step, end = first_step, first_step + count
    while step < end:
        epoch, batch = divmod(step, batches_per_epoch)
        take = min(batches_per_epoch - batch, end - step)
        out.append((epoch, batch, take))
        step += take
    return out
