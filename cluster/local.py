"""Start and stop a local multi-node Ray cluster of real ``ray start`` processes on loopback.

Each node (head, prefill pool, decode pool; see ``pdserve.cluster.topology``) is one
``ray start --block`` process in its own session, with its own ``--temp-dir``, OS-chosen
ports, a capped object store, its ``--labels`` and, when the CPUs are pinned, the shared
CPUs as its affinity and its engine CPUs in ``$PDSERVE_ENGINE_CPUS``. The pids, addresses
and temp dirs go into the state file (``pdserve.cluster.state``) so a later command can find and
stop exactly these processes. This module never runs ``ray stop`` and never signals a
process by name.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster.ports import PortAllocator
from pdserve.cluster.procs import is_running, stop_sessions
from pdserve.cluster.state import (
    ClusterState,
    NodeRecord,
    clear_state,
    load_state,
    save_state,
    write_token,
)
from pdserve.cluster.topology import ClusterSpec, NodeSpec, format_labels
from pdserve.kernels.cpu.cpus import ENGINE_CPUS_ENV, format_cpu_list

READY_MARKER = "Ray runtime started"
TOKEN_FILE = "auth_token"
START_ATTEMPTS = 2
Progress = Callable[[str], None]


class ClusterError(RuntimeError):
    """The local cluster could not be started or is not in the expected state."""


@dataclass(frozen=True)
class StopReport:
    """What ``stop_cluster`` did: the nodes it stopped and any pid that would not die."""

    stopped: list[str]
    survivors: list[int]


# Serve's direct ingress (``ClusterSpec.direct_ingress``). Ray holds a draining ingress
# replica open MIN_DRAINING_PERIOD_S so that a load balancer can deregister it; a local
# cluster has no load balancer in front (clients hold the replica's URL), so one second is
# enough. Not Ray's whole throughput-optimized preset (RAY_SERVE_THROUGHPUT_OPTIMIZED): why
# in docs/decisions.md, decision 5.
DIRECT_INGRESS_ENV = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
}


def _node_env(token_path: Path, node: NodeSpec, direct_ingress: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_AUTH_TOKEN", None)  # would take precedence over the cluster's token file
    env.pop(ENGINE_CPUS_ENV, None)  # only this node's reservation counts
    if node.gpu_ids is not None:  # the node's share of the machine's GPUs
        env["CUDA_VISIBLE_DEVICES"] = ",".join(node.gpu_ids)
    if node.engine_cpus:
        env[ENGINE_CPUS_ENV] = format_cpu_list(node.engine_cpus)
    env.update(
        {
            # Explicit, so a stray ~/.ray/auth_token cannot switch auth on for some nodes only.
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token_path),
            "PYTHONUNBUFFERED": "1",  # the readiness line must reach the log file at once
            "RAY_USAGE_STATS_ENABLED": "0",
            # Draining on SIGTERM exists for rolling upgrades behind a load balancer; `down`
            # takes the whole cluster away, so it would only add seconds.
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            # Ray renices its workers to 15 by default; the engine replicas are the service
            # here and must not yield their cores to whatever else runs on the machine.
            "RAY_worker_niceness": "0",
            # Fresher load in `pdserve status` (Ray's default export interval is 10 s).
            "RAY_metrics_report_interval_ms": "2000",
        }
    )
    for name in DIRECT_INGRESS_ENV:
        env.pop(name, None)  # the spec decides, not the caller's environment
    env.update(serve_env(direct_ingress))
    return env


def serve_env(direct_ingress: bool) -> dict[str, str]:
    """Serve's settings in the environment of every Ray process: pdserve's ``EdgeGate`` on
    Serve's HTTP servers (its proxies, a direct-ingress ingress replica:
    ``deployments/door_gate.py``), and ``DIRECT_INGRESS_ENV`` when asked."""
    from pdserve.deployments.door_gate import EDGE_CALLBACK

    env = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": EDGE_CALLBACK}
    if direct_ingress:
        env.update(DIRECT_INGRESS_ENV)
    return env


@dataclass(frozen=True)
class _HeadPorts:
    """Ports fixed before the head starts: the pool nodes and the CLI need them up front."""

    gcs: int
    client: int
    dashboard: int

    @classmethod
    def pick(cls, ports: PortAllocator) -> _HeadPorts:
        return cls(gcs=ports.take(), client=ports.take(), dashboard=ports.take())


def _ray_start_command(
    node: NodeSpec,
    spec: ClusterSpec,
    temp_dir: Path,
    ports: _HeadPorts,
    metrics_port: int,
    agent_port: int,
) -> list[str]:
    """``ray start --block`` arguments for one node."""
    ip = spec.node_ip
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        "--disable-usage-stats",
        f"--node-ip-address={ip}",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={node.num_cpus}",
        f"--num-gpus={node.num_gpus}",
        f"--object-store-memory={node.object_store_bytes}",
        # 0 = the OS picks: several raylets share one address, fixed defaults would collide.
        "--node-manager-port=0",
        "--object-manager-port=0",
        "--min-worker-port=0",
        "--max-worker-port=0",
        f"--metrics-export-port={metrics_port}",
        f"--dashboard-agent-listen-port={agent_port}",
    ]
    if node.labels:
        cmd.append(f"--labels={format_labels(node.labels)}")
    if node.role != "head":
        return [*cmd, f"--address={ip}:{ports.gcs}"]
    cmd += [
        "--head",
        f"--port={ports.gcs}",
        f"--ray-client-server-port={ports.client}",
        f"--include-dashboard={'true' if spec.dashboard else 'false'}",
    ]
    if spec.dashboard:
        cmd += [f"--dashboard-host={ip}", f"--dashboard-port={ports.dashboard}"]
    return cmd


def _affinity_setter(cpus: tuple[int, ...]) -> Callable[[], None] | None:
    """A ``preexec_fn`` that moves the child to ``cpus`` (None when unrestricted)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _wait_ready(records: list[NodeRecord], timeout_s: float) -> list[NodeRecord]:
    """Block until each node's ``ray start`` says the runtime started or exited.

    Returns the nodes that exited; raises when one neither started nor exited in time.
    """
    pending = {r.name: r for r in records}
    exited = []
    deadline = time.monotonic() + timeout_s
    while pending:
        for name, record in list(pending.items()):
            log = Path(record.log_file)
            if log.is_file() and READY_MARKER in log.read_text(errors="replace"):
                del pending[name]
            elif not is_running(record.pid):
                exited.append(pending.pop(name))
        if pending and time.monotonic() >= deadline:
            logs = ", ".join(r.log_file for r in pending.values())
            raise ClusterError(f"node(s) not up after {timeout_s:.0f} s; see {logs}")
        if pending:
            time.sleep(0.2)
    return exited


def _short_root() -> Path:
    """Node temp dirs hold Unix sockets, whose paths must stay under ~107 bytes."""
    base = "/tmp" if os.path.isdir("/tmp") else None
    return Path(tempfile.mkdtemp(prefix="pds-", dir=base))


def running_nodes(state: ClusterState) -> list[NodeRecord]:
    return [r for r in state.nodes if is_running(r.pid)]


class _Launcher:
    """Starts the nodes of one cluster and keeps its record current in the state file, so
    ``down`` can clean up even after a start that hung or failed half-way."""

    def __init__(self, spec: ClusterSpec, state_dir: Path, progress: Progress) -> None:
        self.spec = spec
        self.state_dir = state_dir
        self.progress = progress
        self.root = _short_root()
        self.allocator = PortAllocator(spec.node_ip)
        self.ports = _HeadPorts.pick(self.allocator)
        self.token_path = state_dir / TOKEN_FILE
        write_token(self.token_path, secrets.token_hex(32))
        self.records: list[NodeRecord] = []

    def snapshot(self) -> ClusterState:
        ip = self.spec.node_ip
        return ClusterState(
            node_ip=ip,
            gcs_address=f"{ip}:{self.ports.gcs}",
            dashboard_url=f"http://{ip}:{self.ports.dashboard}" if self.spec.dashboard else None,
            root_dir=str(self.root),
            auth_token_path=str(self.token_path),
            nodes=list(self.records),
            direct_ingress=self.spec.direct_ingress,
        )

    def launch(self, node: NodeSpec) -> NodeRecord:
        temp_dir = self.root / node.name
        temp_dir.mkdir(parents=True, exist_ok=True)
        log_file = self.state_dir / "logs" / f"{node.name}.log"
        log_file.parent.mkdir(parents=True, exist_ok=True)
        metrics_port, agent_port = self.allocator.take(), self.allocator.take()
        cmd = _ray_start_command(node, self.spec, temp_dir, self.ports, metrics_port, agent_port)
        with log_file.open("wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_node_env(self.token_path, node, self.spec.direct_ingress),
                start_new_session=True,  # the session id later finds every process of the node
                preexec_fn=_affinity_setter(node.cpus),  # inherited by all the node's processes
            )
        record = NodeRecord(
            name=node.name,
            role=node.role,
            pid=proc.pid,
            temp_dir=str(temp_dir),
            log_file=str(log_file),
            labels=node.labels,
            num_cpus=node.num_cpus,
            metrics_export_port=metrics_port,
            cpus=list(node.cpus),
            engine_cpus=list(node.engine_cpus),
        )
        self.records.append(record)
        save_state(self.state_dir, self.snapshot())
        return record

    def start(self, nodes: list[NodeSpec], timeout_s: float) -> None:
        """Launch ``nodes`` together and wait for them; relaunch a node that exits while
        starting (on a loaded machine a raylet can miss Ray's fixed 30 s registration)."""
        by_name = {node.name: node for node in nodes}
        batch = [self.launch(node) for node in nodes]
        for attempt in range(1, START_ATTEMPTS + 1):
            failed = _wait_ready(batch, timeout_s)
            if not failed:
                return
            log = Path(failed[0].log_file)
            if attempt == START_ATTEMPTS:
                raise ClusterError(
                    f"node {failed[0].name!r} exited while starting; last lines of {log}:\n"
                    f"{_log_tail(log)}"
                )
            for record in failed:
                tail = _log_tail(Path(record.log_file), 1)
                self.progress(f"node {record.name} exited while starting ({tail}); retrying")
                stop_sessions([record.pid], grace_s=5.0)
                self.records.remove(record)
            batch = [self.launch(by_name[record.name]) for record in failed]


def start_cluster(
    spec: ClusterSpec,
    state_dir: Path,
    *,
    timeout_s: float = 90.0,
    progress: Progress = lambda _msg: None,
) -> ClusterState:
    """Start the head, then both pool nodes together; record them; return the state."""
    previous = load_state(state_dir)
    if previous is not None:
        if running_nodes(previous):
            raise ClusterError(
                f"a cluster from {state_dir} is already running (head pid "
                f"{previous.nodes[0].pid}); run `pdserve down` first"
            )
        _remove_dirs(previous)  # stale record of a cluster that died: forget it
        clear_state(state_dir)

    launcher = _Launcher(spec, state_dir, progress)
    head, *pools = spec.nodes()
    started = time.monotonic()
    if (plan := spec.cpu_plan()) is not None:
        prefill = format_cpu_list(plan.prefill_engine_cpus) or "the shared CPUs"
        progress(
            f"CPUs: decode engines on {format_cpu_list(plan.decode_engine_cpus)}, prefill "
            f"engines on {prefill}, everything else on {format_cpu_list(plan.shared_cpus)}"
        )
    try:
        progress(f"starting head node on {launcher.snapshot().gcs_address}")
        launcher.start([head], timeout_s)
        progress(f"head up ({time.monotonic() - started:.1f} s); starting pool nodes")
        launcher.start(pools, timeout_s)
    except BaseException:
        stop_cluster(state_dir)
        raise
    progress(f"cluster up: {len(pools) + 1} nodes in {time.monotonic() - started:.1f} s")
    return launcher.snapshot()


def _remove_dirs(state: ClusterState) -> None:
    shutil.rmtree(state.root_dir, ignore_errors=True)
    Path(state.auth_token_path).unlink(missing_ok=True)


def stop_cluster(state_dir: Path, *, grace_s: float = 10.0) -> StopReport:
    """Stop every recorded node by pid (pool nodes first), remove temp dirs and the record."""
    state = load_state(state_dir)
    if state is None:
        return StopReport(stopped=[], survivors=[])
    workers = [r.pid for r in state.nodes if r.role != "head"]
    heads = [r.pid for r in state.nodes if r.role == "head"]
    survivors = stop_sessions(workers, grace_s) if workers else []
    survivors += stop_sessions(heads, grace_s) if heads else []
    if not survivors:
        _remove_dirs(state)
        clear_state(state_dir)
    return StopReport(stopped=[r.name for r in state.nodes], survivors=survivors)
