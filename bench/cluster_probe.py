"""What the reliability benches read from a running local cluster, from the outside.

Replica processes come from Ray's state API (``ray.util.state.list_actors``: Serve replica
actors, alive, with their pid), Serve's view of each pool from the dashboard's REST API,
pdserve's counters and KV gauges from every node's Prometheus endpoint, and a process's
RSS and open file descriptors from psutil. This module never changes the cluster; the
caller has set Ray's client environment (``pdserve.cluster.state.ray_client_env``).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from pdserve.cluster.metrics_scrape import node_metric_families
from pdserve.cluster.state import ClusterState, auth_header
from pdserve.deployments.metrics import PREFIX, exported_name

Pool = Literal["prefill", "decode", "ingress"]
# pdserve.deployments.app's deployment names, written out: importing it imports Ray, which
# must not happen before the caller has set the cluster's client environment.
DEPLOYMENTS: dict[Pool, str] = {
    "prefill": "PrefillServer",
    "decode": "DecodeServer",
    "ingress": "OpenAIIngress",
}
MIGRATIONS = exported_name(PREFIX + "request_migrations", "counter")
KV_USAGE = exported_name(PREFIX + "kv_cache_usage_perc", "gauge")
HTTP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ReplicaProcess:
    """One alive Serve replica actor of a pool and its process."""

    pool: Pool
    name: str  # the actor's name (Serve's replica actor name)
    pid: int


def replica_processes(state: ClusterState) -> list[ReplicaProcess]:
    """Every alive replica actor of the prefill, decode and ingress deployments."""
    from ray.util.state import list_actors

    actors = list_actors(
        address=state.dashboard_url,
        filters=[("state", "=", "ALIVE")],
        detail=True,
        limit=1000,
        raise_on_missing_output=False,
    )
    out = []
    for actor in actors:
        for pool, deployment in DEPLOYMENTS.items():
            # Serve names a replica actor's class "ServeReplica:<app>:<deployment>".
            if (actor.class_name or "").endswith(f":{deployment}") and actor.pid:
                out.append(ReplicaProcess(pool, actor.name or actor.actor_id, int(actor.pid)))
    return out


@dataclass(frozen=True)
class RunningReplica:
    replica_id: str  # Serve's id; the ``replica`` label of pdserve's metrics contains it
    pid: int


def running_replicas(state: ClusterState) -> dict[str, list[RunningReplica]]:
    """Serve's RUNNING replicas of each deployment of the app (dashboard REST API)."""
    url = f"{state.dashboard_url}/api/serve/applications/"
    request = urllib.request.Request(url, headers=auth_header(state))
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
        details = json.loads(resp.read())
    app_name = state.serve.app_name if state.serve is not None else ""
    app = (details.get("applications") or {}).get(app_name) or {}
    out: dict[str, list[RunningReplica]] = {}
    for name, dep in (app.get("deployments") or {}).items():
        out[name] = [
            RunningReplica(str(r["replica_id"]), int(r["pid"]))
            for r in dep.get("replicas") or []
            if r.get("state") == "RUNNING" and r.get("pid")
        ]
    return out


def scrape(state: ClusterState, names: set[str]) -> list[tuple[str, dict[str, str], float]]:
    """Samples (name, labels, value) of the metric families ``names`` on every node."""
    ports = [node.metrics_export_port for node in state.nodes]
    return [
        (sample.name, dict(sample.labels), float(sample.value))
        for family in node_metric_families(state.node_ip, ports, HTTP_TIMEOUT_S)
        for sample in family.samples
        if sample.name in names
    ]


def migrations_by_cause(state: ClusterState) -> dict[str, float]:
    """The ingress's ``pdserve_request_migrations`` counter summed by cause."""
    total: dict[str, float] = defaultdict(float)
    for _, labels, value in scrape(state, {MIGRATIONS}):
        total[labels.get("cause", "?")] += value
    return dict(total)


def kv_usage_by_replica(state: ClusterState, replica_ids: list[str]) -> dict[str, float]:
    """The last exported KV usage (0..1) of each of ``replica_ids`` that has one (a dead
    replica's series may linger on its node's endpoint: only the ones asked for count)."""
    out = {}
    for _, labels, value in scrape(state, {KV_USAGE}):
        label = labels.get("replica", "")
        for replica_id in replica_ids:
            if label and (replica_id in label or label in replica_id):
                out[replica_id] = value
    return out


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    rss_bytes: int
    open_fds: int


def sample_process(pid: int) -> ProcessSample | None:
    """RSS and open file descriptors of ``pid`` (psutil when installed, else /proc); None
    when it is gone."""
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return _sample_proc(pid)
    try:
        proc = psutil.Process(pid)
        return ProcessSample(pid, proc.memory_info().rss, proc.num_fds())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _sample_proc(pid: int) -> ProcessSample | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss_pages = int(f.read().split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        return None
    return ProcessSample(pid, rss_pages * os.sysconf("SC_PAGE_SIZE"), fds)
