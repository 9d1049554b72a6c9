"""`pdserve run` stopped the way systemd, Docker, Kubernetes and ``make`` stop things: SIGTERM
to its whole process group, more than once. It exits 0 without a traceback, every process
it started (its own children, the nodes' raylets, GCS, agents and workers) is gone, and a
later `pdserve down` has nothing left to do."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from pdserve.cluster.procs import session_members
from tests.support import wait_until
from tests.support.cli import PdserveRun, pdserve

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(420)]
CONFIG = """
model:
  test_model: tiny
grpc:
  enabled: false
decode:
  engine:
    max_num_seqs: 4
"""


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in ticks): tells a pid from its reuse."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _snapshot(pids: set[int]) -> dict[int, str]:
    return {pid: start for pid in pids if (start := _start_time(pid)) is not None}


def _still_running(snapshot: dict[int, str]) -> list[int]:
    return sorted(pid for pid, start in snapshot.items() if _start_time(pid) == start)


def _keep_signalling(proc: subprocess.Popen[str], every_s: float = 0.02) -> None:
    signals = (signal.SIGINT, signal.SIGTERM)
    sent = 0
    while proc.poll() is None:
        try:
            os.killpg(proc.pid, signals[sent % 2])
        except ProcessLookupError:
            return
        sent += 1
        threading.Event().wait(every_s)  # pacing, not synchronisation


def _recorded_nodes(state_dir: Path, count: int, timeout: float = 60) -> dict:
    """The state file once ``count`` nodes are recorded (their processes have been forked)."""

    def recorded() -> dict | None:
        state = json.loads((state_dir / "cluster.json").read_text())
        return state if len(state["nodes"]) >= count else None

    return wait_until(recorded, timeout, interval=0.05, what=f"{count} nodes in cluster.json")


@pytest.mark.parametrize(
    "stop_at",
    [
        pytest.param("starting pool nodes", id="while-starting"),
        pytest.param("serving; Ctrl-C", id="while-serving"),
    ],
)
def test_group_sigterm_twice_stops_everything(tmp_path: Path, stop_at: str) -> None:
    config = tmp_path / "app.yaml"
    config.write_text(CONFIG)
    state_dir = tmp_path / "state"
    run = PdserveRun(config, state_dir, "--no-dashboard", new_session=True)
    proc = run.proc
    started: dict[int, str] = {}
    try:
        run.wait_for(re.escape(stop_at), 360)
        state = _recorded_nodes(state_dir, 3)
        leaders = [node["pid"] for node in state["nodes"]]
        started = _snapshot(_descendants(proc.pid) | set(session_members(leaders)))
        assert len(started) >= len(leaders) > 0
        # What `make` under `docker stop` / `systemctl stop` delivers: the group's SIGTERM
        # and the one make forwards, back to back; then more while the clean-up runs.
        os.killpg(proc.pid, signal.SIGTERM)
        os.killpg(proc.pid, signal.SIGTERM)
        # Then, once the stop has begun, an impatient operator: SIGINT and SIGTERM over and
        # over until it has exited. (Pending signals are handled lowest number first, so a
        # SIGINT sent before the SIGTERMs were handled would be the one reported.)
        run.wait_for("pdserve: stopping", 60)
        repeater = threading.Thread(target=_keep_signalling, args=(proc,), daemon=True)
        repeater.start()
        status = proc.wait(timeout=120)
        repeater.join()
        run.drain()
    finally:
        if run.kill():
            pdserve("down", "--state-dir", str(state_dir), timeout=180)
    output = run.output()
    assert status == 0, output
    assert "Traceback" not in output, output
    assert "pdserve: stopping (SIGTERM)" in output, output
    assert _still_running(started) == [], output
    assert not (state_dir / "cluster.json").exists()
    assert not Path(state["root_dir"]).exists()
    down = pdserve("down", "--state-dir", str(state_dir), timeout=180)
    assert down.returncode == 0 and "nothing to stop" in down.stdout, down.stdout + down.stderr
