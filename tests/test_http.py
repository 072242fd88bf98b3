"""Datasets over plain HTTP(S) and on the Hugging Face Hub (hf://), through a local HTTP server
on 127.0.0.1 written here: it serves a folder packed by ShardWriter, answers ``Range: bytes=a-b``
with 206 and Content-Range (and HEAD), records every request, and can cut a response midway,
refuse with a status, or ignore Range. For hf://, the same server also answers the few Hub API
routes HfFileSystem asks (repo info, tree listing; files come from ``/resolve/``)."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import socket
import threading

import pytest
from conftest import write_dataset

from shardstream import ShardStream, Store, World
from shardstream import errors as E
from shardstream.storage.config import StorageConfig

# fail fast: two tries, millisecond backoff (no test waits on a timeout)
QUICK = StorageConfig(max_attempts=2, backoff_base=0.001, backoff_cap=0.01, deadline=30)


class RangeServer:
    """A threaded HTTP/1.1 file server on 127.0.0.1 (a free port) over ``root``.

    Switches: ``cut`` maps a path to a byte count: its next GET sends that many bytes of the body,
    then drops the connection (once). ``status`` maps a path to a status every request for it gets.
    ``ranges=False`` ignores Range (200 with the whole file). ``hub``: answer the Hub's API routes."""

    def __init__(self, root: str):
        self.root = root
        self.requests: list[tuple[str, str, str | None, int]] = []  # (method, path, Range, status)
        self.cut: dict[str, int] = {}
        self.status: dict[str, int] = {}
        self.ranges = True
        self.hub = False
        self.tokens: set[str | None] = set()  # Authorization headers seen
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                outer._serve(self, head=True)

            def do_GET(self):
                outer._serve(self, head=False)

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="http-test-server(serve_forever)", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def gets(self, suffix: str) -> list[tuple[str, str, str | None, int]]:
        return [r for r in self.requests if r[0] == "GET" and r[1].endswith(suffix)]

    def _reply(self, h, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        with self._lock:
            self.requests.append((h.command, h.path.split("?")[0], h.headers.get("Range"), status))
            self.tokens.add(h.headers.get("Authorization"))
        h.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            h.send_header(k, v)
        h.end_headers()
        if head or not body:
            return
        cut = self.cut.pop(h.path, None)
        if cut is not None:  # send part of the body, then drop the connection
            h.wfile.write(body[:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.wfile.write(body)

    def _hub_api(self, h, path: str) -> bytes | None:
        """The Hub routes HfFileSystem uses before reading: repo info, and a folder's tree."""
        m = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        if m:
            return json.dumps({"id": m.group(1), "sha": "0" * 40, "private": False}).encode()
        m = re.fullmatch(r"/api/datasets/[^/]+/[^/]+/tree/[^/]+/?(.*)", path)
        if m and os.path.isdir(folder := os.path.join(self.root, m.group(1))):
            return json.dumps(
                [
                    {
                        "type": "file" if os.path.isfile(p := os.path.join(folder, n)) else "directory",
                        "path": f"{m.group(1)}/{n}".lstrip("/"),
                        "size": os.path.getsize(p),
                        "oid": "0" * 40,
                    }
                    for n in sorted(os.listdir(folder))
                ]
            ).encode()
        return None

    def _serve(self, h, head: bool) -> None:
        path = h.path.split("?")[0]
        if path in self.status:
            return self._reply(h, self.status[path], head=head)
        if self.hub:
            api = self._hub_api(h, path)
            if api is not None:
                return self._reply(h, 200, api, {"Content-Type": "application/json"}, head)
            path = re.sub(r"^/datasets/[^/]+/[^/]+/resolve/[^/]+/", "/", path)  # a file of the repo: its bytes
        file = os.path.join(self.root, path.lstrip("/"))
        if not os.path.isfile(file):
            return self._reply(h, 404, head=head)
        with open(file, "rb") as f:
            data = f.read()
        size = len(data)
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", h.headers.get("Range") or "")
        if not (m and self.ranges):
            return self._reply(h, 200, data, {"Accept-Ranges": "bytes"}, head)
        a, b = int(m.group(1)), min(size, int(m.group(2)) + 1) if m.group(2) else size
        if a >= size:
            return self._reply(h, 416, headers={"Content-Range": f"bytes */{size}"}, head=head)
        self._reply(h, 206, data[a:b], {"Content-Range": f"bytes {a}-{b - 1}/{size}", "Accept-Ranges": "bytes"}, head)


@pytest.fixture
def served(tmp_path):
    """A packed dataset (60 samples, 3 shards with offset and member sidecars) under /ds of a running server."""
    write_dataset(tmp_path / "ds", n=60, max_count=20)
    server = RangeServer(str(tmp_path))
    try:
        yield server, str(tmp_path / "ds")
    finally:
        server.stop()


def keys(dataset) -> list[str]:
    return [k for batch in dataset for k in batch["__key__"]]


def test_a_dataset_streams_over_http_with_ranged_gets(served):
    server, local = served
    expected = keys(ShardStream(local, batch_size=6, world=World(0, 2)))
    got = keys(ShardStream(f"{server.url}/ds", batch_size=6, world=World(0, 2)))
    assert got == expected and len(got) == 30
    assert server.gets("/ds/index.json")  # the manifest
    shard_gets = server.gets(".tar")
    assert shard_gets and all(rng and status == 206 for _, _, rng, status in shard_gets)  # every shard read is a range
    # each shard rank 0 of 2 reads has its member sidecar read once, as a range too (the shard
    # is sliced; for the one it reads part of, the sidecar holds the offsets): no offset sidecar
    sidecars = server.gets(".tar.members")
    assert sidecars and all(rng and status == 206 for _, _, rng, status in sidecars) and not server.gets(".tar.idx")
    paths = [path for _, path, _, _ in sidecars]
    assert len(paths) == len(set(paths)) == 2  # rank 0's 30 samples lie in two of the three shards


def test_a_connection_dropped_midway_is_read_again_from_where_it_broke(served):
    server, local = served
    expected = keys(ShardStream(local, batch_size=6))
    server.cut["/ds/shard-000001.tar"] = 5000  # the first GET of this shard breaks after 5000 bytes
    dataset = ShardStream(f"{server.url}/ds", batch_size=6, store=Store(config=QUICK))
    assert keys(dataset) == expected
    assert "/ds/shard-000001.tar" not in server.cut  # the cut happened
    assert len(server.gets("/ds/shard-000001.tar")) >= 2 and dataset.stats()["retries"] >= 1


def test_missing_dataset_missing_shard_and_refusals_say_what_is_wrong(served):
    server, local = served
    with pytest.raises(E.ManifestError, match=r"/nothing/index\.json: cannot read the manifest \(not found\)"):
        ShardStream(f"{server.url}/nothing", batch_size=6)

    os.unlink(os.path.join(local, "shard-000002.tar"))  # listed in the manifest, gone from the server
    with pytest.raises(E.StorageNotFound, match=r"shard-000002\.tar: not found"):
        keys(ShardStream(f"{server.url}/ds", batch_size=6, store=Store(config=QUICK)))

    server.status["/ds/index.json"] = 403  # a refusal is not retried
    before = len(server.requests)
    with pytest.raises(E.ManifestError, match="access denied") as info:
        ShardStream(f"{server.url}/ds", batch_size=6, store=Store(config=QUICK))
    assert isinstance(info.value.__cause__, E.AccessDenied)
    # one try: fsspec's HEAD for the size, and the GET it falls back to when a HEAD fails
    assert [r[0] for r in server.requests[before:] if r[1] == "/ds/index.json"] == ["HEAD", "GET"]

    server.status["/ds/index.json"] = 503  # retried, then reported with the tries it took
    with pytest.raises(E.ManifestError, match="after 2 tries"):
        ShardStream(f"{server.url}/ds", batch_size=6, store=Store(config=QUICK))


def test_connection_refused_is_retried_then_reported(served):
    server, _ = served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = s.getsockname()[1]
        with pytest.raises(E.ManifestError, match=r"connection refused.*after 2 tries") as info:
            ShardStream(f"http://127.0.0.1:{port}/ds", batch_size=6, store=Store(config=QUICK))
    assert isinstance(info.value.__cause__, E.StorageUnavailable)


def test_a_server_that_ignores_range_is_refused_clearly(served):
    server, _ = served
    dataset = ShardStream(f"{server.url}/ds", batch_size=6, store=Store(config=QUICK))  # the manifest is read whole
    server.ranges = False
    with pytest.raises(E.StorageError, match=r"does not support HTTP Range requests"):
        keys(dataset)


def test_hf_urls_need_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "huggingface_hub" else real(name, *a))
    with pytest.raises(E.ConfigError, match=r"pip install 'shardstream\[hf\]'"):
        ShardStream("hf://datasets/org/name/ds", batch_size=6)


def test_a_dataset_streams_from_the_hub_through_hffilesystem(served, tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    server, local = served
    server.hub = True
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token or cache of the user's
    expected = keys(ShardStream(local, batch_size=6, world=World(1, 2)))
    options = {"endpoint": server.url, "token": "hf_test_token"}  # passed through to HfFileSystem
    dataset = ShardStream("hf://datasets/org/name/ds", batch_size=6, world=World(1, 2), store=Store(options=options, config=QUICK))
    assert keys(dataset) == expected
    shard_gets = server.gets(".tar")
    assert shard_gets and all(p.startswith("/datasets/org/name/resolve/main/ds/") and rng and status == 206 for _, p, rng, status in shard_gets)
    # each read asks for exactly its bytes (no read-ahead block fetched and dropped)
    assert sum(int(b) - int(a) + 1 for _, _, rng, _ in shard_gets for a, b in [rng[6:].split("-")]) == dataset.stats()["bytes_read"]

    assert server.tokens == {"Bearer hf_test_token"}
    with pytest.raises(E.ManifestError, match=r"hf://datasets/org/name/nothing/index\.json: cannot read the manifest \(not found\)"):
        ShardStream("hf://datasets/org/name/nothing", batch_size=6, store=Store(options=options, config=QUICK))
