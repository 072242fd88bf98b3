"""A local tree packed by whole-shard workers (``write/localshards.py``): shards planned from file
sizes with the writer's own cut rule, so the bytes and the manifest are the same for any worker
count and the same as ``ShardWriter`` writing those samples; a worker's failure is one line and
leaves no shard that looks complete."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import scaled

from shardstream import ShardWriter
from shardstream.errors import SourceError
from shardstream.write.loading import run_task
from shardstream.write.localfiles import load_local
from shardstream.write.localshards import LocalShardTask, plan_shards, sample_size, write_local_shard
from shardstream.write.pack import auto_workers, pack
from shardstream.write.sources import list_source


def _tree(root, classes=3, per_class=70, seed=0):
    """JPEG-like files of varied sizes (a few over a tar block, one name long enough for a pax
    header) with a .json beside some, in class folders."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            stem = f"{i:04d}" if i != 5 else f"{i:04d}-" + "x" * 110
            (folder / f"{stem}.jpg").write_bytes(b"\xff\xd8\xff" + rng.bytes(int(rng.integers(100, 3000))))
            if i % 3 == 0:
                (folder / f"{stem}.json").write_bytes(json.dumps({"i": i}).encode())
    return root


def _files(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != "index.json"}


def _manifest(out):
    doc = json.loads((out / "index.json").read_text())
    doc.pop("created")
    return doc


@pytest.mark.parametrize("limits", [{"max_count": 25}, {"max_size": 40_000}, {"max_count": 30, "max_size": 60_000, "prefixes": 3}])
def test_any_worker_count_writes_the_same_bytes_and_manifest(tmp_path, limits):
    src = _tree(tmp_path / "src")
    outs = []
    for workers in (1, 2, 3, None):
        out = tmp_path / f"w{workers}"
        result = pack(str(src), str(out), label_from_dir=True, workers=workers, **limits)
        assert result.samples == 210
        outs.append(out)
    assert result.shards > 3
    for out in outs[1:]:
        assert _files(out) == _files(outs[0])
        assert _manifest(out) == _manifest(outs[0])


def test_the_plan_cuts_where_the_shard_writer_cuts(tmp_path):
    # The same samples through ShardWriter, one at a time: the same shards, byte for byte.
    src = _tree(tmp_path / "src", classes=2, per_class=60)
    listing = list_source(str(src), label_from_dir=True)
    limits = {"max_count": 17, "max_size": 30_000}
    with ShardWriter(str(tmp_path / "ref"), label_map=listing.label_map, **limits) as writer:
        for where, payload in listing.items:
            writer.write_encoded(*load_local(where, payload))
    pack(str(src), str(tmp_path / "planned"), label_from_dir=True, workers=2, **limits)
    assert _files(tmp_path / "planned") == _files(tmp_path / "ref")
    assert _manifest(tmp_path / "planned") == _manifest(tmp_path / "ref")
    sizes = [sample_size(item) for item in listing.items]
    assert [len(r) for r in plan_shards(sizes, **limits)] == [s.samples for s in writer.shards]


def test_plan_shards_is_the_writers_rule():
    assert plan_shards([], 10, 5000) == []
    assert plan_shards([600] * 5, 2, 10**6) == [range(0, 2), range(2, 4), range(4, 5)]
    # 1024 bytes of end-of-archive count: 3 x 1000 + 1024 > 4000 cuts after two
    assert plan_shards([1000] * 5, 10, 4000) == [range(0, 2), range(2, 4), range(4, 5)]
    assert plan_shards([9000, 10], 10, 4000) == [range(0, 1), range(1, 2)]  # a sample over the limit: a shard of its own


def test_auto_workers_is_one_unless_there_are_idle_cpus_shards_and_bytes_for_more():
    many = [range(i, i + 1) for i in range(8)]
    assert auto_workers(many, 10**9, cpus=2, load=0.2) == 2
    assert auto_workers(many, 10**9, cpus=16, load=0.0) == 8  # at most one a shard
    assert auto_workers(many[:1], 10**9, cpus=4, load=0.0) == 1  # one shard: one process writes it
    assert auto_workers(many, 10**6, cpus=4, load=0.0) == 1  # too little to pay for a worker's start
    assert auto_workers(many, 10**9, cpus=1, load=0.0) == 1
    assert auto_workers(many, 10**9, cpus=2, load=1.5) == 1  # the other core is busy
    assert auto_workers(many, 10**9, cpus=2, load=6.0) == 1
    assert auto_workers(many, 10**9, cpus=8, load=5.0) == 4  # three idle cores and this process


def test_a_file_gone_in_a_worker_fails_the_pack_and_no_shard_looks_complete(tmp_path, monkeypatch):
    src = _tree(tmp_path / "src")
    dest = tmp_path / "dest"
    dest.mkdir()  # a destination that existed: what the failed pack wrote stays, marked unfinished
    listing = list_source(str(src), label_from_dir=True)
    gone = listing.items[150][1][2][0][1]  # a file of a later shard
    from shardstream.write import pack as pack_module

    real = pack_module.plan_shards

    def plan_then_remove(*args):  # the file disappears once planned: a worker meets it, not the planner
        cuts = real(*args)
        os.unlink(gone)
        return cuts

    monkeypatch.setattr(pack_module, "plan_shards", plan_then_remove)
    with pytest.raises(SourceError, match=f"file not found: {gone}"):
        pack(str(src), str(dest), label_from_dir=True, max_count=20, workers=2)
    names = [p.name for p in dest.rglob("*")]
    assert "index.json" not in names and not [n for n in names if ".partial-" in n]
    assert ".shardstream-packing" in names  # the shards written before it read as an unfinished pack


def test_a_file_that_changed_size_since_its_stat_is_a_bad_sample(tmp_path):
    src = _tree(tmp_path / "src", classes=1, per_class=40)
    items = list_source(str(src), label_from_dir=True).items[:10]
    sizes = [sample_size(item) for item in items]
    changed = items[7][1][2][0][1]
    with open(changed, "ab") as f:  # a writer changing the file under the pack
        f.write(bytes(600))  # (past its tar block: a change within one leaves the plan true)
    out = tmp_path / "out"
    out.mkdir()
    task = LocalShardTask(str(out), "shard-000000.tar", items, sizes)
    with pytest.raises(SourceError, match="changed size while it was being packed") as caught:
        write_local_shard(task)
    assert caught.value.where == items[7][0]
    assert os.listdir(out) == []  # no shard, no partial file
    done = write_local_shard(LocalShardTask(str(out), "shard-000000.tar", items, sizes, on_error="skip"))
    assert [position for position, _, _ in done.skipped] == [7] and done.samples == 9
    assert sorted(os.listdir(out)) == ["shard-000000.tar", "shard-000000.tar.idx", "shard-000000.tar.members"]
    # the member sidecar holds the 9 samples written, none of the one left out: what a scan records
    from shardstream.format.scan import scan_url

    assert (out / "shard-000000.tar.members").read_bytes() == scan_url(str(out / "shard-000000.tar"), members=True).members


def test_a_worker_writes_a_shard_importing_nothing_heavy(tmp_path):
    # What a spawned worker runs for a local tree (loading.run_task), in a fresh interpreter: the
    # same shard as in this process, with no fsspec, pyarrow or format package imported (numpy
    # only, at the shard's first block, for its member sidecar's fingerprints).
    src = _tree(tmp_path / "src", classes=2, per_class=10)
    items = list_source(str(src), label_from_dir=True).items
    sizes = [sample_size(item) for item in items]
    for name in ("here", "there"):
        (tmp_path / name).mkdir()
    here = run_task(LocalShardTask(str(tmp_path / "here"), "shard-000000.tar", items, sizes))
    heavy = ("fsspec", "pyarrow", "torch", "shardstream.storage.fs", "shardstream.format", "shardstream.write.sources")
    script = textwrap.dedent(
        f"""
        import pickle, sys
        from shardstream.write.loading import run_task
        done = run_task(pickle.loads(sys.stdin.buffer.read()))
        sys.stdout.buffer.write(pickle.dumps((done, [m for m in {heavy!r} if m in sys.modules])))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    task = LocalShardTask(str(tmp_path / "there"), "shard-000000.tar", items, sizes)
    ran = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(task), capture_output=True, env=env, timeout=scaled(60))
    assert ran.returncode == 0, ran.stderr.decode()
    there, imported = pickle.loads(ran.stdout)
    assert imported == []
    assert there == here and there.samples == 20
    assert _files(tmp_path / "there") == _files(tmp_path / "here")


def _contexts(monkeypatch):
    """The start method of every pool the pack starts (``procs.Workers``' ``context``)."""
    from shardstream.write import pack as pack_module
    from shardstream.write.procs import Workers

    seen: list[str] = []

    class Recorded(Workers):
        def __init__(self, *args, context="spawn", **kwargs):
            seen.append(context)
            super().__init__(*args, context=context, **kwargs)

    monkeypatch.setattr(pack_module, "Workers", Recorded)
    return seen


def test_workers_are_forked_holding_the_listing_where_no_other_thread_runs(tmp_path):
    # In a process of one thread (the CLI's, a script's; not this one: pytest-timeout runs a
    # thread beside each test) the workers fork after the listing, holding it (no pickled item,
    # no new Python) and share the stat; any count writes the same bytes as one process.
    src = _tree(tmp_path / "src")
    pack(str(src), str(tmp_path / "one"), label_from_dir=True, workers=1, max_count=25)
    script = textwrap.dedent(
        f"""
        import json, threading
        from shardstream.write import pack as pack_module
        from shardstream.write.procs import Workers

        seen = []

        class Recorded(Workers):
            def __init__(self, *args, context="spawn", **kwargs):
                seen.append((context, threading.active_count()))
                super().__init__(*args, context=context, **kwargs)

        pack_module.Workers = Recorded
        for workers in (2, 3):
            pack_module.pack({str(src)!r}, {str(tmp_path)!r} + f"/w{{workers}}", label_from_dir=True, workers=workers, max_count=25)
        print(json.dumps(seen))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, env=env, timeout=scaled(120))
    assert ran.returncode == 0, ran.stderr.decode()
    assert json.loads(ran.stdout) == [["fork", 1], ["fork", 1]]
    for workers in (2, 3):
        assert _files(tmp_path / f"w{workers}") == _files(tmp_path / "one")
        assert _manifest(tmp_path / f"w{workers}") == _manifest(tmp_path / "one")


def test_a_process_with_another_thread_spawns_its_workers_and_writes_the_same_bytes(tmp_path, monkeypatch):
    # A fork copies only the calling thread (a lock another one holds stays held in the child):
    # with a second thread alive the workers are spawned and get each shard's items.
    import threading

    seen = _contexts(monkeypatch)
    src = _tree(tmp_path / "src")
    pack(str(src), str(tmp_path / "one"), label_from_dir=True, workers=1, max_count=25)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="the user's thread")
    other.start()
    try:
        pack(str(src), str(tmp_path / "two"), label_from_dir=True, workers=2, max_count=25)
    finally:
        stop.set()
        other.join()
    assert seen == ["spawn"]
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
    assert _manifest(tmp_path / "two") == _manifest(tmp_path / "one")


def test_a_task_by_positions_is_refused_without_its_listing(tmp_path):
    task = LocalShardTask(str(tmp_path), "shard-000000.tar", (), [1024], positions=range(0, 1))
    with pytest.raises(ValueError, match="runs on the listing that holds them"):
        write_local_shard(task)
    assert os.listdir(tmp_path) == []
