"""``python -m pdserve.kernels.triton.gpu_check``: a no-op without CUDA, a full pass on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _run_gpu_check(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "pdserve.kernels.triton.gpu_check", "--out", str(out), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_check_without_cuda_says_so_and_exits_zero(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = _run_gpu_check(out)
    assert result.returncode == 0, result.stderr
    assert "CUDA is not available" in result.stdout
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_check_passes_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = _run_gpu_check(out, "--quick")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["all_ok"]
    names = {row["name"] for row in report["rows"]}
    assert {"paged_decode_attention", "paged_attention", "write_kv", "rms_norm (rel. err)"} <= names
