"""Shared fixtures: a real moto S3 server on 127.0.0.1 (real HTTP through s3fs and boto3), small
datasets (``write_dataset``, ``make_samples``, ``write_image_folder``), and a check, run around
every test, that it leaves no thread or child process behind."""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import signal
import socket
import threading
import time
import uuid

import numpy as np
import pytest
from PIL import Image

# -- waits that scale with the machine's load ----------------------------------------------------
# A loaded machine is slower, not broken: every fixed wait in the tests (a rank's start, a child's
# exit, a subprocess's run) and every test's own bound (pytest-timeout) is stretched by the load
# per core when the wait begins. Two DDP tests failed their 120 s start-up wait on a 2-core machine
# running a whole suite (load about 2.5 per core) and passed alone.
MAX_LOAD_FACTOR = 6.0


def load_factor() -> float:
    """How many times slower than idle this machine may be now: the 1-minute load average per core,
    at least 1 and at most MAX_LOAD_FACTOR (1 where the platform has no load average)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 1.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_LOAD_FACTOR, max(1.0, load / max(1, cores)))


def scaled(seconds: float) -> float:
    """``seconds`` stretched by ``load_factor()``: the bound of any wait in a test."""
    return seconds * load_factor()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's pytest-timeout bound (its ``timeout`` mark, else --timeout or the ini's) scaled
    like every wait in it, as the test starts (run before pytest-timeout reads the bound)."""
    marker = item.get_closest_marker("timeout")
    base = None
    if marker is not None:
        base = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    if base is None:
        base = item.config.getoption("timeout", None) or item.config.getini("timeout")
    try:
        base = float(base)
    except (TypeError, ValueError):
        base = 0.0
    factor = load_factor()
    if base > 0 and factor > 1:
        rest = {k: v for k, v in (marker.kwargs.items() if marker is not None else ()) if k != "timeout"}
        item.add_marker(pytest.mark.timeout(base * factor, **rest), append=False)
    yield


# -- the order files are handed out in (make test: -n auto --dist loadfile) ---------------------
# loadfile gives each xdist worker whole files, the next one as soon as its current file is down
# to 2 tests, in the order of the queue. xdist's own order is most tests first, which put the few
# long multi-process files (1 to 5 tests each: DDP launches, examples run under torchrun) last:
# a worker claimed the last two of them while the other ran out of work and stopped. Here the
# longest files go first (longest-processing-time first), so the files handed out last are
# short. The list is the suite's longest files by their total time, longest first (-n 0, a file
# at a time, after the loader's reference cycle was fixed); files not in it follow, fewest tests
# first, so the last files handed out are the ones of many short tests (test_plan, test_schedule),
# which even out the two workers' ends a test at a time. An out-of-date list costs balance, never
# a test.
LONGEST_FILES = (
    "test_docs.py",
    "test_examples.py",
    "test_resume_ddp.py",
    "test_tarplain.py",
    "test_segments.py",
    "test_storage_errors.py",
    "test_mix_ddp.py",
    "test_faults.py",
    "test_scale.py",
    "test_lightning.py",
    "test_parquet_ddp.py",
    "test_preload.py",
    "test_resume.py",
    "test_bounds.py",
    "test_exit.py",
    "test_requests.py",
    "test_shm_kill.py",
    "test_parquet_columnar.py",
    "test_private.py",
    "test_stream.py",
)


def pytest_configure(config):
    # xdist would sort files by their number of tests after collection: keep the order below
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Items grouped by file, files in the order above (each file's own order kept)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0].rsplit("/", 1)[-1], []).append(item)
    order = sorted(by_file, key=lambda name: (rank.get(name, len(rank)), len(by_file[name]) if name not in rank else 0))
    items[:] = [item for name in order for item in by_file[name]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on loopback; dummy credentials in the environment for boto3 and s3fs."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    os.environ.pop("AWS_SESSION_TOKEN", None)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3(s3_endpoint):
    """A fresh bucket; yields (bucket name, storage_options for shardstream, boto3 client)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield bucket, {"endpoint_url": s3_endpoint}, client


def write_image_folder(root, classes=3, per_class=5, size=16, fmt="png", seed=0, with_json=True):
    """An ImageFolder tree: root/class_i/NNNN.png (+ .json). Returns the list of keys."""
    rng = np.random.default_rng(seed)
    keys = []
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            Image.fromarray(arr).save(folder / f"{i:04d}.{fmt}")
            if with_json:
                (folder / f"{i:04d}.json").write_text(json.dumps({"i": i, "c": c}))
            keys.append(f"class_{c}/{i:04d}")
    return keys


@pytest.fixture
def image_folder(tmp_path):
    root = tmp_path / "images"
    keys = write_image_folder(root)
    return root, keys


def make_samples(n: int, size: int = 100, seed: int = 0):
    """n small samples with bin/cls/txt fields and distinct keys."""
    rng = np.random.default_rng(seed)
    return [{"__key__": f"s{i:06d}", "bin": rng.bytes(int(rng.integers(1, size + 1))), "cls": i % 7, "txt": f"sample {i}"} for i in range(n)]


def forget_aws_credentials(monkeypatch, tmp_path) -> None:
    """No AWS credentials anywhere botocore's chain (and obstore's) looks: no variables, no shared
    files, no instance metadata."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def write_dataset(url, n: int = 60, *, max_count: int = 20, size: int = 100, samples=None, storage_options=None, member_sidecars: bool = True) -> str:
    """The one "small dataset" helper: ``n`` samples from make_samples (or ``samples``) packed with
    ShardWriter into ``url`` (a local folder or an s3:// URL), ``max_count`` samples per shard.
    ``member_sidecars=False``: as packed before member sidecars (``drop_member_sidecars``), read
    through its offset sidecars and parsed. Returns the dataset URL as a string."""
    from shardstream import ShardWriter

    url = str(url)
    with ShardWriter(url, max_count=max_count, storage_options=storage_options) as w:
        for s in samples if samples is not None else make_samples(n, size=size):
            w.write(s)
    if not member_sidecars:
        drop_member_sidecars(url, storage_options)
    return url


def drop_member_sidecars(url, storage_options=None) -> None:
    """The dataset at ``url`` as a shardstream before member sidecars packed it: its ``.members``
    files and the manifest's ``shards.members`` column gone (what a test of the offset sidecar and
    the parser reads; format/members.py)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(url), **dict(storage_options or {}))
    for path in fs.find(root):
        if path.endswith(".members"):
            fs.rm_file(path)
    manifest = f"{root}/index.json"
    doc = json.loads(fs.cat_file(manifest))
    doc["shards"].pop("members", None)
    fs.pipe_file(manifest, json.dumps(doc).encode())


# -- leak check -------------------------------------------------------------------------------
# Every test must leave no thread and no child process of its own behind (read-ahead threads,
# DataLoader workers, process pools, subprocesses). Threads and processes get a grace period to
# finish (a DataLoader shuts its workers down when its iterator is collected); only what is still
# alive after it fails the test. Allowed: long-lived daemon threads that belong to the session,
# not to a test: the moto server (session fixture) and its request threads, and fsspec's one
# event-loop thread for async filesystems (s3fs), which lives as long as the interpreter, with
# the default executor threads of that loop ("asyncio_N", not daemons, joined at exit).
LEAK_GRACE_S = 10.0
# Threads still ending get this long before the collector is asked to free what holds the rest: a
# full collection took 1.7-4 s at load 10 on 2 cores, for queue feeder threads that end in
# milliseconds once their loader has shut down.
ENDING_S = 0.5
ALLOWED_DAEMON_THREADS = ("fsspecIO", "(_server_entry)", "(process_request_thread)", "(serve_forever)")
# Dask-Offload: distributed's process-wide offload executor, started on first use and kept by design;
# shardstream-get: storage/objects.py's process-wide pool that waits for S3 answers (kept likewise).
ALLOWED_THREAD_PREFIXES = ("asyncio_", "Dask-Offload", "shardstream-get")
# multiprocessing's helper processes, started once on first use (spawn, shared memory) and kept for
# the interpreter's lifetime by design.
# A forkserver's own children are not: they are the workers and ranks it forked for the tests.
FORKSERVER = b"multiprocessing.forkserver"
ALLOWED_CHILDREN = (b"multiprocessing.resource_tracker", FORKSERVER)


def _child_pids() -> set[int]:
    """Live children of this process, from /proc (covers multiprocessing and subprocess alike), and
    every live process under its forkserver: workers (and ranks) forked by the server are the
    server's children, not ours, and a DataLoader worker left running by a test is one of them.
    A zombie under the server is gone (the server reaps its own)."""
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:  # not Linux: multiprocessing's own view is what there is
        return {p.pid for p in multiprocessing.active_children()}
    children: dict[int, list[tuple[int, bytes]]] = {}  # parent -> [(pid, state)]
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(b")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append((int(entry), fields[0]))
    pids = set()
    servers = []
    for pid, _ in children.get(me, ()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if FORKSERVER in cmdline:
            servers.append(pid)
        elif not any(a in cmdline for a in ALLOWED_CHILDREN):
            pids.add(pid)
    while servers:  # the servers' descendants, at any depth (a rank's own workers too)
        for pid, state in children.get(servers.pop(), ()):
            if state != b"Z":
                pids.add(pid)
            servers.append(pid)
    return pids


def _describe(pids: set[int]) -> list[str]:
    """``pid (name, parent pid)`` for each of ``pids`` still there: which are a forkserver's."""
    out = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            out.append(f"{pid} (exited)")
            continue
        name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
        out.append(f"{pid} ({name}, parent {int(stat[stat.rindex(b')') + 2 :].split()[1])})")
    return out


def _leaked_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t not in before
        and t.is_alive()
        and not (t.daemon and any(a in t.name for a in ALLOWED_DAEMON_THREADS))
        and not t.name.startswith(ALLOWED_THREAD_PREFIXES)
    ]


@pytest.fixture(autouse=True)
def no_leaks():
    threads = set(threading.enumerate())
    children = _child_pids()
    yield
    multiprocessing.active_children()  # reaps finished multiprocessing children
    deadline = time.monotonic() + scaled(LEAK_GRACE_S)
    leaked = _leaked_threads(threads)
    ending = time.monotonic() + scaled(ENDING_S)
    for t in leaked:  # most are ending already (the queue feeder threads of a loader shut down)
        t.join(max(0.0, ending - time.monotonic()))
    leaked = [t for t in leaked if t.is_alive()]
    if leaked:
        gc.collect()  # a dropped DataLoader iterator stops its workers when collected
    for t in leaked:
        t.join(max(0.0, deadline - time.monotonic()))
    procs = _child_pids() - children
    while procs and time.monotonic() < deadline:
        multiprocessing.active_children()
        time.sleep(0.05)  # waiting for other processes to exit: there is no event to wait on
        procs = _child_pids() - children
    leaked = _leaked_threads(threads)
    if leaked or procs:
        pytest.fail(f"test left running: threads {[t.name for t in leaked]}, child processes {_describe(procs)}")


# -- real multi-process runs (gloo DDP tests) -----------------------------------------------------
# Ranks start from multiprocessing's forkserver, whose server imported torch and shardstream once
# (shardstream's own preload, the one its DataLoader workers start from), not by spawn, which
# started a new interpreter importing torch for every rank of every phase (about 2 s of CPU each,
# 50-odd ranks in the suite). A rank is still a separate process with its own DDP process group,
# loaders, workers (from its own forkserver, as a user's rank has) and SIGKILL. What differs from
# spawn, and is put right in the rank: a forkserver child has the server's environment, from when
# the server started, so the rank takes this process's environment as it is at the rank's start.
def rank_context():
    """The multiprocessing context ranks start from: the forkserver, preloading torch and shardstream."""
    from shardstream.loader.start import context

    return context("forkserver")


def _rank_entry(environ: dict, target, rank: int, *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(rank, *args)


@contextlib.contextmanager
def spawned_ranks(target, world: int, args: tuple):
    """``world`` processes running ``target(rank, *args)`` (from the forkserver: ``rank_context``)
    with this process's environment; any still alive when the block ends is killed, so a hung rank
    never outlives its test."""
    ctx = rank_context()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_rank_entry, args=(environ, target, r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        yield procs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(scaled(10))


def run_ranks(target, world: int, args: tuple, timeout: float = 180) -> None:
    """Run ``target(rank, *args)`` on ``world`` ranks to the end; every rank must exit 0 within
    ``timeout`` seconds (scaled by the load)."""
    with spawned_ranks(target, world, args) as procs:
        for p in procs:
            p.join(timeout=scaled(timeout))
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def rank_results(prefix: str, world: int) -> list:
    """The JSON each rank wrote to ``{prefix}.{rank}`` (results travel through files, not collectives)."""
    out = []
    for r in range(world):
        with open(f"{prefix}.{r}") as f:
            out.append(json.load(f))
    return out


def launch_phase(target, world: int, work: str, phase: str, args: tuple) -> list[list]:
    """One phase of a preemption test: ``target(rank, world, store, *args, work, phase, ready)`` on
    ``world`` spawned ranks (``store``: this phase's gloo file store under ``work``). In phase
    ``"crash"`` each rank puts its rank on ``ready`` at its checkpoint and waits there; once all
    have, every rank is killed with SIGKILL. Any other phase runs to the end; every rank must exit
    0. Returns, per rank, the JSON lines it wrote to ``{work}/{phase}.keys.{rank}``."""
    ready = rank_context().Queue()
    store = os.path.join(work, f"{phase}.store")
    with spawned_ranks(target, world, (world, store, *args, work, phase, ready)) as procs:
        if phase == "crash":
            for _ in range(world):
                ready.get(timeout=scaled(120))
            for p in procs:
                os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join(timeout=scaled(30))
            assert all(p.exitcode == -signal.SIGKILL for p in procs)
        else:
            for p in procs:
                p.join(timeout=scaled(180))
            assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    out = []
    for r in range(world):
        with open(os.path.join(work, f"{phase}.keys.{r}")) as f:
            out.append([json.loads(line) for line in f])
    return out
