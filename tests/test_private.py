"""Every private name of multiprocessing and s3fs shardstream uses (shardstream.private: at most
five, none of torch's) is there, and behaves as its accessor says, on the installed versions: .ci/matrix runs this file on
every (Python, torch) combination, so a release that renames one fails here, by name."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys

import pytest
import torch

from shardstream import private
from shardstream.private import PrivateNameGone


def test_every_private_name_resolves_on_these_versions():
    assert private.check() == list(private.NAMES)


def test_a_name_that_is_gone_raises_one_line_naming_it_and_the_versions(monkeypatch):
    monkeypatch.setitem(private.NAMES, "sys._gone_for_good", ("sys", "_gone_for_good", "a name no Python has"))
    import torch

    with pytest.raises(PrivateNameGone, match=r"sys\._gone_for_good \(a name no Python has\).*Python \d+\.\d+") as raised:
        private.resolve("sys._gone_for_good")
    assert f"Python {sys.version_info[0]}.{sys.version_info[1]}" in str(raised.value)
    assert f"torch {torch.__version__}" in str(raised.value)


def test_s3_names(s3):
    import s3fs
    from fsspec.asyn import sync

    bucket, options, _ = s3
    fs = s3fs.S3FileSystem(**options)
    assert fs in private.cached_s3_filesystems(s3fs)

    async def listing():
        return await private.s3_call(fs, "list_objects_v2", Bucket=bucket)

    assert sync(fs.loop, listing)["KeyCount"] == 0


class _Handle:
    """Pickled with a pipe's write end for a new process only; a plain pickle carries nothing."""

    def __init__(self, fd):
        self.fd = fd

    def __getstate__(self):
        return {"fd": private.dup_fd(self.fd)} if private.spawning() else {"fd": None}

    def __setstate__(self, state):
        self.fd = state["fd"].detach() if state["fd"] is not None else None


def _write_through(handle):
    os.write(handle.fd, b"through the passed descriptor")
    os.close(handle.fd)


def test_a_descriptor_travels_to_a_spawned_process_only_while_it_starts():
    r, w = os.pipe()
    try:
        assert not private.spawning()
        assert pickle.loads(pickle.dumps(_Handle(w))).fd is None  # a plain copy: not spawning
        proc = multiprocessing.get_context("spawn").Process(target=_write_through, args=(_Handle(w),))
        proc.start()
        os.close(w)
        w = -1
        proc.join(60)
        assert proc.exitcode == 0
        assert os.read(r, 100) == b"through the passed descriptor"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_at_most_five_names_and_none_of_torch():
    assert len(private.NAMES) <= 5 and len(private.NAMES) == 4  # each one's reason: private.NAMES
    assert not any(module.startswith("torch") for module, _, _ in private.NAMES.values())


def test_nothing_of_torch_multiprocessing_or_the_c_library_is_replaced_while_loaders_run(tmp_path):
    """The loader's runtimes leave the platform as they found it: every function of torch's storage,
    multiprocessing's launchers and pickler registry is the same object before and after passes
    with thread and process workers."""
    import copyreg
    import multiprocessing.reduction
    import multiprocessing.util

    from conftest import write_dataset

    from shardstream import ShardStream, World, make_loader

    def snapshot():
        return torch.UntypedStorage._new_shared, multiprocessing.util.spawnv_passfds, multiprocessing.util.Finalize

    def ours(table):  # reducers registered by shardstream (torch and multiprocessing register their own)
        return [t for t, fn in table.items() if getattr(fn, "__module__", "").startswith("shardstream")]

    before = snapshot()
    root = write_dataset(tmp_path / "d", 40, max_count=10)
    for workers in ("threads", "processes"):
        ds = ShardStream(root, batch_size=4, world=World(0, 1), shuffle=False)
        assert sum(len(b["__key__"]) for b in make_loader(ds, num_workers=2, workers=workers, log_interval=None)) == 40
    assert snapshot() == before
    assert ours(multiprocessing.reduction.ForkingPickler._extra_reducers) == ours(copyreg.dispatch_table) == []
