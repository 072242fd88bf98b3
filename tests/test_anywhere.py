"""A loader works wherever users run it: functions and lambdas defined in a Jupyter kernel, in
``python -`` (a script on stdin) or ``python -c`` reach DataLoader workers under every start
method (sent by value where a worker cannot import them, shardstream/portable.py), webdataset's
own decoders included; and a worker that cannot rebuild what it was sent says its own error."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import make_samples, write_dataset

from shardstream import ShardStream, make_loader
from shardstream.pipeline.decode import webdataset_decoders

# What a notebook cell or a REPL user writes: a function of __main__ and a lambda over it, two
# workers. Prints the labels the loop received, sorted.
CELL = """
from shardstream import ShardStream, make_loader

def to_label(sample):
    return sample["cls"] + OFFSET

OFFSET = 100
ds = ShardStream({root!r}, batch_size=4, shuffle=False, transform=lambda s: to_label(s) * 2)
got = sorted(int(x) for batch in make_loader(ds, num_workers=2, start_method={method!r}) for x in batch)
print("LABELS", got)
"""


def expected(n: int) -> list[int]:
    return sorted((s["cls"] + 100) * 2 for s in make_samples(n))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return write_dataset(tmp_path_factory.mktemp("anywhere") / "ds", n=24, max_count=6)


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=120, env=env, cwd=os.getcwd())


@pytest.mark.parametrize(
    ("how", "method"),
    [("stdin", "forkserver"), ("stdin", "spawn"), ("-c", "forkserver"), ("-c", "spawn"), ("-c", "fork")],
)
def test_a_scripts_function_and_lambda_reach_workers_from_stdin_and_dash_c(root, how, method):
    code = CELL.format(root=root, method=method)
    done = _run(["-"], stdin=code) if how == "stdin" else _run(["-c", code])
    assert done.returncode == 0, done.stderr
    assert f"LABELS {expected(24)}" in done.stdout, done.stdout + done.stderr


def test_a_jupyter_kernels_cell_function_and_lambda_train_with_two_workers(root, tmp_path):
    """A real IPython kernel (ipykernel, driven by nbclient) runs a notebook that packs a dataset
    and iterates a 2-worker loader (forkserver, the default) with a cell's function and a lambda."""
    import nbformat
    from nbclient import NotebookClient

    cells = [
        "from shardstream import ShardWriter\n"
        f"with ShardWriter({str(tmp_path / 'nb')!r}, max_count=5) as w:\n"
        "    for i in range(20):\n"
        "        w.write({'__key__': f'k{i:03d}', 'cls': i})",
        "def to_label(sample):\n    return sample['cls'] + 1000",
        "from shardstream import ShardStream, make_loader\n"
        f"ds = ShardStream({str(tmp_path / 'nb')!r}, batch_size=4, shuffle=False, transform=lambda s: to_label(s))\n"
        "print(sorted(int(x) for b in make_loader(ds, num_workers=2) for x in b))",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=90, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("output_type") == "stream")
    assert out.strip() == str(list(range(1000, 1020))), nb.cells[-1].outputs


def _png(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (8, 6, 3), dtype=np.uint8)).save(buf, format="png")
    return buf.getvalue()


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_webdataset_decoders_work_with_workers(tmp_path, method):
    samples = [{"__key__": f"k{i:03d}", "png": _png(i), "cls": i, "json": {"i": i}} for i in range(8)]
    root = write_dataset(tmp_path / "img", samples=samples, max_count=4)
    ds = ShardStream(root, batch_size=2, shuffle=False, decode=webdataset_decoders("rgb8"), transform=lambda s: (s["png"], s["cls"], s["json"]["i"]))
    got = []
    for images, labels, ids in make_loader(ds, num_workers=2, start_method=method):
        assert images.shape == (2, 8, 6, 3) and str(images.dtype) == "torch.uint8"  # rgb8: HWC uint8, as webdataset gives
        got += [int(x) for x in labels]
        assert [int(x) for x in ids] == [int(x) for x in labels]
    assert sorted(got) == list(range(8))


# A module-level function whose module, imported afresh in a worker, lacks it (set on the module
# at run time): pickled by reference, it cannot be found there.
MISSING = """
import sys, types
sys.path.insert(0, {where!r})
import gone_mod
from shardstream import ShardStream, make_loader

def to_label(sample):
    return sample["cls"]

to_label.__module__, to_label.__qualname__ = "gone_mod", "to_label"
gone_mod.to_label = to_label
ds = ShardStream({root!r}, batch_size=4, transform=to_label)
try:
    for _ in make_loader(ds, num_workers=2, start_method={method!r}):
        pass
except Exception as exc:
    print("RAISED", type(exc).__name__)
    print(str(exc))
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_worker_that_cannot_rebuild_the_dataset_says_its_own_attribute_error(root, tmp_path, method):
    (tmp_path / "gone_mod.py").write_text("# to_label is set here at run time only\n")
    done = _run(["-c", textwrap.dedent(MISSING.format(where=str(tmp_path), root=root, method=method))])
    assert "RAISED AttributeError" in done.stdout, done.stdout + done.stderr
    assert "ShardStream could not be rebuilt in the worker: AttributeError: Can't get attribute 'to_label'" in done.stdout
    assert "__name__" not in done.stdout + done.stderr  # no main-guard advice: it does not apply here
