"""The servers ``pdserve.bench.compare_serving`` measures, each started and stopped by this process.

``PdserveServer`` brings up a local pdserve cluster of its own (``pdserve up`` with a state
directory that only it uses, then ``pdserve serve CONFIG``) and takes it down with
``pdserve down``, which stops exactly the recorded pids. ``VLLMServer`` runs vLLM's OpenAI
server from another Python (its own venv) in a new session and stops it by pid, then its
process group. Neither ever signals a process by name.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from pdserve.cluster.ports import free_port
from pdserve.kernels.cpu.cpus import current_thread_cpus

HOST = "127.0.0.1"


class ServerError(RuntimeError):
    """A server did not come up (the message carries the tail of its log)."""


class Server(Protocol):
    """A server the comparison can start, measure and stop."""

    name: str

    def root_pids(self) -> list[int]:
        """The processes whose trees make up the running server (for CPU accounting)."""
        ...

    def start(self, timeout_s: float) -> str:
        """Start and wait until ``/v1/models`` answers; return the base URL (no ``/v1``)."""
        ...

    def stop(self) -> None:
        """Stop everything ``start`` started (idempotent)."""
        ...

    def engine_cpus(self) -> set[int]:
        """CPUs the running server binds its engine threads to (empty: none)."""
        ...


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: str) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or not Linux
        return None
    return raw[raw.rfind(")") + 2 :].split()  # fields after "pid (comm) "


def _process_table() -> tuple[dict[int, list[int]], dict[int, float]]:
    """Children of every live process and its user + system CPU seconds."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit() or (fields := _stat_fields(entry.name)) is None:
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1] = ppid
        cpu[pid] = (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime
    return children, cpu


def _tree(roots: list[int], children: dict[int, list[int]]) -> set[int]:
    todo, seen = list(roots), set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, []))
    return seen


def tree_cpu_seconds(roots: list[int]) -> float:
    """User + system CPU seconds of the live processes in the trees under ``roots``."""
    children, cpu = _process_table()
    return sum(cpu.get(pid, 0.0) for pid in _tree(roots, children))


def pinned_thread_cpus(roots: list[int]) -> set[int]:
    """CPUs that threads of the trees under ``roots`` are pinned to (threads whose affinity
    is narrower than the machine's): where a server binds its compute threads."""
    everything = set(current_thread_cpus())
    children, _ = _process_table()
    pinned: set[int] = set()
    for pid in _tree(roots, children):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                allowed = os.sched_getaffinity(int(task.name))
            except (OSError, ValueError):
                continue
            if allowed < everything:
                pinned |= allowed
    return pinned


def pin_this_process(cpus: set[int]) -> Callable[[], None]:
    """Move every thread of this process (the load generator) to ``cpus``; returns a
    function that moves them back. A no-op where affinity is unsupported or ``cpus`` empty."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return lambda: None
    before: dict[int, set[int]] = {}
    for task in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            tid = int(task.name)
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)

    def restore() -> None:
        for tid, allowed in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, allowed)

    return restore


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores; from /proc/stat), 0 if unknown."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    ticks = [int(v) for v in first[:8]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / _CLK_TCK


def _log_tail(path: Path, lines: int = 30) -> str:
    if not path.is_file():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_for_models(
    base_url: str, deadline: float, alive: Callable[[], bool] | None = None
) -> None:
    """Poll ``GET /v1/models`` until it answers 200; raise TimeoutError past ``deadline``."""
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise ServerError("the server process exited while starting")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{base_url}/v1/models did not answer in time")


@dataclass
class PdserveServer:
    """pdserve on a local cluster of its own (``python -m pdserve.cluster.cli``)."""

    name: str
    config: Path
    state_dir: Path
    log_path: Path
    up_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # e.g. RAY_worker_niceness for `up`
    python: str = sys.executable
    dashboard: bool = False  # Ray's state API (replica pids) needs it; it costs a process
    _started: bool = False

    def _cli(self, *args: str, timeout_s: float) -> None:
        cmd = [self.python, "-m", "pdserve.cluster.cli", *args, "--state-dir", str(self.state_dir)]
        with self.log_path.open("a") as log:
            log.write(f"$ {' '.join(f'{k}={v}' for k, v in self.env.items())} {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
                env={**os.environ, **self.env},
            )
        if proc.returncode != 0:
            raise ServerError(
                f"{self.name}: `{shlex.join(cmd[1:])}` exited {proc.returncode}\n"
                + _log_tail(self.log_path)
            )

    def start(self, timeout_s: float) -> str:
        from pdserve.cluster.state import load_state

        deadline = time.monotonic() + timeout_s
        self._started = True
        no_dashboard = [] if self.dashboard else ["--no-dashboard"]
        self._cli("up", *no_dashboard, *self.up_args, timeout_s=timeout_s)
        remaining = max(1.0, deadline - time.monotonic())
        self._cli(
            "serve", str(self.config), "--deploy-timeout", str(remaining), timeout_s=remaining + 30
        )
        state = load_state(self.state_dir)
        if state is None or state.serve is None:
            raise ServerError(f"{self.name}: no serve record in {self.state_dir}")
        url = state.serve.http_url
        wait_for_models(url, deadline)
        return url

    def root_pids(self) -> list[int]:
        from pdserve.cluster.state import load_state

        state = load_state(self.state_dir)
        return [] if state is None else [node.pid for node in state.nodes]

    def engine_cpus(self) -> set[int]:
        from pdserve.cluster.state import load_state

        state = load_state(self.state_dir)
        return set() if state is None else {c for node in state.nodes for c in node.engine_cpus}

    def stop(self) -> None:
        if self._started:
            self._started = False
            self._cli("down", timeout_s=120)


@dataclass
class VLLMServer:
    """vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``) from its own venv."""

    name: str
    python: str
    model_dir: str
    log_path: Path
    served_model_name: str
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    _proc: subprocess.Popen[bytes] | None = None

    def command(self, port: int) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            self.served_model_name,
            "--host",
            HOST,
            "--port",
            str(port),
            *self.extra_args,
        ]

    def start(self, timeout_s: float) -> str:
        port = free_port(HOST)
        cmd = self.command(port)
        env = {**os.environ, **self.env}
        with self.log_path.open("a") as log:
            log.write(f"$ {' '.join(f'{k}={v}' for k, v in self.env.items())} {shlex.join(cmd)}\n")
            log.flush()
            # A new session: vLLM forks an engine-core process; the group lets stop() end it
            # too if the server itself does not.
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        url = f"http://{HOST}:{port}"
        proc = self._proc
        try:
            wait_for_models(url, time.monotonic() + timeout_s, alive=lambda: proc.poll() is None)
        except (TimeoutError, ServerError) as err:
            self.stop()
            raise ServerError(f"{self.name}: {err}\n{_log_tail(self.log_path)}") from None
        return url

    def root_pids(self) -> list[int]:
        return [] if self._proc is None else [self._proc.pid]

    def engine_cpus(self) -> set[int]:
        # vLLM's CPU backend pins its OpenMP threads (VLLM_CPU_OMP_THREADS_BIND=auto).
        return pinned_thread_cpus(self.root_pids())

    def stop(self, grace_s: float = 20.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        # Leftovers of the group this process led (its engine core).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
