"""The package's layers with no exceptions (issue 35 item 6): no import cycle inside a layer's
modules, and the layer contract (pyproject.toml, checked by lint-imports) joins no two layers
with ':' (modules of one layer that may import each other)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import shardstream

PACKAGE = Path(shardstream.__file__).parent
ROOT = PACKAGE.parent


def _imports(path: Path, package: str) -> set[str]:
    """The shardstream modules a file imports, at its top or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("shardstream"):
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from shardstream.storage import fs`
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("shardstream"))
    return out


def _cycle(package: str) -> list[str] | None:
    """A cycle of imports among the modules of ``package`` (a subpackage of shardstream), or None."""
    folder = PACKAGE / package.removeprefix("shardstream.").replace(".", "/")
    modules = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    edges = {m: sorted(i for i in _imports(p, package) if i in modules and i != m) for m, p in modules.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in edges[m]:
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(modules):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_storage_modules_import_each_other_in_one_direction():
    assert _cycle("shardstream.storage") is None
    assert _cycle("shardstream.pipeline") is None
    assert _cycle("shardstream.plan") is None  # (plan/run.py re-exported plan/cursor.py's Cursor, which names run's PassPlan)


def test_the_cycle_finder_finds_one(tmp_path, monkeypatch):
    pkg = tmp_path / "shardstream" / "cyc"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("def f():\n    from shardstream.cyc.b import g\n")
    (pkg / "b.py").write_text("from shardstream.cyc import a\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "shardstream")
    a, b = "shardstream.cyc.a", "shardstream.cyc.b"
    assert _cycle("shardstream.cyc") in ([a, b, a], [b, a, b])


def test_the_layer_contract_has_no_layer_of_mutual_imports():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["containers"] == ["shardstream"]]  # the package's; others order inside one package
    for each in contracts:
        assert [layer for layer in each["layers"] if ":" in layer] == [], each["name"]
    layers = contract["layers"]
    assert layers.index("format") < layers.index("storage")  # format (manifests, tar scans) sits on storage
