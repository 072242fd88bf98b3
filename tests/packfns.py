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
