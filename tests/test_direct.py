"""S3 range GETs through storage/direct.py (the standard library's HTTP client, signed by s3fs's own
client) against the moto server and small local HTTP servers: the same bytes as s3fs's path,
errors that classify as before, a broken body that resumes, and the cases that keep s3fs's path."""

from __future__ import annotations

import http.server
import os
import threading

import pytest
from conftest import write_dataset
from faultproxy import QuietHTTPServer

from shardstream import Read, ShardStream, Store, World, make_loader
from shardstream.errors import StorageNotFound
from shardstream.storage import direct, ranges
from shardstream.storage.classify import Kind, classify
from shardstream.storage.config import StorageConfig
from shardstream.storage.retry import PartialRead


def _batches(url, options, config, workers=0):
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=options, config=config, read=Read(read_size=16 << 10)))
    return [
        (k, b) for batch in make_loader(ds, num_workers=workers, pin_memory=False, log_interval=None) for k, b in zip(batch["__key__"], batch["bin"])
    ]


def test_direct_gets_read_the_same_bytes_as_s3fs_and_are_the_default(s3):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/d", 45, max_count=20, size=5000, storage_options=options)
    fs, path, fetch = ranges.resolve(f"{url}/shard-000000.tar", options, StorageConfig())
    assert direct.usable(fs, StorageConfig()) and fetch.kind == "direct"
    _, _, s3fs_fetch = ranges.resolve(f"{url}/shard-000000.tar", options, StorageConfig(direct_get=False))
    assert s3fs_fetch.kind == "s3fs"
    assert bytes(fetch(700, 9000)) == bytes(s3fs_fetch(700, 9000))
    through_s3fs = _batches(url, options, StorageConfig(direct_get=False))
    assert len(through_s3fs) == 45
    assert _batches(url, options, StorageConfig()) == through_s3fs
    # forked workers (their own connections): the same samples, in the workers' interleaved order
    assert sorted(_batches(url, options, StorageConfig(), workers=2)) == sorted(through_s3fs)


@pytest.mark.parametrize("readahead", [0, None])
def test_a_whole_shard_is_one_get_through_the_objects_end(s3, monkeypatch, readahead):
    """A whole shard is one GET, whatever the read size: its request asks for [data start, object
    end) (the tar's end-of-archive blocks ride along and cost no request of their own) and every
    read block comes out of that one body. The samples are those of s3fs's path."""
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/tail", 45, max_count=20, size=5000, storage_options=options)
    gets: dict[str, list[tuple[int, int]]] = {}
    real_open = direct.DirectS3.open

    def recording_open(self, bucket_, key, version, a, b, timeout=None):
        gets.setdefault(key, []).append((a, b))
        return real_open(self, bucket_, key, version, a, b, timeout)

    monkeypatch.setattr(direct.DirectS3, "open", recording_open)
    for read_size in (1 << 20, 16 << 10):
        gets.clear()
        ds = ShardStream(
            url,
            batch_size=5,
            shuffle=False,
            world=World(0, 1),
            store=Store(options=options, read=Read(read_size=read_size, readahead_bytes=readahead)),
        )
        got = [
            (k, b) for batch in make_loader(ds, num_workers=0, pin_memory=False, log_interval=None) for k, b in zip(batch["__key__"], batch["bin"])
        ]
        m = ds.manifest
        assert len(m.paths) == 3
        for i in range(3):
            key = m.shard_url(i).split(f"{bucket}/", 1)[1]
            start, data_end, size = int(m.spans[i, 0]), int(m.spans[i, 1]), int(m.sizes[i])
            assert 0 < size - data_end <= ranges.THROUGH_TAIL
            assert gets[key] == [(start, size)]  # one request, to the object's end
        assert ds.stats()["requests"] == 3
        monkeypatch.setattr(direct.DirectS3, "open", real_open)
        assert got == _batches(url, options, StorageConfig(direct_get=False))
        monkeypatch.setattr(direct.DirectS3, "open", recording_open)


def test_a_range_past_the_end_is_short_and_a_missing_key_is_not_found(s3):
    bucket, options, client = s3
    client.put_object(Bucket=bucket, Key="obj", Body=b"0123456789")
    _, _, fetch = ranges.resolve(f"s3://{bucket}/obj", options, StorageConfig())
    assert bytes(fetch(4, 100)) == b"456789"  # the object ended early: fewer bytes, no error
    _, _, missing = ranges.resolve(f"s3://{bucket}/nope", options, StorageConfig())
    with pytest.raises(direct.S3ResponseError) as info:
        missing(0, 10)
    assert classify(info.value) is Kind.NOT_FOUND and info.value.response["Error"]["Code"] == "NoSuchKey"
    read, _ = ranges.open_range(f"s3://{bucket}/nope", 0, 10, options)
    with pytest.raises(StorageNotFound, match="nope: not found"):
        read(10)


def test_keys_that_need_quoting_and_a_fork_that_needs_no_client(s3):
    import s3fs

    from shardstream import ShardWriter
    from shardstream.format.manifest import load_manifest
    from shardstream.format.offsets import OFFSET_CACHE

    bucket, options, client = s3
    names = ["a b/c+d.tar", "ü/~x%y.tar", "q?r#s.tar"]
    for i, name in enumerate(names):
        client.put_object(Bucket=bucket, Key=name, Body=bytes([i]) * 3000)
    for i, name in enumerate(names):
        _, _, fetch = ranges.resolve(f"s3://{bucket}/{name}", options, StorageConfig())
        assert bytes(fetch(10, 20)) == bytes([i]) * 10, name
    with ShardWriter(f"s3://{bucket}/ds", max_count=10, storage_options=options) as w:
        for i in range(20):
            w.write({"__key__": f"{i:04d}", "bin": bytes([i]) * 100})
    manifest = load_manifest(f"s3://{bucket}/ds", storage_options=options)
    OFFSET_CACHE.clear()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked DataLoader worker: the parent's URL templates and credentials, no client made here
        try:
            os.close(read)
            first, last = manifest.byte_range(1, 2, 5, options)  # an offset sidecar, then shard bytes
            _, _, fetch = ranges.resolve(manifest.shard_url(1), options, StorageConfig())
            data = bytes(fetch(first, last))
            _, _, fetch = ranges.resolve(f"s3://{bucket}/{names[1]}", options, StorageConfig())
            clients = [fs._s3 for fs in s3fs.S3FileSystem._cache.values()]
            ok = (
                bytes(fetch(0, 5)) == b"\x01" * 5
                and data.count(bytes([12]) * 100) == 1
                and data.count(bytes([14]) * 100) == 1
                and clients
                and all(c is None for c in clients)
            )
            os.write(write, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        said = answer.read()
    os.waitpid(pid, 0)
    assert said == b"ok"


def test_what_keeps_the_s3fs_path(s3, monkeypatch):
    bucket, options, _ = s3
    url = f"s3://{bucket}/x"
    kinds = {
        "default": ({}, StorageConfig()),
        "switched off": ({}, StorageConfig(direct_get=False)),
        "requester pays": ({"requester_pays": True}, StorageConfig()),
        "SSE-C extras": ({"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256"}}, StorageConfig()),
        "other client options": ({"client_kwargs": {"aws_session_token": "t"}}, StorageConfig()),
    }
    usable = {name: direct.usable(ranges.resolve(url, {**options, **extra}, config)[0], config) for name, (extra, config) in kinds.items()}
    assert usable == {"default": True, "switched off": False, "requester pays": False, "SSE-C extras": False, "other client options": False}
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # a proxy for the endpoint: s3fs's path honours it
    assert not direct.usable(ranges.resolve(url, options, StorageConfig())[0], StorageConfig())
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert direct.usable(ranges.resolve(url, options, StorageConfig())[0], StorageConfig())


class _Server:
    """A one-object HTTP server on 127.0.0.1 whose answers a test scripts: ``mode`` is 'ok' (honours
    Range), 'ignore-range' (200 with the whole object), 'break' (sends half the range, then closes)
    or 'error' (500 with an S3 error body)."""

    def __init__(self, data: bytes):
        self.data, self.mode, self.requests = data, "ok", 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                owner.requests += 1
                first, last = (int(v) for v in self.headers["Range"].split("=")[1].split("-"))
                body = owner.data[first : last + 1]
                if owner.mode == "error":
                    body = b"<Error><Code>InternalError</Code><Message>try again</Message></Error>"
                    self.send_response(500)
                elif owner.mode == "ignore-range":
                    body = owner.data
                    self.send_response(200)
                else:
                    self.send_response(206)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if owner.mode == "break":
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/bucket/key"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


class _Unsigned(direct.DirectS3):
    """DirectS3 aimed at a fixed URL with unsigned requests (the local server checks no signature)."""

    def __init__(self, url: str, config: StorageConfig = StorageConfig()):
        super().__init__(fs=None, config=config)
        self._url = url

    def url(self, bucket, key, version):
        return self._url

    def _signer(self, fresh=False):
        return None


def test_keep_alive_a_broken_body_an_ignored_range_and_an_error_answer():
    data = os.urandom(100_000)
    with _Server(data) as server:
        getter = _Unsigned(server.url)
        out = bytearray(30_000)
        assert getter.get("b", "k", None, 1000, 31_000, memoryview(out), 5.0) == 30_000 and out == data[1000:31_000]
        assert getter.get("b", "k", None, 0, 10, memoryview(out), None) == 10 and out[:10] == data[:10]
        assert len(getter._connections.open) == 1  # one kept-alive connection for both

        server.mode = "break"
        with pytest.raises(ConnectionError) as broken:
            getter.get("b", "k", None, 0, 20_000, memoryview(out), 5.0)
        assert broken.value.partial == 10_000 and classify(broken.value) is Kind.UNAVAILABLE
        assert not getter._connections.open  # a broken connection is never reused

        server.mode = "ignore-range"
        with pytest.raises(direct.S3ResponseError, match="got the whole object") as ignored:
            getter.get("b", "k", None, 5, 10, memoryview(out), 5.0)
        assert classify(ignored.value) is Kind.INVALID  # the wrong bytes are never handed over
        assert getter.get("b", "k", None, 0, 10, memoryview(out), 5.0) == 10 and out[:10] == data[:10]

        server.mode = "error"
        with pytest.raises(direct.S3ResponseError, match="InternalError") as answer:
            getter.get("b", "k", None, 0, 10, memoryview(out), 5.0)
        assert classify(answer.value) is Kind.UNAVAILABLE  # a 5xx: retried by the caller's policy


def test_a_broken_body_resumes_through_the_fetcher(monkeypatch):
    data = os.urandom(50_000)
    with _Server(data) as server:
        getter = _Unsigned(server.url)
        monkeypatch.setattr(direct, "direct_for", lambda fs, config: getter)

        class FakeFs:
            def split_path(self, path):
                return "bucket", "key", None

        fetch = direct.direct_fetcher(FakeFs(), "bucket/key", StorageConfig())
        server.mode = "break"
        with pytest.raises(PartialRead) as partial:
            fetch(0, 40_000)
        assert bytes(partial.value.data) == data[:20_000]  # what arrived is kept, for the next try to follow
        server.mode = "ok"
        read = ranges.make_range_reader(fetch, url="s3://bucket/key", start=0, end=50_000)
        server.mode = "break"
        first = bytes(read(50_000))
        server.mode = "ok"
        assert first == data[:25_000] and bytes(read(50_000)) == data[25_000:]


def test_a_dead_endpoint_times_out_within_the_deadline():
    import socket
    import time

    with socket.socket() as listener:  # accepts connections (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        getter = _Unsigned(f"http://127.0.0.1:{listener.getsockname()[1]}/b/k", StorageConfig(read_timeout=5.0))
        began = time.monotonic()
        with pytest.raises(TimeoutError) as stalled:
            getter.get("b", "k", None, 0, 10, memoryview(bytearray(10)), 0.5)
        assert time.monotonic() - began < 3 and classify(stalled.value) is Kind.TIMEOUT
