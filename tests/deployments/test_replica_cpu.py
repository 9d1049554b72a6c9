"""Replica CPU settings: torch threads from num_cpus, and niceness for every thread,
including threads started afterwards (run in a child process: niceness cannot be undone)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deployments.config import AppConfig

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import os, threading
    from deployments.replica import lower_cpu_priority, set_torch_threads
    import torch

    before = threading.Thread(target=lambda: threading.Event().wait(2), daemon=True)
    before.start()
    assert set_torch_threads(1.5) == 1 and torch.get_num_threads() == 1
    assert lower_cpu_priority(0) == 0
    changed = lower_cpu_priority(7)
    seen = {}
    def later():
        seen["later"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=later)
    t.start(); t.join()
    prios = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            prios.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    assert lower_cpu_priority(3) == 0  # never raises priority back
    print(changed >= 2, prios, seen["later"])
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness")
def test_niceness_reaches_every_thread_and_later_ones() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "{7}", "7"]


def test_nice_is_validated() -> None:
    with pytest.raises(ValueError, match="nice"):
        AppConfig.from_dict({"prefill": {"nice": 20}})
    assert AppConfig.from_dict({"prefill": {"nice": 10}}).prefill.nice == 10
