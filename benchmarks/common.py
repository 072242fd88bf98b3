"""What the benchmarks share: the repository on ``sys.path``, a moto S3 server of their own (on
loopback, stopped by its PID), the reference ``get_object`` stream, CPU time and sample counting.

Every benchmark starts with ``import common`` (this folder is on ``sys.path`` when a script here
runs); ``common`` puts the repository root first, so ``import shardstream`` takes this checkout.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import time

from s3server import stop  # one way to stop a server this benchmark started, by its PID

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (HERE, REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its reaped children (finished DataLoader
    workers): on a shared, overloaded machine, work per CPU-second is steadier than wall time."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def count(loader) -> int:
    """Samples in every batch of one pass (batches with a ``__key__`` list)."""
    n = 0
    for batch in loader:
        n += len(batch["__key__"])
    return n


def start_moto() -> tuple[subprocess.Popen, str]:
    """A moto server on a free loopback port, with moto's fake credentials in this process's
    environment (botocore, s3fs and forked workers read them from there)."""
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, url
        except OSError:
            time.sleep(0.1)  # until the server listens (no event to wait on in another process)
    proc.kill()
    raise SystemExit("moto_server did not start")


@contextlib.contextmanager
def moto_server():
    """A moto server (``start_moto``): yields its endpoint URL."""
    proc, url = start_moto()
    try:
        yield url
    finally:
        stop(proc)


@contextlib.contextmanager
def moto_bucket(bucket: str = "bench"):
    """A moto server with one bucket: yields ``(endpoint, storage_options, boto3 client, server PID)``."""
    import boto3

    proc, endpoint = start_moto()
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        yield endpoint, {"endpoint_url": endpoint}, client, proc.pid
    finally:
        stop(proc)


def get_object_stream(endpoint: str, keys: list[str], bucket: str = "bench") -> int:
    """The reference reader: boto3 ``get_object`` of each key, its body read to the end in 1 MiB
    pieces (one process's share when several run side by side). Returns the bytes read."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    total = 0
    for key in keys:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        while chunk := body.read(1 << 20):
            total += len(chunk)
    return total


# Readers for the S3 benchmarks' persistent process pools (benchmarks/bench_s3_latency.py,
# bench_s3_cpu.py): each process keeps its client across passes, as a DataLoader's persistent
# worker keeps its connections, so a pass times the reads and not a client's set-up.
_clients: dict[tuple, object] = {}


def _s3_client(kind: str, endpoint: str, bucket: str, key: str, secret: str):
    """This process's boto3 client or obstore store for ``endpoint``, made once."""
    ident = (kind, endpoint, bucket, key, secret)
    if ident not in _clients:
        if kind == "boto3":
            import boto3
            from botocore.config import Config

            _clients[ident] = boto3.client(
                "s3",
                endpoint_url=endpoint,
                aws_access_key_id=key,
                aws_secret_access_key=secret,
                region_name="us-east-1",
                config=Config(s3={"addressing_style": "path"}),
            )
        else:
            from s3server import obstore_store  # type: ignore[import-not-found]

            _clients[ident] = obstore_store(endpoint, bucket, key, secret)
    return _clients[ident]


def stream_objects(kind: str, endpoint: str, bucket: str, key: str, secret: str, keys: list[str]) -> int:
    """Read each of ``keys`` to its end in turn, in 1 MiB pieces, with boto3 ``get_object``
    (``kind="boto3"``) or ``obstore.get`` (``kind="obstore"``). Returns the bytes read."""
    client = _s3_client(kind, endpoint, bucket, key, secret)
    total = 0
    if kind == "boto3":
        for k in keys:
            body = client.get_object(Bucket=bucket, Key=k)["Body"]  # type: ignore[attr-defined]
            while chunk := body.read(1 << 20):
                total += len(chunk)
    else:
        import obstore

        for k in keys:
            for chunk in obstore.get(client, k).stream(min_chunk_size=1 << 20):
                total += len(chunk)
    return total


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def wait_for_quiet(max_load: float, wait: float) -> tuple[float, float]:
    """Wait up to ``wait`` seconds for the 1-minute load to fall below ``max_load`` (a shared
    machine: timings at a quiet moment). Returns (the load then, seconds waited)."""
    t = time.monotonic()
    while load_average() >= max_load and time.monotonic() - t < wait:
        time.sleep(10)  # the load average moves over a minute: polling more often gains nothing
    return load_average(), time.monotonic() - t
