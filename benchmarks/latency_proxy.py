"""An HTTP proxy on 127.0.0.1 that waits a fixed time before forwarding each request, as a distant
S3 region's first-byte latency does, and streams every body through (nothing is held whole). For
benchmarks; it runs in its own process, so it does not share a reader's GIL.

    python benchmarks/latency_proxy.py http://127.0.0.1:PORT --latency 0.03

prints its own URL on the first line of stdout and serves until it is terminated. Keep-alive
connections stay open, each with a kept-alive connection upstream; every request, on any
connection, waits ``--latency`` seconds. ``GET /__proxy__/counts`` answers at once with the
requests forwarded so far, by method, as JSON (``start_proxy`` wraps it all for a benchmark).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

PIECE = 1 << 20
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "proxy-connection", "content-length"})


def serve(upstream: str, latency: float, port: int = 0) -> None:
    target = urlsplit(upstream)
    counts: dict[str, int] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        upstream_conn: http.client.HTTPConnection | None = None

        def log_message(self, *args):  # quiet
            pass

        def _counts(self) -> None:
            with lock:
                body = json.dumps(counts).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _forward(self) -> None:
            if self.path == "/__proxy__/counts":
                self._counts()
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                counts[self.command] = counts.get(self.command, 0) + 1
            time.sleep(latency)
            if self.upstream_conn is None:
                self.upstream_conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            try:
                self.upstream_conn.request(self.command, self.path, body=body, headers=headers)
                resp = self.upstream_conn.getresponse()
            except (OSError, http.client.HTTPException):
                self.upstream_conn.close()
                self.upstream_conn = None
                raise
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            length = resp.getheader("Content-Length")
            if self.command == "HEAD" or length is not None:
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    buf = bytearray(PIECE)
                    view = memoryview(buf)
                    while n := resp.readinto(view):
                        self.wfile.write(view[:n])
                resp.read()
            else:  # no length upstream: read it all, send it with one
                data = resp.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            if resp.will_close:
                self.upstream_conn.close()
                self.upstream_conn = None

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):  # clients that drop a body on purpose end quietly
            if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


@contextlib.contextmanager
def start_proxy(upstream: str, latency: float) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run the proxy in a process of its own: yields ``(url, process)``; stops it, by its PID, on exit."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), upstream, "--latency", str(latency)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        if not url.startswith("http://"):
            raise SystemExit("the latency proxy did not start")
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def proxy_counts(url: str) -> dict[str, int]:
    """Requests the proxy at ``url`` forwarded so far, by method."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", "/__proxy__/counts")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("upstream")
    parser.add_argument("--latency", type=float, default=0.03, help="seconds before each request is forwarded")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    serve(args.upstream, args.latency, args.port)


if __name__ == "__main__":
    main()
