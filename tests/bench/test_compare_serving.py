"""``pdserve.bench.compare_serving``: one run measures every system in turn, one at a time, stops
each one, and reports the table, the JSON, the PNG and the targets; scripted OpenAI servers
stand in for pdserve and vLLM (the real servers are too heavy for a unit test)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import pdserve.bench.compare_serving as compare
from pdserve.bench.serve_metrics import Distribution, Summary
from tests.bench.fake_openai import FakeOpenAI
from tests.support.http import ThreadedServer


class ScriptedServer:
    """A FakeOpenAI served by uvicorn on an OS-chosen port; records what ran when."""

    log: list[str] = []  # start/stop events of every instance, in order

    def __init__(
        self, name: str, fail_to_start: bool = False, interrupt: BaseException | None = None
    ) -> None:
        self.name = name
        self.fail_to_start = fail_to_start
        self.interrupt = interrupt  # raised mid-start, as the SIGTERM handler's SystemExit
        self.fake = FakeOpenAI()
        self._server = ThreadedServer(self.fake.app)

    def start(self, timeout_s: float) -> str:
        ScriptedServer.log.append(f"start {self.name}")
        if self.fail_to_start:
            raise compare.ServerError(f"{self.name}: exited 1")
        if self.interrupt is not None:
            raise self.interrupt
        return self._server.start(timeout_s)

    def root_pids(self) -> list[int]:
        return [os.getpid()]  # the fake runs in this process's threads

    def engine_cpus(self) -> set[int]:
        return set()  # the fake binds nothing

    def stop(self) -> None:
        ScriptedServer.log.append(f"stop {self.name}")
        self._server.stop()


def _summary(name: str, tok_s: float, ttft_p50: float, tpot_p99: float) -> Summary:
    dist = lambda v: Distribution(v, v, v, v, 10)  # noqa: E731
    return Summary(
        name,
        10,
        0,
        1.0,
        10.0,
        tok_s,
        0.0,
        0,
        0,
        dist(ttft_p50),
        dist(tpot_p99),
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        {},
    )


def test_targets_compare_the_recommended_system_with_vllm() -> None:
    M = compare.Measurement
    results = [
        M(compare.DISAGG, "c8", _summary(compare.DISAGG, 120.0, 0.20, 0.05)),
        M(compare.VLLM, "c8", _summary(compare.VLLM, 100.0, 0.30, 0.04)),
        M(compare.DISAGG, "c32", _summary(compare.DISAGG, 150.0, 0.90, 0.09)),
        M(compare.VLLM, "c32", _summary(compare.VLLM, 180.0, 0.50, 0.08)),
        M(compare.DISAGG, "mixed-long", _summary(compare.DISAGG, 90.0, 0.3, 0.08)),
        M(compare.COLOC, "mixed-long", _summary(compare.COLOC, 95.0, 0.2, 0.30)),
    ]
    checks = {c["target"]: c["passed"] for c in compare.check_targets(results, compare.DISAGG)}
    assert checks == {
        "c8: pdserve-disagg out tok/s >= vllm": True,
        "c8: pdserve-disagg TTFT p50 <= vllm": True,
        "c32: pdserve-disagg out tok/s >= vllm": False,
        "c32: pdserve-disagg TTFT p50 <= vllm": False,
        "mixed-long: disagg TPOT p99 < coloc TPOT p99": True,
    }
    # Without vLLM the throughput targets cannot be judged: n/a, not a pass.
    no_vllm = [m for m in results if m.system != compare.VLLM]
    judged = compare.check_targets(no_vllm, compare.DISAGG)
    assert [c["passed"] for c in judged[:4]] == [None] * 4
    assert "n/a" in compare.format_checks(judged)


def test_missing_vllm_python_is_skipped_with_a_line(tmp_path: Path, capsys) -> None:
    args = compare.parse_args(["--vllm-python", str(tmp_path / "no-python")])
    servers = compare.build_servers(args, "/some/model", tmp_path)
    assert [s.name for s in servers] == [compare.DISAGG, compare.COLOC]
    assert "[vllm] skipped" in capsys.readouterr().out


def test_bad_flags_are_rejected() -> None:
    for argv in (["--systems", "sglang"], ["--workloads", "c64"], ["--scale", "0"]):
        with pytest.raises(SystemExit):
            compare.parse_args(argv)


def test_one_run_measures_each_system_alone_and_writes_the_report(
    tmp_path: Path, monkeypatch, capsys, tiny_model_dir: Path
) -> None:
    ScriptedServer.log = []
    servers = [
        ScriptedServer(compare.DISAGG),
        ScriptedServer(compare.COLOC, fail_to_start=True),
        ScriptedServer(compare.VLLM),
    ]
    monkeypatch.setattr(compare, "build_servers", lambda args, model_dir, out_dir: servers)
    out = tmp_path / "out"
    code = compare.main(
        [
            "--model-dir",
            str(tiny_model_dir),
            "--out-dir",
            str(out),
            "--scale",
            "0.01",
            "--output-len",
            "4",
            "--long-prompt-len",
            "64",
            "--warmup",
            "1",
            "--recommended",
            "pdserve-disagg",
        ]
    )
    assert code == 0
    # One server at a time: each is stopped before the next starts (also the failed one).
    assert ScriptedServer.log == [
        f"start {compare.DISAGG}",
        f"stop {compare.DISAGG}",
        f"start {compare.COLOC}",
        f"stop {compare.COLOC}",
        f"start {compare.COLOC}",  # a failed start is tried once more, after a stop
        f"stop {compare.COLOC}",
        f"start {compare.VLLM}",
        f"stop {compare.VLLM}",
    ]
    report = json.loads((out / "compare.json").read_text())
    rows = {(r["system"], r["workload"]): r for r in report["results"]}
    assert len(rows) == 9
    for wl in ("c8", "c32", "mixed-long"):
        got = rows[(compare.DISAGG, wl)]["summary"]
        want = next(w for w in report["workloads"] if w["name"] == wl)["num_requests"]
        assert got["completed"] == want and got["failed"] == 0
        assert got["total_output_tokens"] == 4 * want
        cpu = rows[(compare.DISAGG, wl)]["cpu"]
        assert cpu["server_cpu_s"] > 0 and cpu["wall_s"] > 0
        assert cpu["cpu_ms_per_output_token"] > 0
        assert rows[(compare.COLOC, wl)]["summary"] is None
        assert rows[(compare.COLOC, wl)]["note"] == "did not start"
    # Every system saw the same requests (prompt lengths included), warm-up excluded.
    sent = [b["prompt"] for b in servers[0].fake.bodies]
    assert sorted(sent) == sorted(b["prompt"] for b in servers[2].fake.bodies)
    assert report["startup_s"][compare.COLOC] is None
    assert (out / "compare.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "mixed-long" in printed and "did not start" in printed
    assert "targets (recommended: pdserve-disagg)" in printed


@pytest.mark.parametrize("interrupt", [SystemExit(128 + 15), KeyboardInterrupt()])
def test_a_signal_during_a_server_start_still_stops_that_server(
    tmp_path: Path, monkeypatch, tiny_model_dir: Path, interrupt: BaseException
) -> None:
    """SIGTERM (the handler raises SystemExit) or Ctrl-C while a server is starting: the
    half-started server is stopped before the benchmark exits, nothing is left running."""
    ScriptedServer.log = []
    servers = [ScriptedServer(compare.DISAGG, interrupt=interrupt), ScriptedServer(compare.VLLM)]
    monkeypatch.setattr(compare, "build_servers", lambda args, model_dir, out_dir: servers)
    argv = ["--model-dir", str(tiny_model_dir), "--out-dir", str(tmp_path), "--scale", "0.01"]
    with pytest.raises(type(interrupt)):
        compare.main(argv)
    assert ScriptedServer.log == [f"start {compare.DISAGG}", f"stop {compare.DISAGG}"]


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs thread affinity and 2+ CPUs",
)
def test_engine_cpus_are_found_and_the_load_generator_moved_off_them() -> None:
    import subprocess
    import sys

    from pdserve.bench.serving_systems import pin_this_process, pinned_thread_cpus

    last = max(os.sched_getaffinity(0))
    # A stand-in server whose compute thread pins itself, as vLLM's OpenMP threads do.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, threading, time\n"
            "pinned = threading.Event()\n"
            f"t = threading.Thread(target=lambda: (os.sched_setaffinity(0, {{{last}}}), "
            "pinned.set(), time.sleep(30)), daemon=True)\n"
            # time.sleep(30): the stand-in's lifetime (killed by the test), not synchronization
            "t.start(); pinned.wait(); print('ready', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert pinned_thread_cpus([child.pid]) == {last}
    finally:
        child.kill()
        child.wait()
    before = os.sched_getaffinity(0)
    restore = pin_this_process(before - {last})
    try:
        for task in Path("/proc/self/task").iterdir():
            try:
                assert os.sched_getaffinity(int(task.name)) == before - {last}
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
    finally:
        restore()
    assert os.sched_getaffinity(0) == before
