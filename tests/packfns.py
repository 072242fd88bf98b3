"""Functions that ``pack(fn, inputs, workers=N)`` runs in its spawned process pool. A spawned worker
imports the module that defines ``fn``; this one imports nothing, where a test module imports the
suite's world (test_scale.py: dask's distributed, PIL, the CLI: about 2 s of CPU per worker)."""

from __future__ import annotations


def make_pair(i):
    """A module-level fn for pack(fn, inputs): one sample per input, two for multiples of 7."""
    out = [{"__key__": f"in{i:04d}", "txt": f"input {i}", "cls": i % 5}]
    if i % 7 == 0:
        out.append({"__key__": f"in{i:04d}b", "txt": f"extra {i}", "cls": 9})
    return iter(out)


def square_slowly(i):
    """For write.procs' tests: later tasks finish first (results must still come in order)."""
    import time

    time.sleep(0.002 * (i % 5))
    return i * i


def fail_at_seven(i):
    """For write.procs' tests: a typed error from a worker, with a message of two lines."""
    if i == 7:
        from shardstream.errors import SourceError

        raise SourceError(f"item {i}", "cannot be loaded\nsecond line")
    return i


class Unpicklable(Exception):
    def __init__(self, a, b):  # pickled by its args (one): cannot be rebuilt
        super().__init__(f"{a}-{b}\nmore")


def fail_unpicklably(i):
    if i == 3:
        raise Unpicklable(1, 2)
    return i


def die_at_five(i):
    """For write.procs' tests: the worker killed as the OOM killer kills it, mid-task."""
    import os
    import signal

    if i == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return i


def pid_and_wait(i):
    """For write.procs' tests: the worker's pid, then a long task (its parent is killed meanwhile)."""
    import os
    import time

    if i < 2:
        return os.getpid()
    time.sleep(600)
    return i
