"""A real S3-compatible server for the benchmarks, on 127.0.0.1 (a free port), with a bucket made
and credentials set; stopped by its PID. A context manager for a benchmark and a CLI for a shell.

    python benchmarks/s3server.py --kind s3rver [--bucket bench] [--dir DIR]
    python benchmarks/s3server.py --kind s3rver --check-range

The first prints the endpoint on its first line, then the ``export`` lines for the credentials,
and serves until it is interrupted (Ctrl-C or SIGTERM); ``--check-range`` instead measures what
the server reads from its own storage per ranged GET and exits. In a benchmark::

    with s3_server("s3rver") as server:      # os.environ gets the credentials
        client = server.client()               # boto3, endpoint and credentials set
        store = server.obstore()               # obstore.store.S3Store for the bucket
        options = server.storage_options       # {"endpoint_url": ...} for Store(options=...)

The kinds (``benchmarks/install_s3server.sh KIND`` installs the first two, not CI):

- ``seaweedfs``: SeaweedFS's ``weed server -s3`` (master, volume, filer and S3 gateway in one
  process), a Go program. It needs the ``weed`` binary on PATH or in
  ``~/.cache/shardstream/seaweedfs/``; building it needs Go >= 1.25 and the Go module proxy.
- ``s3rver``: the npm package s3rver 3.7.1, a Node S3 server on a file backend, installed under
  ``~/.cache/shardstream/s3rver/``. It checks SigV4 signatures (key and secret ``S3RVER``), and a
  ranged GET streams only the range from its file (``fs.createReadStream(path, {start, end})``).
  Its suffix ranges (``bytes=-N``, the last N bytes: polars reads footers so) are wrong in 3.7.1
  (it serves bytes 0-N): the launcher below makes them explicit ranges before s3rver reads them.
- ``moto``: moto's server (from the venv, as the tests use). Not a stand-in for a real server in a
  benchmark: it keeps each object as one value and copies all of it for every ranged GET.

``--check-range`` puts one 64 MiB object, then reads 64 KiB ranges of it and reports the server
process's ``rchar`` (bytes it read through system calls: files and sockets) and time per ranged GET
beside a whole GET; a server that reads only the range reads about 64 KiB plus the request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "shardstream")
KINDS = ("seaweedfs", "s3rver", "moto")
REGION = "us-east-1"
START_TIMEOUT = 120.0  # seconds for a server to answer its first request (a loaded machine is slow)

# s3rver as its CLI runs it (path-style buckets only, quiet), except that an idle kept-alive
# connection stays open for 10 minutes rather than Node's 5 seconds: between two passes of a
# benchmark every client's connections would be closed, and each pass would start by reconnecting
# (through latency_proxy.py, a closed upstream connection fails that request and the client retries).
S3RVER_MAIN = """
const [moduleDir, directory, port] = process.argv.slice(1);
const S3rver = require(moduleDir);
// s3rver 3.7.1 reads a suffix range (`Range: bytes=-N`: the object's last N bytes, RFC 9110 and S3)
// as bytes 0-N, so a client that reads a Parquet footer that way (object_store: polars, obstore's
// get_range with a suffix) gets the file's first bytes and fails. Made the explicit range here.
const objects = require(moduleDir + '/lib/controllers/object');
const getObject = objects.getObject;
objects.getObject = async function (ctx) {
  const suffix = /^bytes=-([0-9]+)$/.exec(ctx.headers['range'] || '');
  if (suffix && Number(suffix[1]) > 0) {
    const metadata = await ctx.store.getMetadata(ctx.params.bucket, ctx.params.key).catch(() => null);
    const size = metadata ? Number(metadata['content-length']) : 0;
    if (size > 0) ctx.headers['range'] = `bytes=${Math.max(0, size - Number(suffix[1]))}-${size - 1}`;
  }
  return getObject(ctx);
};
const server = new S3rver({ address: '127.0.0.1', port: Number(port), directory, silent: true, vhostBuckets: false });
server.run().then(() => {
  server.httpServer.keepAliveTimeout = 600000;
  server.httpServer.headersTimeout = 601000;
  console.log('s3rver listening on 127.0.0.1:' + port);
}, err => { console.error(err); process.exit(1); });
"""


@dataclass
class S3Server:
    """A running server: where it is, how to sign for it, and its process."""

    kind: str
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    proc: subprocess.Popen
    workdir: str
    region: str = REGION
    log: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def env(self) -> dict[str, str]:
        """The credentials as the AWS SDKs (boto3, s3fs, shardstream, obstore's from_env) read them."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }

    @property
    def storage_options(self) -> dict[str, Any]:
        """For ``Store(options=...)``: the endpoint (credentials come from the environment)."""
        return {"endpoint_url": self.endpoint}

    def version(self) -> str:
        """The server and its version, e.g. ``s3rver 3.7.1``."""
        if self.kind == "s3rver":
            with open(os.path.join(self.proc.args[3], "package.json")) as f:  # type: ignore[index]
                return f"s3rver {json.load(f)['version']}"
        if self.kind == "moto":
            from importlib.metadata import version

            return f"moto {version('moto')}"
        out = subprocess.run([self.proc.args[0], "version"], capture_output=True, text=True, timeout=60).stdout.split()  # type: ignore[index]
        return f"seaweedfs {out[2] if len(out) > 2 else '?'}"

    def client(self, endpoint: str | None = None):
        """A boto3 S3 client for this server (or for a proxy in front of it, ``endpoint``)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}),
        )

    def obstore(self, endpoint: str | None = None):
        """An ``obstore.store.S3Store`` for the bucket (or through a proxy at ``endpoint``)."""
        return obstore_store(endpoint or self.endpoint, self.bucket, self.access_key, self.secret_key, self.region)


def obstore_store(endpoint: str, bucket: str, access_key: str, secret_key: str, region: str = REGION):
    """obstore's S3 store on a plain-HTTP, path-style endpoint (a function of module scope, so a
    forked process can make its own)."""
    from obstore.store import S3Store

    return S3Store(
        bucket,
        endpoint=endpoint,
        access_key_id=access_key,
        secret_access_key=secret_key,
        region=region,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )


def free_port(also_plus: int = 0) -> int:
    """A free TCP port on 127.0.0.1 (and, with ``also_plus``, port + also_plus free too: SeaweedFS
    puts each gRPC port 10000 above its HTTP port)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not also_plus:
            return port
        if port + also_plus < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + also_plus))
                return port
            except OSError:
                continue
    raise SystemExit("no free port pair on 127.0.0.1")


def _find(kind: str) -> list[str]:
    """The command that runs this kind's server, or a SystemExit saying how to install it."""
    if kind == "s3rver":
        script = os.environ.get("SHARDSTREAM_S3RVER") or os.path.join(CACHE, "s3rver", "node_modules", "s3rver", "bin", "s3rver.js")
        node = shutil.which("node")
        if node is None or not os.path.exists(script):
            raise SystemExit(f"s3rver is not installed ({script}): run `bash benchmarks/install_s3server.sh s3rver`")
        return [node, "-e", S3RVER_MAIN, os.path.dirname(os.path.dirname(script))]
    if kind == "seaweedfs":
        weed = os.environ.get("SHARDSTREAM_WEED") or shutil.which("weed") or os.path.join(CACHE, "seaweedfs", "weed")
        if not os.path.exists(weed):
            raise SystemExit(f"SeaweedFS's weed is not installed ({weed}): run `bash benchmarks/install_s3server.sh seaweedfs`")
        return [weed]
    if kind == "moto":
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        if not os.path.exists(exe):
            raise SystemExit(f"moto_server is not in this venv ({exe})")
        return [exe]
    raise SystemExit(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")


def _command(kind: str, base: list[str], workdir: str, port: int) -> tuple[list[str], str, str]:
    """(argv, access key, secret key) for this kind on ``port``."""
    if kind == "s3rver":
        # s3rver signs with its one built-in account; --no-vhost-buckets: path-style only
        os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
        return [*base, os.path.join(workdir, "data"), str(port)], "S3RVER", "S3RVER"
    if kind == "seaweedfs":
        key, secret = "shardstream", "shardstream-bench-secret"
        config = {
            "identities": [
                {
                    "name": "bench",
                    "credentials": [{"accessKey": key, "secretKey": secret}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        path = os.path.join(workdir, "s3.json")
        with open(path, "w") as f:
            json.dump(config, f)
        os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
        master, volume, filer = (free_port(10000) for _ in range(3))
        argv = [
            *base,
            "server",
            "-dir",
            os.path.join(workdir, "data"),
            "-ip",
            "127.0.0.1",
            "-ip.bind",
            "127.0.0.1",
            "-master.port",
            str(master),
            "-master.volumeSizeLimitMB",
            "1024",
            "-volume.port",
            str(volume),
            "-filer.port",
            str(filer),
            "-s3",
            "-s3.port",
            str(port),
            "-s3.config",
            path,
        ]
        return argv, key, secret
    return [*base, "-H", "127.0.0.1", "-p", str(port)], "testing", "testing"


def stop(proc: subprocess.Popen) -> None:
    """Stop a server this module started, by its PID: SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def s3_server(kind: str = "s3rver", bucket: str = "bench", directory: str | None = None, set_env: bool = True) -> Iterator[S3Server]:
    """Start ``kind`` on a free loopback port with ``bucket`` made; yields an ``S3Server``. With
    ``set_env`` the credentials go into ``os.environ`` (boto3, s3fs, shardstream and forked workers
    read them there). The server's files live in ``directory`` (default: a temporary folder,
    removed on exit)."""
    base = _find(kind)
    own_dir = directory is None
    workdir = tempfile.mkdtemp(prefix=f"shardstream-{kind}-") if directory is None else directory
    os.makedirs(workdir, exist_ok=True)
    port = free_port()
    argv, key, secret = _command(kind, base, workdir, port)
    log_path = os.path.join(workdir, "server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)
    server = S3Server(kind, f"http://127.0.0.1:{port}", bucket, key, secret, proc, workdir, log=log_path)
    try:
        if set_env:
            os.environ.update(server.env)
        _make_bucket(server)
        yield server
    finally:
        stop(proc)
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _make_bucket(server: S3Server) -> None:
    """Create the bucket, retrying until the server answers (SeaweedFS's S3 gateway listens before
    its filer is ready); a server that exits or never answers is a SystemExit with its log's tail."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = server.client()
    deadline = time.monotonic() + START_TIMEOUT
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        try:
            client.create_bucket(Bucket=server.bucket)
            return
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            last = e
        except BotoCoreError as e:  # not listening yet
            last = e
        time.sleep(0.2)  # another process's start: no event to wait on
    with open(server.log, errors="replace") as f:
        tail = f.read()[-2000:]
    raise SystemExit(f"the {server.kind} server did not answer on {server.endpoint} ({last}); its log ends:\n{tail}")


def read_bytes_of(pid: int) -> int:
    """Bytes a running process has read through system calls (``rchar``: files and sockets)."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError(f"no rchar in /proc/{pid}/io")


def check_range(server: S3Server, size: int = 64 << 20, piece: int = 64 << 10, gets: int = 16) -> dict[str, float]:
    """What the server reads per ranged GET of ``piece`` bytes from a ``size``-byte object, against
    a whole GET: its rchar and the time, medians of ``gets``."""
    client = server.client()
    client.put_object(Bucket=server.bucket, Key="range-check", Body=os.urandom(size))
    client.get_object(Bucket=server.bucket, Key="range-check")["Body"].read()  # warm (s3rver's md5 file, caches)
    ranged_bytes, ranged_time = [], []
    for i in range(gets):
        start = (i * 7919 * piece) % (size - piece)
        before, t = read_bytes_of(server.pid), time.perf_counter()
        got = client.get_object(Bucket=server.bucket, Key="range-check", Range=f"bytes={start}-{start + piece - 1}")["Body"].read()
        ranged_time.append(time.perf_counter() - t)
        ranged_bytes.append(read_bytes_of(server.pid) - before)
        assert len(got) == piece, (len(got), piece)
    whole_bytes, whole_time = [], []
    for _ in range(3):
        before, t = read_bytes_of(server.pid), time.perf_counter()
        assert len(client.get_object(Bucket=server.bucket, Key="range-check")["Body"].read()) == size
        whole_time.append(time.perf_counter() - t)
        whole_bytes.append(read_bytes_of(server.pid) - before)
    client.delete_object(Bucket=server.bucket, Key="range-check")
    return {
        "object_bytes": size,
        "range_bytes": piece,
        "server_read_per_ranged_get": statistics.median(ranged_bytes),
        "seconds_per_ranged_get": statistics.median(ranged_time),
        "server_read_per_whole_get": statistics.median(whole_bytes),
        "seconds_per_whole_get": statistics.median(whole_time),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=KINDS, default="s3rver")
    parser.add_argument("--bucket", default="bench")
    parser.add_argument("--dir", default=None, help="the server's files (default: a temporary folder, removed on exit)")
    parser.add_argument("--check-range", action="store_true", help="measure the server's reads per ranged GET, then exit")
    args = parser.parse_args()
    with s3_server(args.kind, args.bucket, args.dir) as server:
        print(server.endpoint, flush=True)
        if args.check_range:
            result = check_range(server)
            print(json.dumps({"kind": server.kind, **result}))
            read = result["server_read_per_ranged_get"]
            print(
                f"{server.kind}: a ranged GET of {result['range_bytes'] >> 10} KiB from a {result['object_bytes'] >> 20} MiB "
                f"object read {read / 1024:,.0f} KiB in the server ({result['seconds_per_ranged_get'] * 1e3:.1f} ms); "
                f"a whole GET read {result['server_read_per_whole_get'] / 2**20:,.1f} MiB "
                f"({result['seconds_per_whole_get'] * 1e3:.0f} ms)"
            )
            return
        for name, value in server.env.items():
            print(f"export {name}={value}")
        print(f"# bucket {server.bucket}, PID {server.pid}; Ctrl-C stops it", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            server.proc.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
