"""`pdserve run CONFIG` (what `make serve` calls): three nodes, the app deployed with prefill
and decode replicas on their labelled nodes, an OpenAI endpoint that answers, and SIGTERM
taking everything down again."""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from cluster.procs import is_running, session_members

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(480)]
REPO = Path(__file__).resolve().parents[2]
CONFIG = """
model:
  test_model: tiny
decode:
  engine:
    max_num_seqs: 8
grpc:
  enabled: true
"""


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    out: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line.rstrip("\n"))
        out.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _wait_for(lines: queue.Queue[str | None], pattern: str, log: list[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError("pdserve run exited early:\n" + "\n".join(log))
        log.append(line)
        if match := re.search(pattern, line):
            return match.group(1)
    raise AssertionError(f"no {pattern!r} after {timeout} s:\n" + "\n".join(log))


def test_run_serves_until_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "app.yaml"
    config.write_text(CONFIG)
    state_dir = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "run", str(config), "--state-dir", str(state_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    try:
        lines = _lines(proc)
        base = _wait_for(lines, r"OpenAI API\s+(http://127\.0\.0\.2:\d+)/v1", log, 400)
        grpc_port = int(_wait_for(lines, r"gRPC\s+127\.0\.0\.2:(\d+)", log, 10))
        _wait_for(lines, r"(serving); Ctrl-C", log, 30)
        state = json.loads((state_dir / "cluster.json").read_text())
        leaders = [n["pid"] for n in state["nodes"]]
        members = session_members(leaders)

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

        status = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "status", "--state-dir", str(state_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        rows = [line.split() for line in status.stdout.splitlines()]
        placed = {(r[0], r[2], r[3]) for r in rows if len(r) >= 4 and r[0].endswith("Server")}
        assert ("PrefillServer", "RUNNING", "prefill") in placed
        assert ("DecodeServer", "RUNNING", "decode") in placed

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, "\n".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(
                [sys.executable, "-m", "cluster.cli", "down", "--state-dir", str(state_dir)],
                cwd=REPO,
                timeout=120,
            )
    assert [pid for pid in members if is_running(pid)] == []
    assert not (state_dir / "cluster.json").exists()
    assert not Path(state["root_dir"]).exists()
