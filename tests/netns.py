"""Hosts on one machine, for tests: network namespaces (``ip netns``, as root), each joined by a
veth pair to a bridge this harness creates in the root namespace. Every address is on links
created here (10.231.N.0/24, N from the test process's pid), so traffic stays on them: host i is
10.231.N.(10+i), the bridge 10.231.N.1, where a server of the test's (moto) listens.

``hosts_problem()`` says why there can be no hosts here (not root, no ``ip``, namespaces refused);
``Hosts`` sets them up and, on exit (failure included), kills every process it started and every
process left in its namespaces, by PID, then deletes the namespaces and the bridge.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def hosts_problem() -> str | None:
    """None where namespaces can be made here, else why not (a test's skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); .ci/run runs as root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    probe = f"ssprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add refused: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """``count`` hosts: ``names[i]`` (namespace), ``addrs[i]`` (its address), ``ifname`` (its
    interface, the same name in each), ``gateway`` (the bridge's address, in the root namespace)."""

    def __init__(self, count: int = 2):
        tag = os.getpid() % 100000
        self.subnet = 10 + tag % 240
        self.names = [f"ss{tag}h{i}" for i in range(count)]
        self.addrs = [f"10.231.{self.subnet}.{10 + i}" for i in range(count)]
        self.gateway = f"10.231.{self.subnet}.1"
        self.bridge = f"ss{tag}br"
        self.ifname = "eth0"
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (name, addr) in enumerate(zip(self.names, self.addrs)):
                outside = f"{self.bridge}{i}"
                _ip("netns", "add", name)
                _ip("link", "add", outside, "type", "veth", "peer", "name", self.ifname, "netns", name)
                _ip("link", "set", outside, "master", self.bridge)
                _ip("link", "set", outside, "up")
                _ip("-n", name, "addr", "add", f"{addr}/24", "dev", self.ifname)
                _ip("-n", name, "link", "set", self.ifname, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, host: int, argv: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
        """``argv`` on host ``host`` (in its namespace), in a session of its own, output to ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.names[host], *argv], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def pids(self, host: int) -> list[int]:
        """Every process in host ``host``'s namespace (all of them started here)."""
        listed = _ip("netns", "pids", self.names[host], check=False)
        return [int(p) for p in listed.stdout.split()]

    def kill(self, host: int) -> None:
        """SIGKILL every process of host ``host``: a node lost."""
        for _ in range(3):  # a process may fork while its siblings die
            pids = self.pids(host)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for host in range(len(self.names)):
            self.kill(host)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for name in self.names:
            _ip("netns", "del", name, check=False)
        _ip("link", "del", self.bridge, check=False)
