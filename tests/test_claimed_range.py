"""The (Python, torch) range pyproject.toml claims is one that works: torch 2.5 on Python 3.13
cannot torch.save, so the torch requirement's markers leave that combination out, and every
combination .ci/matrix tests is inside the claim."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _torch_requirements() -> list[Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [r for r in map(Requirement, deps) if r.name == "torch"]


def claimed(python: str, torch: str) -> bool:
    """Whether pip would accept ``torch`` on ``python`` for this project's requirements."""
    env = {"python_version": python, "python_full_version": f"{python}.0"}
    applying = [r for r in _torch_requirements() if r.marker is None or r.marker.evaluate(env)]
    return bool(applying) and all(r.specifier.contains(Version(torch)) for r in applying)


def test_python_313_with_torch_25_is_outside_the_claim_and_26_inside():
    assert not claimed("3.13", "2.5.1")
    assert claimed("3.13", "2.6.0") and claimed("3.11", "2.5.1") and claimed("3.12", "2.5.1")
    assert not claimed("3.11", "2.4.1")


def test_every_combination_the_matrix_runs_is_claimed():
    combos = re.findall(r'^\s+"(\w+) (3\.\d+) torch==([\d.]+)"$', (ROOT / ".ci" / "matrix").read_text(), re.M)
    assert len(combos) >= 2
    for name, python, torch in combos:
        assert claimed(python, torch), f".ci/matrix {name}: Python {python} + torch {torch} is outside pyproject.toml's claim"


def test_every_file_of_the_matrix_smoke_subset_exists():
    text = (ROOT / ".ci" / "matrix").read_text()
    smoke = re.search(r"^SMOKE=\(\n(.*?)^\)", text, re.M | re.S)
    assert smoke, ".ci/matrix has no SMOKE=( ... ) list"
    files = smoke.group(1).split()
    assert len(files) >= 5
    missing = [f for f in files if not (ROOT / f).is_file()]
    assert not missing, f".ci/matrix's smoke subset names files that are gone: {missing}"
