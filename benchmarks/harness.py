"""What every workload shares: peers run in fresh processes (their own venvs), interleaved
repeats, one JSON line per measurement, CPU time of a process and everything under it.

A measurement runs as ``python -m benchmarks.child MODULE FUNCTION CONFIG_JSON`` in the peer's
interpreter with this repository on ``PYTHONPATH``; the child prints one JSON object on its last
line (with ``PYTHONDONTWRITEBYTECODE`` removed from its environment: ``Runner.call``). Workload
modules import only the standard library at their top, so a peer's venv that has
torch and the peer (and not shardstream's own dependencies) can import them.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# The import name of each peer (to find it and read its version) and the pip line for its venv.
PEERS: dict[str, tuple[str, str]] = {
    "shardstream": ("shardstream", "this checkout"),
    "webdataset": ("webdataset", "pip install torch webdataset"),
    "litdata": ("litdata", "pip install torch litdata"),
    "grain": ("grain", "pip install torch grain"),
    "spdl": ("spdl", "pip install torch spdl, and FFmpeg's shared libraries (docs/performance.md)"),
    "torch": ("torch", "torch.utils.data.DataLoader (no other package)"),
    "floor": ("numpy", "the same work on data already in memory (no loader)"),
    "pyarrow": ("pyarrow", "pip install torch pyarrow"),
    "polars": ("polars", "pip install torch polars"),
    "datasets": ("datasets", "pip install torch datasets"),
    "boto3": ("boto3", "pip install torch boto3"),
    "obstore": ("obstore", "pip install torch obstore"),
}


class NotInstalled(Exception):
    """A peer asked for is neither in a ``--venv`` nor importable here."""


def cpu_seconds() -> float:
    """CPU seconds of this process and every process under it: the children it waited for
    (getrusage) and, from /proc, the live ones (persistent DataLoader workers, a forkserver and
    its workers) with the children each of those waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + sum(_proc_cpu(pid) for pid in _descendants(os.getpid()))


def _proc_stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _proc_cpu(pid: int) -> float:
    try:
        fields = _proc_stat(pid)
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for pid in entries:
        try:
            parents.setdefault(int(_proc_stat(pid)[1]), []).append(pid)
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def timed_pass(make: Callable[[], Iterable[Any]], size: Callable[[Any], int]) -> dict[str, float]:
    """One pass: ``make()`` (the loader's construction is timed) then every batch; ``size`` counts
    a batch's items. Returns items, wall and CPU seconds, and the time to the first batch."""
    t, c = time.perf_counter(), cpu_seconds()
    first = None
    items = 0
    for batch in make():
        if first is None:
            first = time.perf_counter() - t
        items += size(batch)
    return {"items": items, "seconds": time.perf_counter() - t, "cpu_seconds": cpu_seconds() - c, "first_batch_s": first or 0.0}


def loader_options(config: dict) -> dict[str, Any]:
    """Keywords for ``make_loader`` beyond ``num_workers``: ``pin_memory=False``, no logging, and
    the ``--runtime`` when one is asked for, as ``workers=`` (only where make_loader has it)."""
    from shardstream import make_loader

    out: dict[str, Any] = {"pin_memory": False, "log_interval": None}
    if config.get("runtime"):
        if "workers" not in inspect.signature(make_loader).parameters:
            raise SystemExit("--runtime: this shardstream's make_loader has no workers= option")
        out["workers"] = config["runtime"]
    return out


def versions(peer: str) -> dict[str, str]:
    """python, torch and the peer's versions, read in the process that measures."""
    out = {"python": platform.python_version()}
    for name in ("torch", PEERS.get(peer, (peer, ""))[0]):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed: no version to give
            out[name] = ""
    return out


class Runner:
    """Which interpreter runs each peer: ``--venv PEER=PATH`` or, where the peer imports here, this one."""

    def __init__(self, venvs: dict[str, str], env: dict[str, str] | None = None):
        self.venvs = venvs
        self.env = env or {}

    def python(self, peer: str) -> str:
        if peer in self.venvs:
            exe = os.path.join(self.venvs[peer], "bin", "python")
            if not os.path.exists(exe):
                raise NotInstalled(f"{peer}: {exe} does not exist (--venv {peer}=PATH names a venv)")
            return exe
        module = PEERS.get(peer, (peer, ""))[0]
        if importlib.util.find_spec(module) is None:
            raise NotInstalled(f"{peer} is not installed here: make a venv ({PEERS.get(peer, ('', ''))[1]}) and pass --venv {peer}=PATH")
        return sys.executable

    def call(self, peer: str, module: str, function: str, config: dict, timeout: float = 3600) -> dict:
        """``function(config)`` of ``benchmarks.MODULE`` in a fresh process of ``peer``'s interpreter."""
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **self.env}
        # Every peer runs from compiled bytecode: pip wrote a peer's .pyc files when it installed
        # it, and this checkout's are written by its first measurement. With the variable set,
        # this checkout's modules were compiled from source in every timed pass (~110 ms of its
        # import here), a cost no installed package pays.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [self.python(peer), "-m", "benchmarks.child", module, function, json.dumps(config)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{peer} {module}.{function} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(lines[-1])


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def record(workload: str, peer: str, config: dict, repeat: int, result: dict, unit: str, rate_of: str = "rate") -> dict:
    """One JSON line: what was measured, under which versions, load and command."""
    items, seconds = result["items"], result["seconds"]
    rate = result[rate_of] if rate_of in result else (items / seconds if seconds > 0 else 0.0)
    cpu = result.get("cpu_seconds")
    return {
        "workload": workload,
        "peer": peer,
        "config": config,
        "repeat": repeat,
        "rate": rate,
        "unit": unit,
        "seconds": seconds,
        "items": items,
        "cpu_seconds": cpu,
        "cpu_us_per_item": cpu / items * 1e6 if cpu is not None and items else None,
        "first_batch_s": result.get("first_batch_s"),
        "versions": result.get("versions", {}),
        "load_average": list(os.getloadavg()),
        "cores": os.cpu_count(),
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], "-m", "benchmarks", *sys.argv[1:]]),
        "git_commit": GIT_COMMIT,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


GIT_COMMIT = ""


def interleave(
    workload: str,
    module: str,
    peers: list[str],
    configs: list[dict],
    repeats: int,
    runner: Runner,
    unit: str,
    emit: Callable[[dict], None],
    skip: Callable[[str, dict], bool] = lambda peer, config: False,
    rate_of: str = "rate",
) -> list[dict]:
    """Every (config, peer) once per repeat, in the same order each time (A B A B ...): a burst
    of load hits every contender alike. Peers not installed are said once and left out."""
    global GIT_COMMIT
    GIT_COMMIT = GIT_COMMIT or git_commit()
    ready = []
    for peer in peers:
        try:
            runner.python(peer)
            ready.append(peer)
        except NotInstalled as e:
            print(f"skipped: {e}", file=sys.stderr)
    records = []
    for repeat in range(repeats):
        for config in configs:
            for peer in ready:
                if skip(peer, config):
                    continue
                result = runner.call(peer, module, "measure", {**config, "peer": peer})
                shown = {k: v for k, v in config.items() if not k.startswith("_")}
                rec = record(workload, peer, shown, repeat, result, unit, rate_of)
                records.append(rec)
                emit(rec)
    return records


def summary(records: list[dict]) -> str:
    """Medians per (peer, config), one line each, for the terminal."""
    groups: dict[tuple[str, str, str], list[float]] = {}
    for r in records:
        groups.setdefault((r["workload"], r["peer"], config_text(r["config"])), []).append(r["rate"])
    unit = {(r["workload"], r["peer"], config_text(r["config"])): r["unit"] for r in records}
    return "\n".join(f"{w} {p} [{c}]: median {number(statistics.median(v))} {unit[(w, p, c)]} over {len(v)}" for (w, p, c), v in groups.items())


def number(x: float) -> str:
    """1,234 / 12.35 / 0.0123: three or more significant digits, thousands separated."""
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def config_text(config: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(config.items()) if v is not None and v != "")
