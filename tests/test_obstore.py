"""S3 reads through obstore (storage/objects.py) against the moto server: which options it serves
and which keep s3fs's path, credentials from a profile, a wrong secret, a missing object, and
fork-started DataLoader workers of a process that already read through obstore (whose runtime
cannot run in a forked child: they read through s3fs, and the epoch is the same)."""

from __future__ import annotations

import os

import pytest
from conftest import forget_aws_credentials, make_samples, scaled, write_dataset

from shardstream import Read, ShardStream, Store, World, make_loader
from shardstream.errors import AccessDenied, ConfigError, NoCredentials, StorageNotFound
from shardstream.storage import objects, ranges
from shardstream.storage.config import StorageConfig
from shardstream.storage.ranges import read_object


def test_obstore_serves_the_usual_options_and_s3fs_the_rest(s3):
    bucket, options, client = s3
    client.put_object(Bucket=bucket, Key="k", Body=b"abc")
    url = f"s3://{bucket}/k"
    served = {
        "endpoint": options,
        "client_kwargs": {"client_kwargs": {"endpoint_url": options["endpoint_url"], "region_name": "us-east-1"}},
        "key and secret": {**options, "key": "testing", "secret": "testing"},
        "addressing": {**options, "config_kwargs": {"s3": {"addressing_style": "path"}}},
    }
    for name, opts in served.items():
        fs, _, fetch = ranges.resolve(url, opts, StorageConfig())
        assert fetch is not None and fetch.kind == "obstore", name
        assert ranges.read_head(url, 3, opts) == b"abc" and fs.size(f"{bucket}/k") == 3, name
    kept = {
        "SSE-C": {**options, "s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256"}},
        "version aware": {**options, "version_aware": True},
        "proxies": {**options, "config_kwargs": {"proxies": {"http": "http://127.0.0.1:9"}}},
    }
    for name, opts in kept.items():
        assert ranges.resolve(url, opts, StorageConfig())[2].kind == "s3fs", name
    assert ranges.resolve(url, options, StorageConfig(s3_client="s3fs"))[2].kind == "s3fs"
    with pytest.raises(ConfigError, match="s3_client"):
        StorageConfig(s3_client="boto")


def test_a_profile_and_a_missing_object(s3, tmp_path, monkeypatch):
    bucket, options, client = s3
    client.put_object(Bucket=bucket, Key="k", Body=b"x" * 10)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    creds = tmp_path / "credentials"
    creds.write_text("[reader]\naws_access_key_id = testing\naws_secret_access_key = testing\naws_session_token = tok\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert read_object(f"s3://{bucket}/k", {**options, "profile": "reader"}) == b"x" * 10
    with pytest.raises(ConfigError, match="profile 'nobody' not found"):
        read_object(f"s3://{bucket}/k", {**options, "profile": "nobody"})
    with pytest.raises(StorageNotFound, match="not found"):
        read_object(f"s3://{bucket}/missing", {**options, "profile": "reader"})


def _moto_auth(endpoint: str, free_requests: str) -> None:
    """moto's server checks credentials after ``free_requests`` more requests ("inf": never)."""
    import urllib.request

    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=free_requests.encode(), method="POST", headers={"Content-Type": "text/plain"}
    )
    urllib.request.urlopen(request, timeout=30).read()


class Counter(dict):
    def add(self, name: str, value: int = 1) -> None:
        self[name] = self.get(name, 0) + value

    def __missing__(self, name: str) -> int:
        return 0


def test_wrong_credentials_are_refused_at_once_with_what_to_check(s3):
    """A key the server does not know: its 403 (InvalidAccessKeyId) is AccessDenied naming what to
    check, through obstore and s3fs alike, with no retry."""
    bucket, options, client = s3
    client.put_object(Bucket=bucket, Key="k", Body=b"x" * 10)
    wrong = {**options, "key": "AKIANOBODY", "secret": "wrong"}
    _moto_auth(options["endpoint_url"], "0")
    try:
        for s3_client in ("obstore", "s3fs"):
            counted = Counter()
            with pytest.raises(AccessDenied, match="the access key ID is not known to this endpoint"):
                read_object(f"s3://{bucket}/k", wrong, config=StorageConfig(s3_client=s3_client), counters=counted)
            assert counted["retries"] == 0, s3_client
    finally:
        _moto_auth(options["endpoint_url"], "inf")
    assert read_object(f"s3://{bucket}/k", wrong) == b"x" * 10  # (the server checks no credentials again)


def test_environment_credentials_reach_obstore_without_a_botocore_session(s3, monkeypatch):
    """``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (and a session token) go to obstore as they
    are, with no botocore session or credential chain, where the chain would take exactly them; a
    profile, credentials that expire, or a region only a profile could give keep the chain."""
    import botocore.session

    bucket, options, client = s3
    client.put_object(Bucket=bucket, Key="k", Body=b"abc")
    made: list[object] = []
    original = botocore.session.Session.__init__

    def init(self, *args, **kwargs):
        made.append(kwargs.get("profile"))
        original(self, *args, **kwargs)

    monkeypatch.setattr(botocore.session.Session, "__init__", init)
    monkeypatch.setattr(objects, "_sessions", {})
    monkeypatch.setenv("AWS_SESSION_TOKEN", "tok")
    assert read_object(f"s3://{bucket}/k", options) == b"abc"
    assert made == []
    args = objects._store_args(options, bucket)
    assert (args["access_key_id"], args["secret_access_key"], args["session_token"], args["region"]) == ("testing", "testing", "tok", "us-east-1")
    assert "credential_provider" not in args
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODY")  # the variables are what signs: an unknown key is refused
    _moto_auth(options["endpoint_url"], "0")
    try:
        with pytest.raises(AccessDenied, match="the access key ID is not known to this endpoint"):
            read_object(f"s3://{bucket}/k", options)
    finally:
        _moto_auth(options["endpoint_url"], "inf")
    assert made == []
    monkeypatch.setenv("AWS_CREDENTIAL_EXPIRATION", "2099-01-01T00:00:00Z")  # botocore reads them again as they expire
    assert "credential_provider" in objects._store_args(options, bucket) and len(made) == 1
    monkeypatch.delenv("AWS_CREDENTIAL_EXPIRATION")
    monkeypatch.delenv("AWS_DEFAULT_REGION")  # the region could be a profile's: botocore's session says
    assert "credential_provider" in objects._store_args(options, bucket) and len(made) == 2
    assert "access_key_id" in objects._store_args({**options, "client_kwargs": {"region_name": "eu-west-1"}}, bucket)
    assert len(made) == 2


def test_no_credentials_and_an_unreadable_ca_bundle_say_so(s3_endpoint, monkeypatch, tmp_path):
    forget_aws_credentials(monkeypatch, tmp_path)
    options = {"endpoint_url": s3_endpoint}
    with pytest.raises(NoCredentials, match="no credentials found"):
        read_object("s3://bucket/k", options)
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match=r"CA bundle .*missing\.pem \(AWS_CA_BUNDLE or REQUESTS_CA_BUNDLE\) cannot be read"):
        read_object("s3://bucket/k", {**options, "key": "a", "secret": "b"})


def test_fork_started_workers_after_obstore_read_through_s3fs(s3):
    bucket, options, _ = s3
    samples = make_samples(40, size=2000)
    url = write_dataset(f"s3://{bucket}/forked", samples=samples, max_count=10, storage_options=options)
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=options, read=Read(readahead_bytes=0)))
    assert objects._runtime_pid == os.getpid()  # the manifest came through obstore, in this process
    loader = make_loader(ds, num_workers=2, start_method="fork", pin_memory=False)
    got = {k: bytes(b) for batch in loader for k, b in zip(batch["__key__"], batch["bin"])}
    assert got == {s["__key__"]: s["bin"] for s in samples}


def test_packing_to_a_new_prefix_keeps_no_frame_of_the_caller(s3):
    """A new destination's listing answers FileNotFoundError through fsspec's ``sync``, whose frame
    holds the error its traceback holds: a reference cycle that held every caller's frame, so the
    locals of a function that packed a new prefix outlived its return until the garbage collector's
    next full pass. A loader made there kept its fork workers alive after the test ended (the
    matrix's teardown error: 2 workers past the leak check's grace). Now the loader goes with its
    last reference and stops its workers, with the collector off."""
    import gc
    import weakref

    bucket, options, _ = s3

    def pack_and_read() -> tuple[weakref.ref, list]:
        url = write_dataset(f"s3://{bucket}/fresh", n=20, max_count=10, storage_options=options)
        ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=options, read=Read(readahead_bytes=0)))
        loader = make_loader(ds, num_workers=2, workers="processes", start_method="fork", pin_memory=False, log_interval=None)
        assert sum(len(batch["__key__"]) for batch in loader) == 20
        workers = list(loader._runtime.procs)  # persistent: alive after the pass
        assert workers and all(w.is_alive() for w in workers)
        return weakref.ref(loader), workers

    gc.collect()
    gc.disable()  # the collector's own passes (any allocation may start one) would hide a cycle
    try:
        gone, workers = pack_and_read()
        assert gone() is None
        for w in workers:  # stopped by the iterator's shutdown (joined there, or killed past its wait)
            w.join(scaled(30))
        assert not any(w.is_alive() for w in workers)
    finally:
        gc.enable()


@pytest.mark.parametrize("s3_client", ["obstore", "s3fs"])
def test_a_handled_missing_object_keeps_no_frame_of_the_caller(s3, s3_client):
    """A read of a missing object, its StorageNotFound handled by the caller: the failed try
    (through s3fs, an error of fsspec's ``sync``, in a cycle with that frame) lets the caller's
    frames go, so the caller's locals go when it returns, with the garbage collector off."""
    import gc
    import weakref

    bucket, options, _ = s3

    class Held:
        pass

    def read_missing() -> weakref.ref:
        held = Held()
        with pytest.raises(StorageNotFound):
            read_object(f"s3://{bucket}/missing", options, config=StorageConfig(s3_client=s3_client))
        return weakref.ref(held)

    read_missing()  # (the clients made and cached first, outside the check)
    gc.collect()
    gc.disable()
    try:
        gone = read_missing()
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("cut", [None, "rst"])
def test_read_ahead_keeps_obstores_pieces_and_the_parser_joins_them_once(s3, monkeypatch, cut):
    """With read-ahead on, the fetch thread queues the pieces obstore handed over (``ObjectBody.take``)
    rather than copying them into blocks of its own (``readinto``), and a large member is joined
    from them once: the bytes are exact, the shard's bytes read once, and a body cut midway (a TCP
    reset) resumes at the byte where it broke with the pieces that arrived kept."""
    from faultproxy import FaultProxy

    bucket, options, _ = s3
    samples = [{"__key__": f"k{i}", "bin": os.urandom(1_300_000 + 777 * i), "cls": i} for i in range(4)]
    samples.insert(2, {"__key__": "small", "bin": b"x" * 100, "cls": 9})
    url = write_dataset(f"s3://{bucket}/pieces", samples=samples, max_count=10, storage_options=options)
    calls = {"take": 0, "readinto": 0}
    for name in calls:
        method = getattr(objects.ObjectBody, name)

        def counted(self, *args, _name=name, _method=method, **kwargs):
            calls[_name] += 1
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(objects.ObjectBody, name, counted)
    config = StorageConfig(backoff_base=0.001, backoff_cap=0.01)
    read = Read(read_size=1 << 20, readahead_bytes=8 << 20)
    with FaultProxy(options["endpoint_url"], reset_after=700_000 if cut else None, cut=cut or "rst") as proxy:
        store = Store(options={"endpoint_url": proxy.url}, config=config, read=read)
        ds = ShardStream(url, batch_size=5, shuffle=False, decode=False, world=World(0, 1), store=store)
        calls.update(take=0, readinto=0)  # (the manifest is read without read-ahead)
        got = {k: bytes(b) for batch in ds for k, b in zip(batch["__key__"], batch["bin"])}
        stats = ds.stats()
    assert got == {s["__key__"]: s["bin"] for s in samples}
    assert stats["bytes_read"] == int(ds.manifest.sizes.sum())
    assert calls["take"] > 0 and calls["readinto"] == 0, calls
    if cut:
        assert proxy.counts["resets"] > 0 and stats["resumes"] > 0
