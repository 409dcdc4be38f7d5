"""The architecture as data: the import-linter contracts in pyproject.toml hold, and they catch a new cycle.

`lint-imports` runs on this checkout; then the same contracts run on a copy with a cycle planted (an
import inside a function, which counts like any other) and with a layer broken, and must fail naming it.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[test]')")


def lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def copy_tree(tmp_path: Path) -> Path:
    """The packages and the contracts, nothing else (the linter reads source only)."""
    dst = tmp_path / "repo"
    for pkg in ("engine", "runner", "app"):
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_the_import_contracts_hold():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def plant(tmp_path: Path, module: str, body: str) -> subprocess.CompletedProcess:
    """The contracts run on a copy of the packages where `module` (a path) ends with a function whose body
    is `body`: an import hidden in a function counts like any other."""
    repo = copy_tree(tmp_path)
    path = repo / module
    path.write_text(path.read_text() + "\n\ndef _planted():\n" + "".join(f"    {line}\n" for line in body.splitlines()))
    return lint(repo)


def test_a_planted_cycle_inside_a_function_fails_the_contracts(tmp_path):
    """model.graph importing the plan breaks the layers and makes a cycle; the report names the import."""
    r = plant(tmp_path, "engine/model/graph.py", "from engine.spmd.plan import Plan\nreturn Plan")
    assert r.returncode != 0
    assert "engine.model.graph -> engine.spmd.plan" in r.stdout
    assert "No cycles are allowed in engine" in r.stdout


def test_a_cycle_between_two_runner_modules_fails(tmp_path):
    r = plant(tmp_path, "runner/config.py", "from runner import launch\nreturn launch")
    assert r.returncode != 0 and "No cycles are allowed in runner" in r.stdout


def test_the_engine_importing_the_runner_fails(tmp_path):
    r = plant(tmp_path, "engine/cli.py", "import runner.cli\nreturn runner.cli")
    assert r.returncode != 0 and "engine is not allowed to import runner" in r.stdout


def test_every_module_under_engine_belongs_to_a_declared_layer():
    """A new top-level module or subpackage must be placed in the layers contract (it is `exhaustive`);
    the top level stays small: everything else lives in a subpackage named for its capability."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in config if c["id"] == "engine-layers")
    assert layers["exhaustive"] is True
    declared = {name.strip() for row in layers["layers"] for name in row.replace(":", "|").split("|")}
    children = {p.stem for p in (ROOT / "engine").glob("*.py") if p.stem != "__init__"}
    children |= {p.name for p in (ROOT / "engine").iterdir() if (p / "__init__.py").exists()}
    assert children == declared
    assert len(list((ROOT / "engine").glob("*.py"))) <= 12


def test_every_subpackage_says_what_it_owns_and_may_import():
    for init in sorted((ROOT / "engine").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Owns:" in doc and "May import:" in doc, f"{init} must say what it owns and what it may import"
