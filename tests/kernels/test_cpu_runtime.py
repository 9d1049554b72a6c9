"""The CPU runtime: CPU lists (the syntax of ``taskset -c``, bad lists named in the error),
a bound thread (and the threads it starts) confined while the rest of the process keeps its
CPUs, torch threads from a replica's CPUs, niceness for every thread (including later ones),
the engine CPUs a replica binds to (cpu_bind, the node's $PDSERVE_ENGINE_CPUS), threads per
step, single-threaded copies on I/O threads, and a GPU runtime that ignores all of it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from pdserve.kernels.cpu.cpus import (
    RuntimeInfo,
    RuntimeSettings,
    check_cpus_exist,
    current_thread_cpus,
    engine_cpus,
    format_cpu_list,
    parse_cpu_list,
)
from pdserve.kernels.cpu.runtime import (
    CpuRuntime,
    StepThreads,
    bind_current_thread,
    single_threaded_copies,
)
from pdserve.kernels.ops import make_runtime

REPO = Path(__file__).resolve().parents[2]

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity")


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", (0,)), ("0-2,5", (0, 1, 2, 5)), (" 3 , 1", (1, 3)), ("4-4,2-3,3", (2, 3, 4))],
)
def test_cpu_lists_parse_and_format_back(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert format_cpu_list((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "-1", "1,,2", "0-x"])
def test_bad_cpu_lists_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="CPU list") as err:
        parse_cpu_list(text)
    assert repr(text) in str(err.value)


def test_cpus_beyond_the_machine_are_refused() -> None:
    n = os.cpu_count() or 1
    check_cpus_exist(range(n), "cpu_bind")
    with pytest.raises(ValueError, match=rf"cpu_bind: CPU\(s\) {n}"):
        check_cpus_exist([0, n], "cpu_bind")


@linux_only
def test_binding_confines_the_thread_and_its_children_only() -> None:
    before = current_thread_cpus()
    target = (before[-1],)
    seen: dict[str, tuple[int, ...]] = {}

    def engine_thread() -> None:
        seen["bound"] = (bind_current_thread(target),)  # type: ignore[assignment]
        seen["self"] = current_thread_cpus()
        child = threading.Thread(target=lambda: seen.update(child=current_thread_cpus()))
        child.start()
        child.join()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen == {"bound": (True,), "self": target, "child": target}
    assert current_thread_cpus() == before  # the caller's thread kept its CPUs


def test_binding_nothing_is_a_no_op() -> None:
    before = current_thread_cpus()
    assert bind_current_thread(()) is False
    assert current_thread_cpus() == before


# ---- niceness and torch threads (in a child process: niceness cannot be undone) ----------

CHILD = textwrap.dedent(
    """
    import os, threading
    from pdserve.kernels.cpu.runtime import lower_cpu_priority, set_torch_threads
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


ENGINE_NICE_CHILD = textwrap.dedent(
    """
    import os, threading
    from pdserve.kernels.cpu.cpus import RuntimeSettings
    from pdserve.kernels.cpu.runtime import CpuRuntime

    runtime = CpuRuntime(RuntimeSettings(engine_nice=6))
    runtime.prepare_process()  # the process-wide nice is 0: nothing changes here
    seen = {}
    def prio():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    def engine():
        runtime.on_engine_thread_start()
        seen["engine"] = prio()
        child = threading.Thread(target=lambda: seen.setdefault("child", prio()))
        child.start(); child.join()
    t = threading.Thread(target=engine)
    t.start(); t.join()
    print(prio(), seen["engine"], seen["child"])
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness")
def test_engine_nice_lowers_only_the_engine_thread_and_its_children() -> None:
    """The serving threads of a replica keep their priority; the step thread and the
    (OpenMP) threads it starts yield to them."""
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_NICE_CHILD],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "6", "6"]


def test_bound_replicas_run_one_torch_thread_per_cpu() -> None:
    code = (
        "import torch; from pdserve.kernels.cpu.runtime import set_torch_threads as s; "
        "print(s(4, (0, 1)), torch.get_num_threads(), s(1, (0, 1)), s(3))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "2", "1", "3"]


def test_engine_cpus_follow_cpu_bind_and_the_node_reservation() -> None:
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


def test_runtime_settings_are_validated_and_resolve_the_reservation() -> None:
    assert RuntimeSettings(cpu_bind="auto", node_engine_cpus="0").engine_cpus() == (0,)
    assert RuntimeSettings(cpu_bind="none", node_engine_cpus="0").engine_cpus() == ()
    for bad, named in (
        ({"helper_threads": -1}, "helper_threads"),
        ({"helper_min_tokens": 0}, "helper_min_tokens"),
        ({"nice": 20}, "nice"),
        ({"num_cpus": 0}, "num_cpus"),
        ({"cpu_bind": "2-1"}, "'2-1'"),
    ):
        with pytest.raises(ValueError, match=named):
            RuntimeSettings(**bad)
    beyond = str(os.cpu_count() or 1)
    with pytest.raises(ValueError, match="PDSERVE_ENGINE_CPUS"):  # before the model loads
        make_runtime(torch.device("cpu"), RuntimeSettings(cpu_bind="auto", node_engine_cpus=beyond))


# ---- threads per step and the I/O threads' copies ------------------------------------------


def test_step_threads_by_step_size() -> None:
    saved = torch.get_num_threads()
    try:
        policy = StepThreads(base=1, total=2, min_tokens=32)
        assert policy.apply(31) == 1 and torch.get_num_threads() == 1
        assert policy.apply(32) == 2 and torch.get_num_threads() == 2
        assert policy.apply(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(saved)


def _uses_libgomp() -> bool:
    return "libgomp" in Path("/proc/self/maps").read_text()


def _in_thread(fn):  # noqa: ANN001, ANN202
    out: dict[str, object] = {}

    def body() -> None:
        out["value"] = fn()

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    return out["value"]


def test_single_threaded_copies_limit_only_the_calling_thread() -> None:
    if not _uses_libgomp():
        pytest.skip("torch is not built with GNU OpenMP here")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        took, inside = _in_thread(lambda: (single_threaded_copies(), torch.get_num_threads()))
        assert took and inside == 1
        assert torch.get_num_threads() == 2
        # A thread that never asked keeps the process-wide setting.
        assert _in_thread(torch.get_num_threads) == 2
    finally:
        torch.set_num_threads(before)


# ---- the runtime by device -----------------------------------------------------------------


def test_a_cpu_engine_gets_the_cpu_runtime() -> None:
    runtime = make_runtime(torch.device("cpu"), None)
    assert isinstance(runtime, CpuRuntime) and runtime.describe() == RuntimeInfo()


@linux_only
def test_a_gpu_runtime_ignores_the_cpu_section_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Built for 'cuda' without touching CUDA: nothing is bound or niced, one line says so;
    torch's threads still follow the replica's num_cpus, as on every device."""
    settings = RuntimeSettings(
        num_cpus=1, nice=5, cpu_bind=str(max(current_thread_cpus())), helper_threads=1
    )
    saved = torch.get_num_threads()
    before = current_thread_cpus()
    nice_before = os.getpriority(os.PRIO_PROCESS, 0)
    runtime = make_runtime(torch.device("cuda"), settings)
    try:
        with caplog.at_level(logging.DEBUG, logger="pdserve.kernels"):
            runtime.prepare_process()
            seen = _in_thread(lambda: (runtime.on_engine_thread_start(), current_thread_cpus()))
            runtime.before_step(4096)
        assert seen[1] == before  # the engine thread was not bound
        assert torch.get_num_threads() == 1
        assert os.getpriority(os.PRIO_PROCESS, 0) == nice_before
        assert runtime.describe() == RuntimeInfo()
        lines = [r for r in caplog.records if r.name.startswith("pdserve.kernels")]
        assert len(lines) == 1 and "cpu settings" in lines[0].getMessage()
        assert "cuda" in lines[0].getMessage()
    finally:
        torch.set_num_threads(saved)


def test_a_standalone_gpu_engine_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="pdserve.kernels"):
        make_runtime(torch.device("cuda"), None).prepare_process()
    assert not [r for r in caplog.records if r.name.startswith("pdserve.kernels")]
