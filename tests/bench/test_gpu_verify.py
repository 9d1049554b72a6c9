"""gpu_verify cannot rot: its dry run (the plan, and every import the device run makes) is
green on CPU, through the launcher that runs it from the tree, with Ray unimportable as on
the device image."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK_RAY = """
import sys
class _NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("no ray on the device image")
sys.meta_path.insert(0, _NoRay())
"""


def _run(cmd: list[str], tmp_path: Path, **env: str) -> dict:
    done = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dry run ok" in done.stdout
    return json.loads((tmp_path / "out" / "gpu_verify_plan.json").read_text())


def test_dry_run_through_the_launcher_with_ray_blocked(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_RAY)
    plan = _run(
        ["sh", str(ROOT / "bench" / "gpu_verify.sh"), "--dry-run", "--out", str(tmp_path / "out")],
        tmp_path,
        PYTHON=sys.executable,
        PYTHONPATH=str(site),
    )
    assert plan["failed"] == {} and plan["ray_modules_loaded"] == []
    assert plan["steps"] == [
        "kernels",
        "engine",
        "disagg",
        "throughput",
        "tp",
        "numerics",
        "tfgraphs",
    ]
    # The tree was imported through the launcher's symlink farm, not an installed copy.
    assert "pdserve-farm" in plan["pdserve_from"]
    assert "pdserve.bench.gpu_verify_steps" in plan["imported"]


def test_the_device_module_graph_imports_with_ray_blocked(tmp_path: Path) -> None:
    code = BLOCK_RAY + (
        "import runpy; sys.argv = ['gpu_verify', '--dry-run', '--out', 'out'];"
        "runpy.run_module('pdserve.bench.gpu_verify', run_name='__main__')"
    )
    plan = _run([sys.executable, "-P", "-c", code], tmp_path)
    assert plan["failed"] == {} and plan["ray_modules_loaded"] == []


def test_a_module_that_needs_ray_fails_the_dry_run(monkeypatch) -> None:
    from pdserve.bench import gpu_verify

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    for name in [m for m in sys.modules if m.startswith("pdserve.deployments")]:
        monkeypatch.delitem(sys.modules, name)
    modules = (*gpu_verify.DEVICE_MODULES, "pdserve.deployments.app")
    monkeypatch.setattr(gpu_verify, "DEVICE_MODULES", modules)
    ok, plan = gpu_verify.dry_run()
    assert not ok and "pdserve.deployments.app" in plan["failed"]


def test_the_table_marks_failures_and_skips() -> None:
    from pdserve.bench.gpu_verify import format_table

    rows = [
        {"step": "engine", "check": "tokens", "ok": True, "value": 8, "note": ""},
        {"step": "disagg", "check": "NCCL pair", "ok": None, "value": None, "note": "1 GPU"},
        {"step": "throughput", "check": "compiles", "ok": False, "value": 3, "note": ""},
    ]
    lines = format_table(rows).splitlines()
    assert [line.split()[1] for line in lines[1:]] == ["ok", "skip", "FAIL"]


def test_engine_and_disagg_steps_run_on_cpu(monkeypatch, tmp_path: Path) -> None:
    """Steps 2 and 3 pointed at the CPU (one test config): the same code the device runs
    finds the engine equal to transformers (with a preemption) and the two-process hand-off
    equal to the single engine; only the device and the transport differ there."""
    from pdserve.bench import gpu_verify_steps as steps

    monkeypatch.setattr(steps, "DEVICE", "cpu")
    monkeypatch.setattr(steps, "VARIANTS", ("mqa",))
    rows = steps.engine_vs_transformers(tmp_path) + steps.disaggregated(tmp_path)
    assert [r.ok for r in rows] == [True] * 5, rows
    assert rows[4].note == "transport ['torch_dist']"


def test_numerics_step_runs_on_cpu(monkeypatch, tmp_path: Path, capsys) -> None:
    """Step 6 pointed at the CPU on the tiny model: the engine's bf16 at least as close to
    float32 as transformers' bf16 in KL and in the last residual stream, tables printed.
    (Costly flips over the quick run's 40 prompts are counts of 2-3 for either system: the
    device run's 160 prompts decide that row.)"""
    from pdserve.bench import gpu_verify_steps as steps

    monkeypatch.setattr(steps, "DEVICE", "cpu")
    monkeypatch.setattr(steps, "NUMERICS_MODEL", "tiny")
    flips, kl, stream = steps.numerics(tmp_path, quick=True)
    assert kl.ok and stream.ok, (kl, stream)
    assert flips.unit == "of 40 prompts" and flips.value <= 40 and flips.limit is not None
    assert "final norm" in capsys.readouterr().out


def test_tp_step_runs_on_cpu_and_skips_with_one_gpu(monkeypatch, tmp_path: Path) -> None:
    """Step 5 pointed at the CPU (gloo between the two ranks) passes; on a device with one
    GPU it is a skip row that says why."""
    import torch

    from pdserve.bench import gpu_verify_steps as steps

    monkeypatch.setattr(steps, "DEVICE", "cpu")
    monkeypatch.setattr(steps, "TP_VARIANTS", ("mqa",))
    rows = steps.tensor_parallel(tmp_path)
    assert [r.ok for r in rows] == [True] and rows[0].value == 8, rows
    monkeypatch.setattr(steps, "DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    [skip] = steps.tensor_parallel(tmp_path)
    assert skip.ok is None and skip.note == "skipped: 1 GPU visible, TP=2 needs two"


def test_transformers_graphs_step_runs_on_cpu(monkeypatch, tmp_path: Path) -> None:
    """Step 7 pointed at the CPU (graphs are a CUDA matter: that row is a skip): the
    transformers path gives transformers' greedy tokens for the dense Llama and the
    Qwen3-MoE, and the throughput rows compare graphs on and off."""
    from pdserve.bench import gpu_verify_steps as steps

    monkeypatch.setattr(steps, "DEVICE", "cpu")
    monkeypatch.setattr(steps, "THROUGHPUT_MODEL", "tiny")
    rows = steps.transformers_graphs(tmp_path)
    assert [r.ok for r in rows] == [True, None, True, True, True], rows
    assert rows[0].value == rows[2].value == len(steps.ARRIVALS)
    assert rows[0].note == rows[2].note == "eager"
