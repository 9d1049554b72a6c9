"""Replica CPU settings: torch threads from num_cpus, and niceness for every thread,
including threads started afterwards (run in a child process: niceness cannot be undone),
and the engine CPUs a replica binds to (cpu_bind, the node's $PDSERVE_ENGINE_CPUS)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdserve.deployments.config import AppConfig

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import os, threading
    from pdserve.deployments.replica import lower_cpu_priority, set_torch_threads
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


def test_engine_cpus_follow_cpu_bind_and_the_node_reservation() -> None:
    from pdserve.deployments.replica import engine_cpus

    env = {"PDSERVE_ENGINE_CPUS": "0"}
    assert engine_cpus("auto", env) == (0,)  # the node's reservation
    assert engine_cpus("auto", {}) == ()  # none: unbound
    assert engine_cpus("auto", {"PDSERVE_ENGINE_CPUS": " "}) == ()
    assert engine_cpus("none", env) == ()  # never, whatever the node says
    assert engine_cpus("0", {}) == (0,)  # explicit
    beyond = str(os.cpu_count() or 1)
    with pytest.raises(ValueError, match=f"cpu_bind '{beyond}'"):
        engine_cpus(beyond, {})
    with pytest.raises(ValueError, match="PDSERVE_ENGINE_CPUS"):
        engine_cpus("auto", {"PDSERVE_ENGINE_CPUS": beyond})


def test_cpu_bind_is_validated() -> None:
    for bad in ("2-1", "one", ""):
        with pytest.raises(ValueError, match="cpu_bind"):
            AppConfig.from_dict({"decode": {"cpu_bind": bad}})
    cfg = AppConfig.from_dict({"decode": {"cpu_bind": "0-1"}})
    assert cfg.decode.cpu_bind == "0-1" and cfg.prefill.cpu_bind == "auto"


def test_helper_threads_are_validated() -> None:
    cfg = AppConfig.from_dict({"decode": {"helper_threads": 1, "helper_min_tokens": 64}})
    assert (cfg.decode.helper_threads, cfg.decode.helper_min_tokens) == (1, 64)
    assert cfg.prefill.helper_threads == 0
    for bad in ({"helper_threads": -1}, {"helper_min_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AppConfig.from_dict({"decode": bad})


def test_bound_replicas_run_one_torch_thread_per_cpu() -> None:
    code = (
        "import torch; from pdserve.deployments.replica import set_torch_threads as s; "
        "print(s(4, (0, 1)), torch.get_num_threads(), s(1, (0, 1)), s(3))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "2", "1", "3"]
