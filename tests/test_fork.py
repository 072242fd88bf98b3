"""DataLoader workers are forked from a process that already talks to S3: they start from the
parent's botocore session (service models loaded) and never run the finalizers of the parent's
S3 filesystems (each waited 0.1 s for an event loop that has no thread in the child)."""

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
