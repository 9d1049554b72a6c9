"""The engine reaches the kernels through one module: ``pdserve.kernels.ops`` (the dispatch
layer), never a backend (Triton, the CPU kernels or runtime) or the references directly."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
DISPATCH = "pdserve.kernels.ops"


def kernel_imports(path: Path) -> list[str]:
    """Every ``pdserve.kernels`` module a file imports, at any depth (lazy imports too)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("pdserve.kernels")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pdserve.kernels"):
            if node.module == "pdserve.kernels":  # `from pdserve.kernels import ops`
                found += [f"pdserve.kernels.{a.name}" for a in node.names]
            else:
                found.append(node.module or "")
    return found


def test_the_engine_imports_only_the_dispatch_module() -> None:
    files = sorted(ENGINE.rglob("*.py"))
    assert files, ENGINE
    seen = {str(p.relative_to(ENGINE)): kernel_imports(p) for p in files}
    assert any(DISPATCH in mods for mods in seen.values())  # the check sees real imports
    stray = {name: mods for name, mods in seen.items() if set(mods) - {DISPATCH}}
    assert stray == {}


def test_the_check_catches_a_backend_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f():\n"
        "    from pdserve.kernels.cpu import native\n"
        "    import pdserve.kernels.triton.decode\n"
        "from pdserve.kernels import ops, reference\n"
    )
    assert sorted(kernel_imports(bad)) == [
        "pdserve.kernels.cpu",
        "pdserve.kernels.ops",
        "pdserve.kernels.reference",
        "pdserve.kernels.triton.decode",
    ]
