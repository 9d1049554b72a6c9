"""``python -m pdserve.bench.chaos`` end to end, short: a local cluster of its own, mixed
streaming load, a decode and then a prefill replica SIGKILLed, and the bench's verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_short_chaos_run_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    cmd = [
        sys.executable, "-P", "-m", "pdserve.bench.chaos",
        "--duration-s", "50", "--kill-every-s", "20", "--kill", "random", "--seed", "2",
        "--concurrency", "4", "--out-dir", str(out),
    ]  # fmt: skip
    # From outside the checkout: its folders must not shadow installed packages.
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=840)
    report = json.loads((out / "chaos.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = report["summary"]
    assert summary["kills"] == 2 and summary["kills_not_recovered"] == 0
    assert summary["completed"] > 0
    assert summary["failed_after_first_token"] == summary["server_errors_5xx"] == 0
    assert report["kv_at_end"]["idle"] and report["passed"]
    assert "PASS" in proc.stdout
