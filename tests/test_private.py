"""Every private name of torch, multiprocessing, s3fs and botocore shardstream uses (shardstream.private)
is there, and behaves as its accessor says, on the installed versions: .ci/matrix runs this file on
every (Python, torch) combination, so a release that renames one fails here, by name."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import rank_context, scaled

from shardstream import private
from shardstream.private import PrivateNameGone


def test_every_private_name_resolves_on_these_versions():
    assert private.check() == list(private.NAMES)


def test_a_name_that_is_gone_raises_one_line_naming_it_and_the_versions(monkeypatch):
    monkeypatch.setitem(private.NAMES, "sys._gone_for_good", ("sys", "_gone_for_good", "a name no Python has"))
    with pytest.raises(PrivateNameGone, match=r"sys\._gone_for_good \(a name no Python has\).*Python \d+\.\d+"):
        private.resolve("sys._gone_for_good")


def test_shared_storage_and_its_use_count():
    storage = private.new_shared_storage(4096)
    assert storage.is_shared() and storage.nbytes() == 4096
    before = private.storage_use_count(storage)
    tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
    assert private.storage_use_count(storage) == before + 1
    del tensor
    assert private.storage_use_count(storage) == before


def test_pin_memory_walks_a_nested_batch():
    if not torch.cuda.is_available():  # pinning needs an accelerator; the function is still there
        assert callable(private.resolve("torch.utils.data._utils.pin_memory.pin_memory"))
        return
    batch = private.pin_memory({"x": torch.zeros(3), "y": [torch.ones(2)]}, "cuda")
    assert batch["x"].is_pinned() and batch["y"][0].is_pinned()


# DataLoader workers below start from the suite's forkserver (torch imported once there; spawn
# imported it in each worker): what is checked is the iterator's private names, whatever started them
class _Four(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(4)


def test_a_dataloader_iterator_with_workers_shows_them_times_out_and_shuts_down():
    loader = torch.utils.data.DataLoader(_Four(), num_workers=1, persistent_workers=True, multiprocessing_context=rank_context())
    assert private.loader_iterator(loader) is None
    it = iter(loader)
    workers = private.iterator_workers(it)
    assert workers is not None and len(workers) == 1
    first = next(it)
    assert first.tolist() == [0]
    assert private.owed_worker(it) in (0, None)
    assert private.loader_iterator(loader) is it
    private.set_iterator_timeout(it, 120)
    assert [b.item() for b in it] == [1, 2, 3]
    assert private.drop_loader_iterator(loader) is it and private.loader_iterator(loader) is None
    private.shutdown_workers(it)
    workers[0].join(30)
    assert not workers[0].is_alive()
    assert private.iterator_workers(iter(torch.utils.data.DataLoader(_Four()))) is None  # no workers


def test_the_iterator_timeout_is_recognised_by_its_message():
    loader = torch.utils.data.DataLoader(_Slow(), num_workers=1, timeout=0.01, multiprocessing_context=rank_context())
    it = iter(loader)
    with pytest.raises(RuntimeError) as raised:
        next(it)
    assert private.is_iterator_timeout(raised.value) and not private.is_iterator_timeout(RuntimeError("other"))
    private.shutdown_workers(it)


class _Slow(torch.utils.data.IterableDataset):
    def __iter__(self):
        import time

        time.sleep(60)
        yield 0


def test_multiprocessing_names():
    assert isinstance(private.forkserver_running(), bool)
    assert isinstance(private.forkserver_preload(), list)
    assert private.python_threads() >= 1
    ctx = multiprocessing.get_context("spawn")
    mark = max((key[1] for key in private.finalizer_registry()), default=-1)
    lock = ctx.Lock()  # a named semaphore, with its finalizer
    found = list(private.semaphore_finalizers(mark))
    assert len(found) == 1 and isinstance(found[0][0], str)
    assert private.semaphore_name(lock) == found[0][0]
    name, fin = found[0]
    fin.cancel()
    private.sem_unlink(name)
    private.tracker_unregister(name, "semaphore")
    with lock:  # still works through its handle
        pass


def test_a_pool_given_up_on_stops_and_says_nothing_when_collected(capfd):
    pool = multiprocessing.get_context("spawn").Pool(1)
    assert pool.apply(abs, (-3,)) == 3
    workers = list(pool._pool)
    private.abandon_pool(pool)
    assert not any(w.is_alive() for w in workers)
    del pool
    import gc

    gc.collect()
    assert "Exception ignored" not in capfd.readouterr().err


def test_s3_names(s3):
    import s3fs
    from fsspec.asyn import sync

    bucket, options, _ = s3
    fs = s3fs.S3FileSystem(**options)
    assert fs in private.cached_s3_filesystems(s3fs)

    async def listing():
        return await private.s3_call(fs, "list_objects_v2", Bucket=bucket)

    assert sync(fs.loop, listing)["KeyCount"] == 0


def test_the_module_lists_the_python_version():
    assert f"Python {sys.version_info[0]}.{sys.version_info[1]}" in private.versions()


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


def test_the_resource_tracker_starts_in_a_session_of_its_own():
    code = textwrap.dedent("""
        import os, time
        from shardstream import private
        started = private.resource_tracker_in_own_session()
        again = private.resource_tracker_in_own_session()  # running: left alone
        tracker = private.resolve("multiprocessing.resource_tracker._resource_tracker")
        while os.getsid(tracker._pid) == os.getsid(0):  # until its first line, os.setsid(), has run
            time.sleep(0.01)
        print(started, again, os.getpgid(tracker._pid) != os.getpgid(0))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "True"]
