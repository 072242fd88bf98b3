"""What a fresh shared-memory segment costs: the batch buffers DataLoader workers fill and hand over.

    OMP_NUM_THREADS=1 python benchmarks/bench_shm.py [--mb 128] [--repeats 6]

Fills a buffer of --mb MiB with one copy, four ways, medians over --repeats:
  warm numpy       memory already mapped (the floor: one memcpy)
  fresh shm        torch.UntypedStorage._new_shared, what torch's own collate uses in a worker:
                   every 4 KiB page faults in on first touch
  fresh shm, populated   shardstream.buffers.new_shared: the same, with its pages mapped by one
                   madvise(MADV_POPULATE_WRITE) call
  warm shm         a segment that is already mapped (what reusing segments would cost)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from shardstream.buffers import new_shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    size = args.mb << 20
    src = np.ones(size, np.uint8)
    warm_numpy = np.ones(size, np.uint8)
    warm_shm = new_shared(size)

    def as_array(storage):
        return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()

    ways = {
        "warm numpy": lambda: warm_numpy,
        "fresh shm (torch)": lambda: as_array(torch.UntypedStorage._new_shared(size)),
        "fresh shm, populated (new_shared)": lambda: as_array(new_shared(size)),
        "warm shm": lambda: as_array(warm_shm),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, make in ways.items():
            t = time.perf_counter()
            out = make()
            np.copyto(out, src)
            times[name].append(time.perf_counter() - t)
            del out
    floor = statistics.median(times["warm numpy"])
    print(f"| buffer ({args.mb} MiB, allocate + one copy) | ms | GB/s | vs one warm copy |")
    print("|---|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med * 1e3:.1f} | {size / med / 1e9:.2f} | {med / floor:.1f}x |")


if __name__ == "__main__":
    main()
