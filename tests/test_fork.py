"""DataLoader workers are forked from a process that already talks to S3: they start from the
parent's botocore session (service models loaded) and never run the finalizers of the parent's
S3 filesystems (each waited 0.1 s for an event loop that has no thread in the child). Workers
forked from a process that has only read through obstore (their reads go through s3fs) start
from an s3fs client the loader made in the parent just before the fork: no session, no parsed
model file and no credential lookup of their own."""

from __future__ import annotations

import multiprocessing
import os

import s3fs
from conftest import scaled, write_dataset

from shardstream import ShardStream, Store, World, make_loader
from shardstream.storage import fs as storage


def _count_calls_in_children(path):
    original = s3fs.S3FileSystem.close_session
    parent = os.getpid()

    def close_session(loop, s3):
        if os.getpid() != parent:
            with open(path, "a") as f:
                f.write(f"{os.getpid()}\n")
        return original(loop, s3)

    return original, close_session


def test_workers_never_finalize_the_parents_s3_filesystems(s3, tmp_path, monkeypatch):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/d", 40, max_count=5, storage_options=options)
    # a few filesystems in the parent, as a job that also writes or lists has
    for extra in ({"use_listings_cache": False}, {"default_block_size": 1 << 20}):
        storage.get_fs(url, {**options, **extra})[0].ls(bucket)
    log = tmp_path / "finalized"
    _, patched = _count_calls_in_children(str(log))
    monkeypatch.setattr(s3fs.S3FileSystem, "close_session", staticmethod(patched))
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options))
    keys = [k for b in make_loader(ds, num_workers=2, multiprocessing_context="fork") for k in b["__key__"]]
    assert len(keys) == len(set(keys)) == 40
    assert not log.exists(), f"workers ran s3fs finalizers: {log.read_text()}"
    assert storage._inherited == []  # the parent holds no extra references after the fork


def _child_session(queue, options, parents):
    queue.put(id(storage.shared_s3_session(options)) == parents)


def test_forked_children_start_from_the_parents_session(s3, monkeypatch):
    _, options, _ = s3
    session = storage.shared_s3_session(options)
    assert session is storage.shared_s3_session({"endpoint_url": "http://elsewhere"})  # one per profile and environment
    assert storage.shared_s3_session({**options, "session": object()}) is None  # the user's own
    assert storage.shared_s3_session({**options, "some_session_arg": 1}) is None  # arguments we do not know
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_session, args=(queue, options, id(session)))
    child.start()
    assert queue.get(timeout=scaled(60)) is True  # the very object the parent made (and warmed)
    child.join(scaled(60))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "rotated")  # credentials resolve again under a new environment
    assert storage.shared_s3_session(options) is not session


def test_every_s3_filesystem_shares_the_session(s3):
    # the readers' filesystems (s3fs's path) carry their own retry policy in config_kwargs; they once made a
    # botocore session (and parsed its models) of their own in every process
    from shardstream.storage.config import StorageConfig
    from shardstream.storage.ranges import resolve

    bucket, options, _ = s3
    session = storage.shared_s3_session(options)
    assert storage.get_fs(f"s3://{bucket}/x", options)[0].session is session
    assert resolve(f"s3://{bucket}/x", options, StorageConfig(s3_client="s3fs"))[0].session is session
    user_retries = {**options, "config_kwargs": {"retries": {"max_attempts": 2}}}
    assert storage.get_fs(f"s3://{bucket}/x", user_retries)[0].session is session


def test_workers_make_no_botocore_session_of_their_own(s3, tmp_path, monkeypatch):
    import botocore.session

    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/w", 40, max_count=5, storage_options=options)
    log = tmp_path / "sessions"
    parent, original = os.getpid(), botocore.session.Session.__init__

    def init(self, *args, **kwargs):
        if os.getpid() != parent:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
        original(self, *args, **kwargs)

    monkeypatch.setattr(botocore.session.Session, "__init__", init)
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options))
    keys = [k for b in make_loader(ds, num_workers=2, multiprocessing_context="fork") for k in b["__key__"]]
    assert len(keys) == len(set(keys)) == 40
    assert not log.exists(), f"workers made botocore sessions: {log.read_text()}"


def test_fork_workers_of_an_obstore_reader_make_no_session_models_or_credentials(s3, tmp_path, monkeypatch):
    import botocore.loaders
    import botocore.session
    from aiobotocore.credentials import AioCredentialResolver

    from shardstream.storage import objects

    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/o", 40, max_count=5, storage_options=options)
    monkeypatch.setattr(storage, "_sessions", {})  # a job that only reads: no s3fs session in this process yet
    log, parent = tmp_path / "made", os.getpid()

    def counted(cls, name):
        original = getattr(cls, name)

        def call(self, *args, **kwargs):
            if os.getpid() != parent:
                with open(log, "a") as f:
                    f.write(f"{os.getpid()} {cls.__name__}.{name}\n")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, call)

    counted(botocore.session.Session, "__init__")  # aiobotocore's AioSession too (a subclass)
    counted(botocore.loaders.JSONFileLoader, "load_file")  # a service model or endpoint file parsed
    counted(AioCredentialResolver, "load_credentials")  # the credential chain walked
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options))
    assert objects._runtime_pid == parent and storage._sessions == {}  # the manifest came through obstore
    keys = [k for b in make_loader(ds, num_workers=2, start_method="fork", pin_memory=False) for k in b["__key__"]]
    assert len(keys) == len(set(keys)) == 40
    assert not log.exists(), f"forked workers made their own:\n{log.read_text()}"
    assert len(storage._sessions) == 1  # the one the parent made for them


def test_nothing_is_made_ahead_of_a_fork_whose_workers_use_obstore_or_read_local_files(s3, tmp_path, monkeypatch):
    from shardstream.storage import objects
    from shardstream.storage.config import StorageConfig
    from shardstream.storage.ranges import ready_for_fork

    bucket, options, _ = s3
    monkeypatch.setattr(storage, "_sessions", {})
    monkeypatch.setattr(objects, "_runtime_pid", None)  # obstore never ran here: forked workers start it afresh
    ready_for_fork(f"s3://{bucket}/d", options, StorageConfig())
    ready_for_fork(str(tmp_path), None, StorageConfig())
    assert storage._sessions == {}
    ready_for_fork(f"s3://{bucket}/d", options, StorageConfig(s3_client="s3fs"))  # workers on s3fs's path
    assert len(storage._sessions) == 1


def test_a_client_that_cannot_be_made_ahead_of_a_fork_is_left_to_the_workers(s3_endpoint, tmp_path, monkeypatch):
    from conftest import forget_aws_credentials

    from shardstream.storage.config import StorageConfig
    from shardstream.storage.ranges import ready_for_fork

    forget_aws_credentials(monkeypatch, tmp_path)
    monkeypatch.setattr(storage, "_sessions", {})
    ready_for_fork("s3://bucket/d", {"endpoint_url": s3_endpoint, "profile": "nobody"}, StorageConfig(s3_client="s3fs"))
    assert storage._sessions == {}  # (the unknown profile: the workers' first read says so)


_forks: list[str] | None = None  # while a test sets it: a line per fork of this process


def _note_fork() -> None:
    if _forks is not None:
        _forks.append("fork")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_note_fork)


def test_fork_workers_get_the_storage_clients_made_before_the_fork(s3, monkeypatch):
    """A loader whose workers fork makes their storage clients once, in the rank, before it forks
    them: every worker inherits the same (none makes its own at its first read)."""
    import shardstream.loader as loader_module

    global _forks
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/a", 20, max_count=5, storage_options=options)
    ds = ShardStream(url, batch_size=4, shuffle=False, world=World(0, 1), store=Store(options=options))
    events: list[str] = []
    ready = loader_module.ready_storage_for_fork

    def noting(*args):
        events.append("readied")
        ready(*args)

    monkeypatch.setattr(loader_module, "ready_storage_for_fork", noting)
    loader = make_loader(ds, num_workers=2, start_method="fork", pin_memory=False)
    assert events == []  # (nothing before the first pass)
    _forks = events
    try:
        keys = [k for b in loader for k in b["__key__"]]
    finally:
        _forks = None
    assert len(keys) == len(set(keys)) == 20
    assert events[0] == "readied" and events.count("fork") >= 2 and "readied" not in events[1:], events
