"""How pdserve installs: one ``pdserve`` namespace, no generic top-level modules, and the
modules the CLI and the Serve controller load stay free of torch and Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("engine", "kernels", "kvtransfer", "deployments", "cluster", "bench", "sim")


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_every_source_package_is_listed_in_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        "pdserve." + ".".join(init.parent.relative_to(REPO).parts)
        for folder in SOURCE_FOLDERS
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert set(setup["packages"]) == on_disk
    assert setup["package-dir"] == {f"pdserve.{f}": f for f in SOURCE_FOLDERS}


def test_type_checker_sees_every_source_folder_as_pdserve() -> None:
    """mypy finds ``pdserve.<folder>`` through .typecheck/pdserve: one symlink per folder."""
    links = REPO / ".typecheck" / "pdserve"
    assert {p.name for p in links.iterdir()} == set(SOURCE_FOLDERS)
    for folder in SOURCE_FOLDERS:
        assert (links / folder).resolve() == REPO / folder


def test_no_top_level_module_resolves_to_this_project(tmp_path: Path) -> None:
    """Installed, the project is reachable only as ``pdserve.*``: ``import kernels`` finds
    Hugging Face's package (or nothing), never ours."""
    code = (
        "import importlib.util, json, sys\n"
        f"names = {list(SOURCE_FOLDERS)!r}\n"
        "out = {}\n"
        "for n in names:\n"
        "    spec = importlib.util.find_spec(n)\n"
        "    out[n] = None if spec is None else (spec.origin or str(list(spec.submodule_search_locations or [])))\n"  # noqa: E501
        "import pdserve.engine, pdserve.deployments.config\n"
        "out['pdserve.engine'] = pdserve.engine.__file__\n"
        "print(json.dumps(out))\n"
    )
    result = _run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    import json

    found = json.loads(result.stdout)
    assert found.pop("pdserve.engine").startswith(str(REPO / "engine"))
    for name, origin in found.items():
        ours = str(REPO / name)
        assert origin is None or ours not in origin, f"top-level {name!r} is ours: {origin}"


def test_transformers_models_import_beside_hugging_faces_kernels(tmp_path: Path) -> None:
    """transformers' model code imports Hugging Face's ``kernels`` when it is installed;
    pdserve's own kernels must not stand in its way."""
    code = (
        "import importlib.util\n"
        "import transformers.activations, pdserve.kernels.ops\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print('none' if spec is None else spec.origin)\n"
    )
    result = _run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert str(REPO / "kernels") not in result.stdout


# Modules the `pdserve` CLI and the Serve controller import: they must load on a machine
# (or in a process) without torch and Ray.
LIGHT_MODULES = (
    "pdserve.cluster.cli",
    "pdserve.deployments.config",
    "pdserve.deployments.autoscaling",
)

_BLOCKER = """
import sys, importlib.abc
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "ray"):
            raise ImportError(f"blocked import of {name}")
        return None
sys.meta_path.insert(0, _Block())
"""


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_light_modules_import_without_torch_or_ray(module: str, tmp_path: Path) -> None:
    result = _run_python(f"{_BLOCKER}\nimport {module}\n", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_cli_help_runs_without_torch_or_ray(tmp_path: Path) -> None:
    code = f"{_BLOCKER}\nimport sys\nsys.argv = ['pdserve', '--help']\nfrom pdserve.cluster.cli import main\nmain()\n"  # noqa: E501
    result = _run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "pdserve up" in result.stdout


def _imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at any depth (functions included)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_simulator_imports_nothing_from_bench() -> None:
    """The simulator is a library that ``bench`` uses (``bench.sim_validate`` measures the
    cluster it is validated against), never the reverse."""
    offenders = {
        str(path.relative_to(REPO)): sorted(
            m
            for m in _imported_modules(path)
            if m == "pdserve.bench" or m.startswith("pdserve.bench.")
        )
        for path in sorted((REPO / "sim").rglob("*.py"))
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}
    assert "pdserve.sim.validate" in _imported_modules(REPO / "bench" / "sim_validate.py")


def test_no_test_module_imports_another() -> None:
    """Shared harnesses live in helper modules (``tests/support``, ``fakes.py``...): a test
    module imported by another would run its tests' module-level setup twice and couple
    unrelated files."""
    offenders = {
        str(path.relative_to(REPO)): sorted(
            m for m in _imported_modules(path) if m.startswith("tests.") and ".test_" in m
        )
        for path in sorted((REPO / "tests").rglob("*.py"))
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}
