"""The storage error classifier and the error tree, against real exceptions: s3fs/botocore
errors produced by the moto server on 127.0.0.1, a port with nothing listening, a socket that
accepts and never answers, the fault proxy's 503 SlowDown, and missing local files. Also the
CLI's rule: shardstream's errors become one line, anything else shows its traceback."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import pickle
import re
import socket
import time

import pytest
import s3fs
from conftest import forget_aws_credentials, make_samples, scaled, write_dataset, write_image_folder
from faultproxy import FaultProxy

from shardstream import Decode, ShardStream, ShardWriter, World, make_loader
from shardstream import errors as E
from shardstream.cli.main import main
from shardstream.storage.classify import Kind, classify, storage_error
from shardstream.storage.config import StorageConfig
from shardstream.storage.retry import Fetcher, RangeReader, s3_opener


def fresh_fs(endpoint, **config):
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True, config_kwargs={"retries": {"total_max_attempts": 1}, **config})
    fs.retries = 1
    return fs


def raised(fn):
    try:
        fn()
    except Exception as exc:
        return exc
    raise AssertionError("no exception")


@pytest.fixture
def dead_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s  # bound, not listening: connections are refused; call s.listen() to make it stall


def test_not_found_and_missing_bucket(s3):
    bucket, options, _ = s3
    fs = fresh_fs(options["endpoint_url"])
    exc = raised(lambda: fs.cat_file(f"{bucket}/nokey", start=0, end=4))
    assert classify(exc) is Kind.NOT_FOUND
    err = storage_error(f"s3://{bucket}/nokey", exc)
    assert isinstance(err, E.StorageNotFound) and isinstance(err, FileNotFoundError) and isinstance(err, E.StorageError)
    assert err.url == f"s3://{bucket}/nokey" and str(err) == f"s3://{bucket}/nokey: not found"
    exc = raised(lambda: fs.cat_file("no-such-bucket-zz/x"))
    err = storage_error("s3://no-such-bucket-zz/x", exc)
    assert isinstance(err, E.StorageNotFound) and "the bucket does not exist" in str(err)


def test_refused_dns_and_stall_are_transient_with_their_cause(dead_port, monkeypatch):
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)  # its own credentials: signing comes before connecting (not left by an earlier test)
    port = dead_port.getsockname()[1]
    exc = raised(lambda: fresh_fs(f"http://127.0.0.1:{port}").cat_file("bkt/x"))
    assert classify(exc) is Kind.UNAVAILABLE
    err = storage_error("s3://bkt/x", exc, attempts=3, waited=1.5)
    assert type(err) is E.StorageUnavailable and err.attempts == 3
    assert "connection refused" in str(err) and "after 3 tries in 1.5 s" in str(err)
    exc = raised(lambda: fresh_fs("http://no-such-host.invalid:9").cat_file("bkt/x"))
    assert classify(exc) is Kind.UNAVAILABLE and "DNS" in str(storage_error("s3://bkt/x", exc))
    dead_port.listen(8)  # accepts (in the kernel's backlog) and never answers
    exc = raised(lambda: fresh_fs(f"http://127.0.0.1:{port}", read_timeout=0.5, connect_timeout=0.5).cat_file("bkt/x"))
    assert classify(exc) is Kind.TIMEOUT
    err = storage_error("s3://bkt/x", exc)
    assert isinstance(err, E.StorageTimeout) and isinstance(err, TimeoutError) and "read timeout" in str(err)


def test_no_credentials(s3_endpoint, monkeypatch, tmp_path):
    forget_aws_credentials(monkeypatch, tmp_path)
    exc = raised(lambda: fresh_fs(s3_endpoint).cat_file("bkt/x"))
    assert classify(exc) is Kind.NO_CREDENTIALS
    err = storage_error("s3://bkt/x", exc)
    assert type(err) is E.NoCredentials and "no credentials found" in str(err) and "~/.aws/credentials" in str(err)
    assert "cannot reach" not in str(err)


def test_throttle_is_retried_and_an_invalid_range_is_not(s3):
    bucket, options, client = s3
    client.put_object(Bucket=bucket, Key="k", Body=b"x" * 100)
    with FaultProxy(options["endpoint_url"], slowdown_every=1) as proxy:
        exc = raised(lambda: fresh_fs(proxy.url).cat_file(f"{bucket}/k", start=0, end=10))
    assert classify(exc) is Kind.THROTTLED
    fs = fresh_fs(options["endpoint_url"])
    exc = raised(lambda: fs.cat_file(f"{bucket}/k", start=500, end=600))  # 416 InvalidRange: the request is wrong
    assert classify(exc) is Kind.INVALID
    sleeps: list[float] = []
    read = RangeReader(Fetcher("s3fs", open_body=s3_opener(fs, f"{bucket}/k")), url=f"s3://{bucket}/k", start=500, end=600, sleep=sleeps.append)
    assert read(100) == b""  # a promised range past the object's end: the stream ends (the parser names the truncation)
    assert sleeps == []  # not retried


def test_a_bug_is_not_a_storage_error():
    assert classify(ValueError("bug")) is None and classify(KeyError("bug")) is None

    def open_body(a, b, timeout=None):
        raise ZeroDivisionError("bug in a fetcher")

    with pytest.raises(ZeroDivisionError):
        RangeReader(Fetcher("fsspec", open_body), url="s3://b/k", start=0, end=10)(10)


def test_every_error_survives_pickling_and_the_dataloader_rebuild():
    examples = [
        E.ConfigError("c"),
        E.SourceError("where", "what"),
        E.DestinationError("d"),
        E.ManifestError("m"),
        E.StorageError("s", url="u"),
        E.StorageNotFound("u: not found", url="u"),
        E.AccessDenied("a", url="u"),
        E.NoCredentials("n", url="u"),
        E.StorageUnavailable("x", url="u", attempts=2, waited=1.0),
        E.StorageTimeout("t", url="u", attempts=2, waited=1.0),
        E.ChecksumError("u", "a" * 64, "b" * 64),
        E.ShardFormatError("u", 512, "bad"),
        E.SampleError("u", "k", "bad"),
        E.TooManyErrors("t"),
    ]
    for exc in examples:
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc) and str(again) == str(exc)
        assert type(type(exc)(str(exc))) is type(exc)  # how torch's DataLoader re-raises a worker's error
    assert isinstance(E.StorageNotFound("x"), OSError) and isinstance(E.AccessDenied("x"), PermissionError)


def _local_dataset(root, n=40):
    with ShardWriter(str(root), max_count=10) as w:
        for s in make_samples(n):
            w.write(s)
    return str(root)


def test_missing_local_shard_is_a_file_not_found_error_also_through_workers(tmp_path):
    root = _local_dataset(tmp_path / "d")
    (tmp_path / "d" / "shard-000002.tar").unlink()
    ds = ShardStream(root, batch_size=4, shuffle=False, world=World(0, 1))
    with pytest.raises(FileNotFoundError, match=r"shard-000002.tar: not found \(it is listed in the manifest") as info:
        list(ds)
    assert isinstance(info.value, E.StorageNotFound) and info.value.url.endswith("shard-000002.tar")
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(E.StorageNotFound, match="shard-000002.tar: not found"):
        list(make_loader(ds, num_workers=2, pin_memory=False))
    # The failed pass's workers are stopped as the error reaches the loop, not when its traceback is
    # collected (then DataLoader's stop never reached them: 5 s per worker before it killed them).
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_cli_one_line_for_our_errors_traceback_for_bugs(tmp_path, capsys, monkeypatch):
    from shardstream.cli import ls

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(ls, "run", broken)
    with pytest.raises(KeyError):
        main(["ls", str(tmp_path)])


def test_folder_of_tars_without_manifest_says_run_index(tmp_path, capsys):
    root = _local_dataset(tmp_path / "d")
    (tmp_path / "d" / "index.json").unlink()
    for command in (["ls", root], ["show", root], ["verify", root]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "shardstream index" in err and "*.tar" in err and "from_urls" in err
    with pytest.raises(E.ManifestError, match=r"run `shardstream index .*\*\.tar"):
        ShardStream(root, batch_size=4, world=World(0, 1))


def test_a_folder_of_files_to_pack_says_run_pack(tmp_path):
    """A first user's mistake: the ImageFolder tree itself handed to ShardStream (or ``ls``) before
    packing it. The error names ``shardstream pack`` for it, beside ``index`` for tar shards."""
    write_image_folder(tmp_path / "train", classes=2, per_class=2)
    root = str(tmp_path / "train")
    with pytest.raises(E.ManifestError, match=rf"run `shardstream pack {re.escape(root)} DEST` and read DEST; for tar shards"):
        ShardStream(root, batch_size=4, world=World(0, 1))


def test_a_folder_of_unindexed_tars_gets_advice_that_works(tmp_path):
    """The error for a folder of tars without index.json names two ways in, and both work:
    ``shardstream index GLOB DEST`` then DEST, and ``ShardStream.from_urls(GLOB)``."""
    import shutil

    write_dataset(tmp_path / "packed", n=12, max_count=4)
    raw = tmp_path / "raw"
    raw.mkdir()
    for tar in sorted((tmp_path / "packed").glob("*.tar")):
        shutil.copy(tar, raw / tar.name)  # tar shards alone, as another tool leaves them
    with pytest.raises(E.ManifestError) as caught:
        ShardStream(str(raw), batch_size=4, world=World(0, 1))
    message = str(caught.value)
    index = re.search(r"run `shardstream index '([^']+)' DEST`", message)
    urls = re.search(r"ShardStream\.from_urls\('([^']+)', \.\.\.\)", message)
    assert index and urls, message
    dest = tmp_path / "dest"
    assert main(["index", index.group(1), str(dest)]) == 0
    keys = sorted(s["__key__"] for s in make_samples(12))
    for ds in (
        ShardStream(str(dest), batch_size=4, shuffle=False, world=World(0, 1)),
        ShardStream.from_urls(urls.group(1), batch_size=4, shuffle=False, world=World(0, 1)),
    ):
        assert sorted(k for b in ds for k in b["__key__"]) == keys
    assert sorted(p.name for p in raw.iterdir()) == sorted(p.name for p in (tmp_path / "packed").glob("*.tar"))  # nothing written beside the shards


def _tries(message: str) -> tuple[int, float]:
    """The tries and seconds an error reports ("... after 6 tries in 1.9 s; ...")."""
    m = re.search(r"after (\d+) tr(?:y|ies) in ([0-9.]+) s", message)
    assert m, message
    return int(m.group(1)), float(m.group(2))


def test_pack_to_s3_without_credentials_or_endpoint_is_one_line(image_folder, s3_endpoint, capsys, monkeypatch, tmp_path, dead_port):
    root, _ = image_folder
    port = dead_port.getsockname()[1]
    began = time.monotonic()
    deadline = f"{scaled(1.5):.1f}"  # pack's own process tries: a refused connection's tries take milliseconds
    assert main(["pack", str(root), "s3://bkt/x", "--endpoint-url", f"http://127.0.0.1:{port}", "--no-progress", "--deadline", deadline]) == 1
    elapsed = time.monotonic() - began
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "s3://bkt" in err and "connection refused" in err, err
    # A refused connection is transient: the destination check retries it under --deadline (not
    # botocore's ~50 s of its own retries), and says how many tries it really made, in how long.
    tries, seconds = _tries(err)
    assert 1 < tries and 0 < seconds <= elapsed + 0.05, err  # the deadline ended it, not a count of tries (seconds: rounded to 0.1)
    assert elapsed < scaled(30), elapsed  # generous: a loaded machine; the default deadline is 60 s
    forget_aws_credentials(monkeypatch, tmp_path)
    endpoint = s3_endpoint.replace("127.0.0.1", "localhost")  # a new s3fs instance: none cached with credentials
    assert main(["pack", str(root), "s3://bkt/y", "--endpoint-url", endpoint, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "s3://bkt" in err and "no credentials found" in err and "cannot reach" not in err


def test_pack_api_follows_its_storage_config(image_folder, dead_port, monkeypatch):
    from shardstream.write.pack import pack

    root, _ = image_folder
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    options = {"endpoint_url": f"http://127.0.0.1:{dead_port.getsockname()[1]}"}
    with pytest.raises(E.DestinationError, match=r"cannot write s3://bkt: cannot reach storage: connection refused.* after 2 tries in") as info:
        pack(str(root), "s3://bkt/x", storage_options=options, config=StorageConfig(deadline=30, max_attempts=2))
    cause = info.value.__cause__
    assert isinstance(cause, E.StorageUnavailable) and cause.attempts == 2, repr(cause)
    began = time.monotonic()
    with pytest.raises(E.DestinationError, match="connection refused") as info:
        pack(str(root), "s3://bkt/x", storage_options=options, config=StorageConfig(deadline=2, max_attempts=50))
    elapsed = time.monotonic() - began
    tries, seconds = _tries(str(info.value))
    assert 1 < tries < 50 and seconds <= elapsed + 0.05 and elapsed < 20, (str(info.value), elapsed)  # the deadline ended it, not the tries


def test_pack_tasks_carry_the_storage_config_to_the_processes_that_write(image_folder, tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from shardstream.write import tasks
    from shardstream.write.pack import pack

    root, keys = image_folder
    config = StorageConfig(deadline=7, max_attempts=3, connect_timeout=2)
    seen = []
    write_shard = tasks.write_shard

    def recording(task):
        seen.append(pickle.loads(pickle.dumps(task)).config)  # as a process pool or Dask ships it
        return write_shard(task)

    monkeypatch.setattr(tasks, "write_shard", recording)
    with ThreadPoolExecutor(2) as executor:
        result = pack(str(root), str(tmp_path / "out"), max_count=2, executor=executor, config=config)
    assert result.samples == len(keys) and len(seen) == result.shards > 1 and set(seen) == {config}


def _dead_endpoint(dead_port, monkeypatch) -> str:
    """The URL of an endpoint that refuses every connection, with credentials in the environment
    (a refused connection is then the one failure: transient, retried under the policy)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return f"http://127.0.0.1:{dead_port.getsockname()[1]}"


# What each command reads or lists first on a dead S3 endpoint (DEST on local disk unless on s3://).
DEAD_SOURCE_COMMANDS = {
    "bench": ["bench", "s3://bkt/ds", "--workers", "0", "--seconds", "1"],  # the stream's manifest
    "index a glob": ["index", "s3://bkt/ds/*.tar", "{tmp}/indexed"],  # the glob's listing
    "index a folder": ["index", "s3://bkt/ds", "{tmp}/indexed"],  # the folder's listing
    "merge": ["merge", "{tmp}/merged", "s3://bkt/ds"],  # a part's manifest
    "merge onto s3": ["merge", "s3://bkt/merged", "s3://bkt/ds"],  # the probe of DEST's manifest
    "pack a dataset": ["pack", "s3://bkt/ds", "{tmp}/packed", "--no-progress"],  # the source's kind (its index.json)
    "pack a glob": ["pack", "s3://bkt/ds/*.tar", "{tmp}/packed", "--no-progress"],  # the glob's listing
    "pack a jsonl": ["pack", "s3://bkt/items.jsonl", "{tmp}/packed", "--no-progress"],  # the JSONL file
    "ls a mix file": ["ls", "s3://bkt/mix.yaml"],  # the mix file
    "bench a mix file": ["bench", "s3://bkt/mix.yaml", "--workers", "0", "--seconds", "1"],  # the mix file
}


@pytest.mark.parametrize("name", list(DEAD_SOURCE_COMMANDS))
def test_every_command_gives_up_on_a_dead_endpoint_within_its_deadline(name, dead_port, monkeypatch, tmp_path, capsys):
    # --deadline reaches what bench, index, merge and pack's source side read and list: a refused
    # connection is retried under it (was: the default 60 s and 8 tries, or botocore's ~50 s of
    # its own retries ending in a traceback), and the one-line error says the tries and the time.
    endpoint = _dead_endpoint(dead_port, monkeypatch)
    argv = [a.format(tmp=tmp_path) for a in DEAD_SOURCE_COMMANDS[name]]
    # The deadline stretches with the machine's load: a first try (the S3 client built, then the
    # refused connect) took 2.4 s beside two CPU hogs, which left a 2 s deadline no second try.
    deadline = scaled(2)
    began = time.monotonic()
    assert main([*argv, "--endpoint-url", endpoint, "--deadline", f"{deadline:.1f}"]) == 1
    elapsed = time.monotonic() - began
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "s3://bkt/" in err and "connection refused" in err, err
    tries, seconds = _tries(err)
    assert 1 < tries and seconds <= deadline * 1.5 + 2 and seconds <= elapsed + 0.05, err  # (generous: a loaded machine)
    assert elapsed < scaled(30), elapsed  # generous: a loaded machine


@pytest.mark.parametrize("engine", ["inline", "worker processes", "executor"])
def test_pack_reads_the_sources_items_under_its_storage_config(engine, dead_port, monkeypatch, tmp_path):
    # A source that lists (a local JSONL file) but whose items live on a dead endpoint: the items
    # are read under pack's config wherever they are read: in pack's own process, in its worker
    # processes (spawned: the config goes with the storage options), and in the shard tasks an
    # executor runs (the config rides the task).
    from concurrent.futures import ThreadPoolExecutor

    from shardstream.write.pack import pack

    options = {"endpoint_url": _dead_endpoint(dead_port, monkeypatch)}
    src = tmp_path / "items.jsonl"
    src.write_text("".join(json.dumps({"__key__": f"k{i}", "bin": {"$file": f"s3://bkt/{i}.bin"}}) + "\n" for i in range(3)))
    # 3 s, stretched by the machine's load, where a spawned worker process makes the first try: it
    # also builds the S3 client there (over 1 s on a loaded machine, 7.6 s once at a load of 24 on
    # 2 cores); 1.5 s in pack's own process, where a refused connection's tries take milliseconds
    # (backoff from 0.05 s: over 5 tries in 1.5 s)
    deadline = scaled(3 if engine == "worker processes" else 1.5)
    config = StorageConfig(deadline=deadline, max_attempts=50)
    with contextlib.ExitStack() as stack:
        how: dict = {"workers": 2} if engine == "worker processes" else {}
        if engine == "executor":
            how = {"executor": stack.enter_context(ThreadPoolExecutor(2)), "max_count": 2}
        with pytest.raises(E.StorageUnavailable, match=r"s3://bkt/\d\.bin: cannot reach storage: connection refused") as info:
            pack(str(src), str(tmp_path / "out"), storage_options=options, config=config, allow_outside=["s3://bkt"], **how)
    tries, seconds = _tries(str(info.value))
    assert 1 < tries < 50 and seconds <= deadline * 1.5 + 2, str(info.value)  # the deadline ended it, not the tries (generous: a loaded machine)


def test_bad_options_are_config_errors(tmp_path):
    from shardstream.policy import ErrorPolicy
    from shardstream.write.pack import pack

    root = _local_dataset(tmp_path / "d")
    with pytest.raises(E.ConfigError, match="on_error"):
        ErrorPolicy("ignore")
    with pytest.raises(E.ConfigError, match="on_error"):
        pack(root, str(tmp_path / "p"), on_error="ignore")
    with pytest.raises(E.ConfigError, match="max_count"):
        ShardWriter(str(tmp_path / "w"), max_count=0)
    with pytest.raises(E.ConfigError, match=r"image=...\) must be one of"):
        ShardStream(root, batch_size=4, world=World(0, 1), decode=Decode(image="bogus"))
    with pytest.raises(E.ConfigError, match="rank 3 is not in a world of size 2"):
        ShardStream(root, batch_size=4, world=World(3, 2))
    with pytest.raises(E.ConfigError, match="deadline"):
        StorageConfig(deadline=0)


def test_a_manifest_nested_without_bound_is_a_manifest_error(tmp_path, monkeypatch):
    """JSON nested 200,000 deep (once a RecursionError out of json.loads): the depth is measured
    without recursion before the parser sees it. Behind that check, the parser's own
    RecursionError is a ManifestError too."""
    from shardstream.format import manifest as M

    root = tmp_path / "deep"
    root.mkdir()
    (root / "index.json").write_bytes(b'{"format": "shardstream-index", "shards": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    with pytest.raises(E.ManifestError, match=r"index\.json: not a manifest: its JSON nests 200001 levels deep, more than the 64 allowed"):
        M.load_manifest(str(root))
    # brackets inside strings are not nesting: a manifest whose paths hold them still loads
    data = _local_dataset(tmp_path / "d")
    doc = json.loads((tmp_path / "d" / "index.json").read_text())
    doc["label_map"] = {"[" * 100 + '\\"{' * 50: 1}
    (tmp_path / "d" / "index.json").write_text(json.dumps(doc))
    assert M.load_manifest(data).total_samples == 40
    monkeypatch.setattr(M, "MAX_DEPTH", 10**9)  # the check out of the way: the parser's RecursionError
    with pytest.raises(E.ManifestError, match="nests too deep to parse"):
        M.load_manifest(str(root))


def test_a_manifest_larger_than_the_cap_is_refused_naming_its_size(tmp_path, s3):
    from shardstream.format.manifest import load_manifest

    data = _local_dataset(tmp_path / "d")
    size = (tmp_path / "d" / "index.json").stat().st_size
    too_large = rf"index\.json: the manifest is {size:,} bytes, more than the 500 read \(StorageConfig\.max_manifest_bytes\)"
    with pytest.raises(E.ManifestError, match=too_large):
        load_manifest(data, config=StorageConfig(max_manifest_bytes=500))
    assert load_manifest(data, config=StorageConfig(max_manifest_bytes=size)).total_samples == 40
    bucket, options, client = s3
    client.put_object(Bucket=bucket, Key="big/index.json", Body=(tmp_path / "d" / "index.json").read_bytes())
    # on S3 the first read asks for one byte more than the cap: what it gets says "larger", no HEAD needed
    with pytest.raises(E.ManifestError, match=r"the manifest is 501 bytes or more, more than the 500 read"):
        load_manifest(f"s3://{bucket}/big", options, config=StorageConfig(max_manifest_bytes=500))
    assert StorageConfig().max_manifest_bytes == 128 << 20
    with pytest.raises(E.ConfigError, match="max_manifest_bytes"):
        StorageConfig(max_manifest_bytes=0)


def test_storage_config_tries_until_the_deadline_by_default():
    assert StorageConfig().max_attempts is None and StorageConfig().upload_attempts == 8
    assert StorageConfig(max_attempts=3).upload_attempts == 3
    with pytest.raises(E.ConfigError, match="max_attempts"):
        StorageConfig(max_attempts=0)
    # each try's timeouts are cut to the deadline (a HEAD or a listing cannot be given the time left)
    options = StorageConfig(deadline=4, connect_timeout=10, read_timeout=20).fs_options({}, "s3")["config_kwargs"]
    assert options["connect_timeout"] == 4 and options["read_timeout"] == 4


@pytest.mark.parametrize("command", [["ls"], ["verify"]])
def test_deadline_on_the_command_line_bounds_a_stalled_store(s3, capsys, command):
    """``--deadline 3`` in front of a store that answers headers and then stalls: the command fails
    in one line within about 3 s (asserted: deadline * 1.5 + 2 s, for a loaded machine), not after
    the 20 s read timeout of one try (``--deadline 10`` once took 20.4 s)."""
    from conftest import write_dataset

    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/cli-stall", 20, max_count=10, size=200, storage_options=options)
    with FaultProxy(options["endpoint_url"], stall="headers") as proxy:
        began = time.monotonic()
        assert main([*command, url, "--endpoint-url", proxy.url, "--deadline", "3"]) != 0
        elapsed = time.monotonic() - began
    err = capsys.readouterr().err
    assert "timeout" in err and "index.json" in err, err
    assert elapsed < 3 * 1.5 + 2, (elapsed, err)
