"""`pdserve run CONFIG` (what `make serve` calls): three nodes, the app deployed with prefill
and decode replicas on their labelled nodes, an OpenAI endpoint and a gRPC endpoint (on by
default) that answer, pdserve's metrics on the nodes' Prometheus endpoints, one trace per
request across the ingress, decode and prefill processes, and SIGTERM taking everything
down again."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pdserve.cluster.procs import is_running, session_members
from tests.cluster.telemetry_scrape import node_samples, spans_by_trace
from tests.support import wait_until
from tests.support.cli import REPO, PdserveRun, pdserve

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(480)]
CONFIG = """
model:
  test_model: tiny
decode:
  engine:
    max_num_seqs: 8
observability:
  tracing_exporter: console
"""
# Longer than policy.local_prefill_max_tokens (64): the decode replica prefills it remotely.
# The root span follows the GenAI conventions ("{operation} {model}"); the internal ones are
# pdserve's own ("pdserve.{stage}").
ROOT_OPERATION = "text_completion"
STAGES = ("decode", "prefill_remote", "prefill", "kv_transfer")
LONG_PROMPT = " ".join(["the river runs past the old mill to the sea"] * 12)


def _check_engine_thread_owns_its_cpu(members: list[int]) -> None:
    """On 2+ CPUs only the decode replica's engine thread runs on the decode engine CPU (the
    last one); every other thread of the cluster runs on the shared ones."""
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        return
    cpus = sorted(os.sched_getaffinity(0))
    engine, shared = {cpus[-1]}, set(cpus[:-1])
    bound: list[str] = []
    for pid in members:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                allowed = os.sched_getaffinity(int(task.name))
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except (ProcessLookupError, FileNotFoundError):
                continue  # ended meanwhile
            assert allowed in (engine, shared), (pid, task.name, allowed)
            if allowed == engine:
                bound.append(cmdline)
    assert len(bound) == 1 and "DecodeServer" in bound[0], bound


def test_run_serves_until_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "app.yaml"
    config.write_text(CONFIG)
    state_dir = tmp_path / "state"
    # Ray's agent exports metrics every 10 s by default; the nodes inherit this.
    run = PdserveRun(
        config, state_dir, env={**os.environ, "RAY_metrics_report_interval_ms": "2000"}
    )
    try:
        base = run.wait_for(r"OpenAI API\s+(http://127\.0\.0\.2:\d+)/v1", 400)
        grpc_port = int(run.wait_for(r"gRPC\s+127\.0\.0\.2:(\d+)", 10))
        grpc_call = run.wait_for(r"^\s+(python -m pdserve\.deployments\.grpc\.client .*)$", 10)
        run.wait_for(r"serving; Ctrl-C", 30)
        state = json.loads((state_dir / "cluster.json").read_text())
        leaders = [n["pid"] for n in state["nodes"]]
        members = session_members(leaders)
        _check_engine_thread_owns_its_cpu(members)

        with httpx.Client(base_url=base, timeout=120) as client:
            (model,) = client.get("/v1/models").json()["data"]
            reply = client.post(
                "/v1/chat/completions",
                json={
                    "model": model["id"],
                    "messages": [{"role": "user", "content": "Hello there"}],
                    "max_tokens": 6,
                    "ignore_eos": True,
                },
            )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["finish_reason"] == "length"
        with socket.create_connection(("127.0.0.2", grpc_port), timeout=5):
            pass  # Serve's gRPC proxy listens where `run` said
        # The printed gRPC line works as pasted.
        grpc_reply = subprocess.run(
            [sys.executable, *shlex.split(grpc_call)[1:]],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert grpc_reply.returncode == 0, grpc_reply.stderr
        assert grpc_reply.stdout.strip() and "completion_tokens" in grpc_reply.stderr

        with httpx.Client(base_url=base, timeout=120) as client:
            remote = client.post(
                "/v1/completions",
                json={"model": model["id"], "prompt": LONG_PROMPT, "max_tokens": 4},
            )
        assert remote.status_code == 200, remote.text
        _check_metrics([n["metrics_export_port"] for n in state["nodes"]], model["id"])
        _check_trace(Path(state["root_dir"]), remote.json()["id"], model["id"])

        status = pdserve("status", "--state-dir", str(state_dir), timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        rows = [line.split() for line in status.stdout.splitlines()]
        placed = {(r[0], r[2], r[3]) for r in rows if len(r) >= 4 and r[0].endswith("Server")}
        assert ("PrefillServer", "RUNNING", "prefill") in placed
        assert ("DecodeServer", "RUNNING", "decode") in placed
        # LOAD comes from the replicas' pdserve gauges on the node metrics endpoints.
        (decode_row,) = [
            line for line in status.stdout.splitlines() if "DecodeServer " in line[:15]
        ]
        assert re.search(r"\d+ running, \d+ waiting, kv \d+%$", decode_row), status.stdout

        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=90) == 0, run.output()
    finally:
        if run.kill():
            pdserve("down", "--state-dir", str(state_dir), timeout=120)
    assert [pid for pid in members if is_running(pid)] == []
    assert not (state_dir / "cluster.json").exists()
    assert not Path(state["root_dir"]).exists()


def _check_metrics(ports: list[int], model: str, timeout_s: float = 60.0) -> None:
    """After the requests, every node's endpoint together carries pdserve's series with
    values (Ray's agent exports every few seconds: poll, bounded)."""
    wanted = {
        "ray_pdserve_time_to_first_token_seconds_count": {"role": "decode"},
        "ray_pdserve_e2e_request_latency_seconds_count": {"role": "ingress"},
        "ray_pdserve_prompt_tokens_total": {"role": "prefill"},
        "ray_pdserve_generation_tokens_total": {"role": "decode"},
        "ray_pdserve_kv_transfer_bytes_total": {"role": "decode"},
        "ray_pdserve_disagg_decisions_total": {"decision": "remote"},
    }
    last: dict[str, object] = {}

    def every_series_has_values() -> bool:
        samples = node_samples("127.0.0.2", ports)
        missing = [
            name
            for name, labels in wanted.items()
            if not any(
                s.name == name and s.value > 0 and labels.items() <= s.labels.items()
                for s in samples
            )
        ]
        last.update(samples=samples, missing=missing)
        return not missing

    try:
        wait_until(every_series_has_values, timeout_s, interval=2.0, what="pdserve's series")
    except TimeoutError as e:
        raise AssertionError(f"no values for {last['missing']} on ports {ports}") from e
    samples = last["samples"]
    ttft = [s for s in samples if s.name == "ray_pdserve_time_to_first_token_seconds_count"]
    assert {s.labels["model_name"] for s in ttft} == {model}
    assert {"decode", "ingress"} <= {s.labels["role"] for s in ttft}
    assert all(s.labels["replica"] for s in ttft if s.labels["role"] == "decode")


def _check_trace(root_dir: Path, response_id: str, model: str, timeout_s: float = 20.0) -> None:
    """The console exporter's spans, read from the replicas' log files: the request's
    trace spans the ingress, decode and prefill processes and the KV transfer."""
    needed = {f"{ROOT_OPERATION} {model}"} | {f"pdserve.{stage}" for stage in STAGES}
    found: dict[str, object] = {}

    def one_whole_trace() -> bool:
        traces = spans_by_trace(root_dir)
        roots = [
            t
            for t in traces.values()
            if any(s.attributes.get("pdserve.request_id") == response_id for s in t)
        ]
        names = {s.name for t in roots for s in t}
        found.update(roots=roots, names=names)
        return len(roots) == 1 and needed <= names

    try:
        wait_until(one_whole_trace, timeout_s, interval=1.0, what=f"the trace of {response_id}")
    except TimeoutError as e:
        raise AssertionError(
            f"trace of {response_id}: {len(found['roots'])}, {found['names']}"  # type: ignore[arg-type]
        ) from e
    roots = found["roots"]
    (spans,) = roots
    by_name = {s.name.removesuffix(f" {model}").removeprefix("pdserve."): s for s in spans}
    files = {by_name[n].source for n in ("text_completion", "decode", "prefill")}
    assert len(files) == 3, files  # three processes, one trace id
    # One tree: a single root (the HTTP server span when FastAPI is instrumented, else the
    # ingress's own span), every other span's parent inside the same trace.
    ids = {s.span_id for s in spans}
    assert len([s for s in spans if s.parent_id is None]) == 1
    assert all(s.parent_id in ids for s in spans if s.parent_id is not None)
    assert by_name["decode"].parent_id == by_name["text_completion"].span_id
    prefill = by_name["prefill"]
    assert prefill.parent_id == by_name["prefill_remote"].span_id
    # The KV listener binds the replica's Ray node address, not 127.0.0.1 or a wildcard.
    assert prefill.attributes["pdserve.kv_target.address"].startswith("127.0.0.2:")
    assert by_name["kv_transfer"].attributes["pdserve.kv_transfer.bytes"] > 0
    # Token usage is counted once: on the root span only.
    counted = [s.name for s in spans if "gen_ai.usage.input_tokens" in s.attributes]
    assert counted == [f"{ROOT_OPERATION} {model}"], counted
