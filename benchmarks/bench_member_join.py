"""A DataLoader worker's own work on large members, without a store: the tar parse of 4 MiB
members arriving in obstore's 64 KiB pieces, and the copy of each member into one reused
destination (what the hand-off does into the batch's shared segment), in process CPU ms per MB,
for source trees side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_member_join.py --trees /tmp/base . [--rounds 3] [--passes 15]

Each round runs every tree in turn, each in a fresh process with that tree first on ``PYTHONPATH``.
The pieces are made before the clock (making them is obstore's work); a tree whose parser has
``join_later`` hands such members over unjoined (``format.tar.Unjoined``) and they are copied
into place from their pieces; with ``--joined`` (or an older tree) they are joined into ``bytes``
first and then copied. Medians of ``--passes`` passes after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MB = 1 << 20
PIECE = 64 << 10


class Pieces:
    """``read(n)`` and ``pieces(n)`` over bytes cut into PIECE-sized ``bytes`` up front, handed
    over as views of them (as read-ahead hands over obstore's pieces)."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0
        self.cut = [data[i : i + PIECE] for i in range(0, len(data), PIECE)]

    def __call__(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    def pieces(self, n: int) -> list:
        out = []
        while n > 0 and self.pos < len(self.data):
            i, at = divmod(self.pos, PIECE)
            piece = memoryview(self.cut[i])[at : at + n]
            out.append(piece)
            n -= len(piece)
            self.pos += len(piece)
        return out


def child(args: argparse.Namespace) -> None:
    import numpy as np

    from shardstream.format.tar import END_OF_ARCHIVE, iter_sample_dicts, member_header, padding

    blob = np.random.default_rng(0).bytes(4 * MB)
    data = b"".join(member_header(f"{i:04d}.npy", len(blob) + i) + blob + b"x" * i + padding(len(blob) + i) for i in range(args.members))
    data += END_OF_ARCHIVE
    kwargs: dict[str, Any] = {"join_later": True} if "join_later" in iter_sample_dicts.__code__.co_varnames and not args.joined else {}
    dest = np.empty(5 * MB, np.uint8)

    def one() -> float:
        stream = Pieces(data)
        start = time.process_time()
        for samples in iter_sample_dicts(stream, url="mem://x.tar", end=len(data), read_size=4 * MB, **kwargs):
            for sample in samples:
                value = sample["npy"]
                if isinstance(value, bytes):
                    dest[: len(value)] = np.frombuffer(value, np.uint8)
                else:
                    value.copy_into(memoryview(dest[: len(value)]))  # type: ignore[arg-type]
        return (time.process_time() - start) * 1e3 / (len(data) / MB)

    one()
    runs = [one() for _ in range(args.passes)]
    print(f"ROW {statistics.median(runs):.3f} {min(runs):.3f} {max(runs):.3f} {'unjoined' if kwargs else 'joined'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=[os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--members", type=int, default=64)
    parser.add_argument("--joined", action="store_true", help="join members into bytes first, whatever the tree can do")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(f"1-minute load {os.getloadavg()[0]:.2f} at the start")
    rows: dict[str, list[float]] = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            command = [sys.executable, os.path.abspath(__file__), "--child", "--passes", str(args.passes), "--members", str(args.members)]
            command += ["--joined"] if args.joined else []
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False, cwd="/")
            if done.returncode:
                sys.exit(f"{tree}: exit {done.returncode}\n{done.stderr[-3000:]}")
            line = next(line for line in done.stdout.splitlines() if line.startswith("ROW "))
            rows[tree].append(float(line.split()[1]))
            print(tree, line[4:], flush=True)
    print(f"1-minute load {os.getloadavg()[0]:.2f} at the end")
    print("| tree | parse and copy, CPU ms/MB: median of rounds (range) |")
    print("|---|---|")
    for tree, seen in rows.items():
        print(f"| {tree} | {statistics.median(seen):.3f} ({min(seen):.3f}-{max(seen):.3f}) |")


if __name__ == "__main__":
    main()
