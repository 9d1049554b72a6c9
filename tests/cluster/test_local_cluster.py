"""`pdserve up` starts three real Ray nodes on 127.0.0.2 with their pool labels; `status`
reports them; `down` leaves no process behind and removes the temp dirs."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster.procs import is_running, session_members
from tests.support.cli import pdserve

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

LIST_NODES = """
import dataclasses, json
from ray.util.state import list_nodes
print(json.dumps([dataclasses.asdict(n) for n in list_nodes(detail=True)]))
"""


def ray_state_nodes(state_dir: Path) -> list[dict]:
    """Ray's state API, queried by a separate client set up with `pdserve env`."""
    env_lines = pdserve("env", "--state-dir", str(state_dir)).stdout.splitlines()
    env = dict(os.environ)
    for line in env_lines:
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = shlex.split(value)[0]
    out = subprocess.run(
        [sys.executable, "-c", LIST_NODES], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def _check_cpu_pinning(state: dict, members: list[int]) -> None:
    """With 2+ CPUs the decode engine gets the last CPU and every process of the cluster
    starts on the others; the decode node passes its reservation to its workers."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    by_name = {n["name"]: n for n in state["nodes"]}
    if len(cpus) < 2:
        assert all(not n["cpus"] and not n["engine_cpus"] for n in state["nodes"])
        return
    shared = set(cpus[:-1])
    assert by_name["decode"]["engine_cpus"] == [cpus[-1]]
    assert all(set(n["cpus"]) == shared for n in state["nodes"])
    for pid in members:
        try:
            assert os.sched_getaffinity(pid) == shared, pid
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (ProcessLookupError, FileNotFoundError):
            continue  # ended meanwhile
        reservation = [v for v in environ if v.startswith(b"PDSERVE_ENGINE_CPUS=")]
        assert reservation in ([], [f"PDSERVE_ENGINE_CPUS={cpus[-1]}".encode()])


def test_up_status_down(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    up = pdserve("up", "--state-dir", str(state_dir), "--prefill-cpus", "1", "--decode-cpus", "1")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((state_dir / "cluster.json").read_text())
        assert (Path(state["auth_token_path"]).stat().st_mode & 0o777) == 0o600
        leaders = [n["pid"] for n in state["nodes"]]
        assert [n["name"] for n in state["nodes"]] == ["head", "prefill", "decode"]
        assert state["gcs_address"].startswith("127.0.0.2:")
        members = session_members(leaders)
        assert set(leaders) <= set(members)
        assert len(members) > len(leaders)  # gcs, raylets, agents... live in the sessions
        _check_cpu_pinning(state, members)

        nodes = [n for n in ray_state_nodes(state_dir) if n["state"] == "ALIVE"]
        assert len(nodes) == 3
        assert {n["node_ip"] for n in nodes} == {"127.0.0.2"}
        by_pool = {n["labels"].get("pdserve.io/pool"): n for n in nodes}
        assert set(by_pool) == {None, "prefill", "decode"}
        assert by_pool[None]["is_head_node"]
        assert by_pool[None]["resources_total"].get("CPU", 0.0) == 0.0
        assert by_pool["prefill"]["resources_total"]["CPU"] == 1.0
        assert by_pool["decode"]["resources_total"]["CPU"] == 1.0

        status = pdserve("status", "--state-dir", str(state_dir), timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        lines = status.stdout.splitlines()
        node_rows = lines[lines.index("nodes") + 2 : lines.index("pools")]
        assert len(node_rows) == 3
        for name, label in (
            ("prefill", "pdserve.io/pool=prefill"),
            ("decode", "pdserve.io/pool=decode"),
        ):
            (row,) = [line for line in node_rows if line.split()[0] == name]
            assert "running" in row and "ALIVE" in row and label in row and "0/1" in row
            if name == "decode" and len(os.sched_getaffinity(0)) >= 2:
                assert f"engine {max(os.sched_getaffinity(0))}," in row
        assert "not deployed" in status.stdout

        again = pdserve("up", "--state-dir", str(state_dir), timeout=60)
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        down = pdserve("down", "--state-dir", str(state_dir), timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert [pid for pid in members if is_running(pid)] == []
    assert session_members(leaders) == []
    assert not Path(state["root_dir"]).exists()
    assert not (state_dir / "cluster.json").exists()
    assert not Path(state["auth_token_path"]).exists()
    assert "nothing to stop" in pdserve("down", "--state-dir", str(state_dir)).stdout
