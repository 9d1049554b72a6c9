"""Runs test_triton_interpret.py in a fresh process when this one imported triton too early.

Triton decides at import whether its own library functions are interpreted, so when some
other test module imported triton (transformers' Llama code does) before
tests/kernels/conftest.py set TRITON_INTERPRET=1, the interpreter tests cannot run in this
process; they run in a subprocess instead, where conftest comes first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.conftest import TRITON_IMPORTED_TOO_EARLY

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not TRITON_IMPORTED_TOO_EARLY, reason="the tests run in this process")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA machine: test_gpu_check instead")
def test_interpreter_suite_in_a_fresh_process() -> None:
    pytest.importorskip("triton")
    target = Path(__file__).with_name("test_triton_interpret.py")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target)],
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
