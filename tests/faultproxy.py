"""A fault-injecting HTTP proxy on 127.0.0.1 in front of the moto S3 server, for tests.

Forwards every request to the upstream server and, for GET requests only (uploads and listings
stay clean), can: drop the connection after N bytes of a response body (``cut="fin"``: an orderly
close; ``cut="rst"``: a TCP reset, once the client's kernel holds those bytes), answer 503 SlowDown to
every k-th request or to a burst of the next N (``slowdown_burst``, settable at any time), add
latency before answering, cap bandwidth, and stall: accept the request and
then send nothing (``stall="accept"``) or send the status line and headers and then nothing of the
body (``stall="headers"``), until the proxy shuts down. Counts what it did, and logs every request
(method, path, Range header) in ``log``.
"""

from __future__ import annotations

import http.client
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOWDOWN = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>'


class QuietHTTPServer(ThreadingHTTPServer):
    """A test server whose clients break connections on purpose (timeouts, cut bodies, resets):
    those end the request quietly, where socketserver would print a traceback from the server's
    thread, outside pytest's capture. Any other error is printed as usual."""

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


def _wait_sent(sock: socket.socket, closing: threading.Event, bound: float = 5.0) -> None:
    """Wait (at most ``bound`` seconds) until the peer has acknowledged every byte sent on
    ``sock`` (Linux's TIOCOUTQ); elsewhere, return at once."""
    try:
        import fcntl
        import termios

        def unsent() -> int:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]

        unsent()
    except (ImportError, OSError, AttributeError):
        return
    deadline = time.monotonic() + bound
    while unsent() and time.monotonic() < deadline and not closing.is_set():
        time.sleep(0.001)  # the kernel gives no event for "acknowledged": poll


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        reset_after: int | None = None,
        slowdown_every: int = 0,
        slowdown_burst: int = 0,
        latency: float = 0.0,
        bandwidth: float | None = None,
        faulty_methods=("GET",),
        stall: str | None = None,
        cut: str = "fin",
        host: str = "127.0.0.1",
    ):
        if stall not in (None, "accept", "headers"):
            raise ValueError(f"stall must be None, 'accept' or 'headers', got {stall!r}")
        if cut not in ("fin", "rst"):
            raise ValueError(f"cut must be 'fin' or 'rst', got {cut!r}")
        self.cut = cut
        self.stall = stall
        self._closing = threading.Event()
        self.upstream = urlsplit(upstream)
        self.reset_after = reset_after
        self.slowdown_every = slowdown_every
        self.slowdown_burst = slowdown_burst  # the next this many faulty requests are answered 503 SlowDown
        self.latency = latency
        self.bandwidth = bandwidth
        self.faulty_methods = set(faulty_methods)
        self.counts = {"requests": 0, "resets": 0, "slowdowns": 0, "stalls": 0}
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header) of every request, in order
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                faulty = self.command in proxy.faulty_methods
                with proxy._lock:
                    proxy.counts["requests"] += 1
                    n = proxy.counts["requests"]
                    proxy.log.append((self.command, self.path, self.headers.get("Range")))
                if faulty and proxy.latency:
                    time.sleep(proxy.latency)
                if faulty and proxy.stall == "accept":
                    self._stall()
                    return
                with proxy._lock:
                    burst = faulty and proxy.slowdown_burst > 0
                    if burst:
                        proxy.slowdown_burst -= 1
                if burst or (faulty and proxy.slowdown_every and n % proxy.slowdown_every == 0):
                    with proxy._lock:
                        proxy.counts["slowdowns"] += 1
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD's answer has no body: its Content-Length is the object's size, kept as sent.
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if faulty and proxy.stall == "headers":
                    self.wfile.flush()
                    self._stall()
                    return
                limit = proxy.reset_after if faulty and proxy.reset_after is not None and len(data) > proxy.reset_after else None
                payload = data if limit is None else data[:limit]
                self._send(payload)
                if limit is not None:
                    with proxy._lock:
                        proxy.counts["resets"] += 1
                    self.wfile.flush()
                    if proxy.cut == "rst":
                        self._reset()
                    else:
                        self.connection.shutdown(socket.SHUT_RDWR)  # the body stops short: a FIN mid-object
                    self.close_connection = True

            def _reset(self):
                """End the connection with a TCP RST (SO_LINGER 0), once the bytes sent have left
                this side (the client's kernel holds them; an RST drops what is still unsent)."""
                _wait_sent(self.connection, proxy._closing)
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()

            def _stall(self):
                with proxy._lock:
                    proxy.counts["stalls"] += 1
                proxy._closing.wait()  # hold the connection open, silent, until the proxy closes
                self.close_connection = True

            def _send(self, payload: bytes):
                if not proxy.bandwidth:
                    self.wfile.write(payload)
                    return
                step = max(1, int(proxy.bandwidth / 100))
                for i in range(0, len(payload), step):
                    self.wfile.write(payload[i : i + step])
                    time.sleep(step / proxy.bandwidth)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = QuietHTTPServer((host, 0), Handler)  # host: another address of this machine's (tests/netns.py)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()
        self.server.shutdown()
        self.server.server_close()
