"""One typed line where pack met an untyped one: a full disk (DestinationError naming the
destination and its free space), hf:// URLs that are not a dataset's (ConfigError with the
expected form)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def _can_mount_tmpfs(tmp_path) -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    return subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"], capture_output=True).returncode == 0


def test_pack_to_a_full_disk_is_one_destination_error_naming_it_and_its_free_space(tmp_path):
    # A real full disk: a 1 MiB tmpfs mounted in a private mount namespace (nothing outside sees it)
    if not _can_mount_tmpfs(tmp_path):
        pytest.fail("this test needs root and unshare -m to mount a small tmpfs (the project's test machines have both)")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i:03d}.bin").write_bytes(os.urandom(300_000))
    dest = tmp_path / "full"
    dest.mkdir()
    script = f"mount -t tmpfs -o size=1m tmpfs {dest} && exec {sys.executable} -m shardstream pack {src} {dest}/ds --no-progress --max-size 1MB"
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60, env=dict(os.environ))
    err = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert len(err) == 1, done.stderr  # one line, no traceback
    assert err[0].startswith(f"shardstream pack: error: cannot write {dest}/ds: no space left on device in {dest}/ds, ")
    assert "bytes free of 1,048,576" in err[0] and "no manifest was written" in err[0]
