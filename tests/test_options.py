"""options.py and ShardStream's surface: grouped options check themselves; defaults are documented values."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading

import pytest
from conftest import _child_pids, _leaked_threads, rank_context, scaled, write_dataset

import shardstream
from shardstream import Cache, ConfigError, Decode, OnError, Read, Schedule, ShardStream, Shuffle, StorageConfig, Store, World
from shardstream.options import DEFAULT_READAHEAD


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Shuffle(buffer=-1), "buffer"),
        (lambda: Shuffle(initial=0), "initial"),
        (lambda: Decode(image="jpeg"), "image"),
        (lambda: Decode(decoders=[1]), "decoders"),
        (lambda: OnError("ignore"), "on_error"),
        (lambda: OnError("skip", tolerance=-1), "tolerance"),
        (lambda: Read(read_size=0), "read_size"),
        (lambda: Read(readahead_bytes=-1), "readahead_bytes"),
        (lambda: Cache("/tmp/c", 0), "limit"),
        (lambda: Store(options="endpoint"), "options"),
        (lambda: Store(read=4096), r"Store\(read=...\) must be a Read"),
        (lambda: Schedule(steps=0), "steps"),
        (lambda: Schedule(steps=3, samples_per_epoch=9), "not both"),
        (lambda: Schedule(samples_per_epoch=True), "samples_per_epoch"),
        (lambda: Schedule(per_batch="even"), "per_batch"),
    ],
)
def test_bad_options_are_config_errors_at_the_call_that_made_them(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_conveniences_map_onto_the_values():
    assert Decode.of(False) == Decode(defaults=False) and Decode.of(True) == Decode()
    assert Decode.of({"x": int}).decoders == {"x": int}
    assert OnError.of("skip") == OnError("skip") and Decode(required="cls").required == ("cls",)
    assert Shuffle(100).initial_fill == 10 and Shuffle(5).initial_fill == 1 and Shuffle(100, 7).initial_fill == 7
    with pytest.raises(ConfigError, match="decode must be"):
        Decode.of("yes")  # type: ignore[arg-type]


def test_readahead_default_is_by_where_the_shards_are():
    assert Read().readahead_for(["/data/a.tar", "file:///data/b.tar"]) == 0
    assert Read().readahead_for(["/data/a.tar", "s3://b/c.tar"]) == DEFAULT_READAHEAD
    assert Read(readahead_bytes=5).readahead_for(["s3://b/c.tar"]) == 5


def test_the_common_call_is_one_line_and_options_land(tmp_path):
    root = write_dataset(tmp_path / "d", 40, max_count=10)
    ds = ShardStream(root, batch_size=4)
    assert ds.shuffler == Shuffle() and ds.decode == Decode() and ds.on_error == OnError() and ds.readahead_bytes == 0
    ds = ShardStream(
        root,
        batch_size=4,
        shuffle=False,
        decode=False,
        on_error="skip",
        world=World(1, 2),
        store=Store(read=Read(readahead_bytes=1 << 20, read_size=4096)),
    )
    assert ds.shuffler is None and ds.on_error.policy == "skip" and ds.readahead_bytes == 1 << 20
    assert isinstance(next(iter(ds))["txt"][0], bytes) and len(ds) == 5


@pytest.mark.parametrize(
    "old,new",
    [
        ({"storage_options": {}}, r"store=Store\(options=\{...\}\)"),
        ({"storage": StorageConfig()}, r"store=Store\(config=StorageConfig\(...\)\)"),
        ({"read": Read()}, r"store=Store\(read=Read\(...\)\)"),
        ({"cache": None}, r"store=Store\(cache=Cache\(...\)\)"),
        ({"steps": 10}, r"schedule=Schedule\(steps=N\)"),
        ({"samples_per_epoch": 100}, r"schedule=Schedule\(samples_per_epoch=S\)"),
        ({"per_batch": "exact"}, r"schedule=Schedule\(per_batch=...\)"),
    ],
)
def test_old_spellings_are_refused_naming_the_new_one(tmp_path, old, new):
    root = write_dataset(tmp_path / "d", 20, max_count=10)
    with pytest.raises(ConfigError, match=rf"ShardStream\({next(iter(old))}=...\) moved: pass {new}"):
        ShardStream(root, batch_size=4, **old)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bach_size'"):
        ShardStream(root, batch_size=4, bach_size=4)
    with pytest.raises(ConfigError, match=r"from_urls\(storage_options=...\) moved"):
        ShardStream.from_urls(f"{root}/shard-*.tar", batch_size=4, storage_options={})


def test_the_front_door_takes_at_most_twelve_parameters():
    named = [
        p for p in inspect.signature(ShardStream.__init__).parameters.values() if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    assert len(named) <= 12, [p.name for p in named]
    assert {p.name for p in named} >= {"source", "batch_size", "store", "schedule"}


def test_the_package_exports_real_names():
    assert sorted(shardstream.__all__) == sorted([*shardstream._EXPORTS, "__version__"])
    for name in shardstream._EXPORTS:
        assert getattr(shardstream, name).__name__ == name


def test_the_leak_check_sees_threads_and_processes():
    before = set(threading.enumerate())
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="leaky")
    t.start()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert [x.name for x in _leaked_threads(before)] == ["leaky"]
        assert proc.pid in _child_pids()
    finally:
        stop.set()
        t.join()
        proc.kill()
        proc.wait()
    assert _leaked_threads(before) == [] and proc.pid not in _child_pids()


def test_the_leak_check_sees_what_the_forkserver_started():
    """A process forked by multiprocessing's forkserver (a DataLoader worker, a rank) is the
    server's child, not this process's: the leak check sees it all the same, until it exits."""
    import time

    proc = rank_context().Process(target=time.sleep, args=(60,))
    proc.start()
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        assert parent != os.getpid()  # the server's
        assert proc.pid in _child_pids()
    finally:
        proc.kill()
        proc.join(scaled(30))
    assert proc.pid not in _child_pids()
