"""``pdserve status``: nodes, pools, replicas and load of the recorded local cluster.

Reads only: the state file, Ray's state API (through the dashboard), Serve's REST view of
its applications and each node's Prometheus metrics (pdserve's load gauges). No driver joins
the cluster, so status is quick and changes nothing.

A tensor-parallel replica owns a placement group of one bundle per rank, named like the
replica's actor: its bundle count is the replica's TP size (no group: TP 1), and its bundles
are what the replica reserves on its node (the rank actors inside ask for the group's
resources, not plain CPUs).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.cluster.metrics_scrape import node_metric_families
from pdserve.cluster.procs import is_running
from pdserve.cluster.state import ClusterState, NodeRecord, auth_header
from pdserve.deployments.config import POOL_LABEL_KEY
from pdserve.deployments.metrics import PREFIX, exported_name
from pdserve.kernels.cpu.cpus import format_cpu_list

if TYPE_CHECKING:  # Ray is imported only when status runs
    from ray.serve.schema import ApplicationDetails
    from ray.util.state.common import NodeState, PlacementGroupState

HTTP_TIMEOUT_S = 5.0
# Prometheus family of each pdserve load gauge -> its key in ReplicaStatus.load.
LOAD_GAUGES = {
    exported_name(PREFIX + "num_requests_running", "gauge"): "running",
    exported_name(PREFIX + "num_requests_waiting", "gauge"): "waiting",
    exported_name(PREFIX + "kv_cache_usage_perc", "gauge"): "kv",
}
DTYPES_GAUGE = exported_name(PREFIX + "engine_dtypes", "gauge")


@dataclass(frozen=True)
class NodeStatus:
    name: str
    pid: int
    process_running: bool
    ray_state: str  # ALIVE / DEAD from the GCS, "unknown" if the state API did not answer
    node_id: str
    labels: dict[str, str]
    cpus_total: float
    cpus_reserved: float  # by alive actors placed on the node
    cpu_pinning: str = "-"  # where the node's processes run (pinned clusters)


@dataclass(frozen=True)
class ReplicaStatus:
    deployment: str
    replica_id: str
    state: str
    node: str  # our node name (head/prefill/decode) or the Ray node id
    pid: int | None
    load: dict[str, float] = field(default_factory=dict)  # running / waiting / kv
    tp: int = 1  # ranks of its tensor-parallel group (bundles of its placement group)
    dtypes: str = "-"  # "<weights>/<kv cache>", e.g. "bfloat16/fp8_e4m3"


@dataclass(frozen=True)
class PlacementGroup:
    """What status needs of one placement group from Ray's state API."""

    name: str
    state: str  # CREATED / PENDING / RESCHEDULING / REMOVED
    bundles: list[tuple[str, float]]  # per bundle: Ray node id ("" = not placed), CPUs

    @classmethod
    def from_state(cls, pg: PlacementGroupState) -> PlacementGroup:
        return cls(
            name=pg.name,
            state=pg.state,
            bundles=[
                (b.get("node_id") or "", float((b.get("unit_resources") or {}).get("CPU", 0.0)))
                for b in pg.bundles or []
            ],
        )


def tp_by_actor(groups: list[PlacementGroup]) -> dict[str, int]:
    """TP size per replica actor name: Serve names a replica's placement group after the
    replica's actor, one bundle per rank."""
    return {g.name: len(g.bundles) for g in groups if g.name and g.state != "REMOVED"}


def reserved_by_groups(groups: list[PlacementGroup]) -> dict[str, float]:
    """CPUs the placed bundles of live placement groups hold, per Ray node id."""
    reserved: dict[str, float] = defaultdict(float)
    for group in groups:
        if group.state == "REMOVED":
            continue
        for node_id, cpus in group.bundles:
            if node_id:
                reserved[node_id] += cpus
    return reserved


@dataclass(frozen=True)
class ClusterStatus:
    state: ClusterState
    nodes: list[NodeStatus]
    replicas: list[ReplicaStatus]
    app_status: str | None  # RUNNING / DEPLOYING / ... ; None when no app is deployed
    app_message: str
    problems: list[str]


def _get_json(url: str, headers: dict[str, str]) -> object:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def _node_name(labels: dict[str, str], is_head: bool, fallback: str) -> str:
    if is_head:
        return "head"
    return labels.get(POOL_LABEL_KEY, fallback)


def scrape_load(records: list[NodeRecord], node_ip: str) -> dict[str, dict[str, float]]:
    """pdserve's load gauges per replica label, from every node's metrics endpoint; the
    engine dtypes gauge adds ``{"<weights>/<kv>": 1.0}`` to its replica's entry."""
    load: dict[str, dict[str, float]] = defaultdict(dict)
    ports = [record.metrics_export_port for record in records]
    for family in node_metric_families(node_ip, ports, HTTP_TIMEOUT_S):
        key = LOAD_GAUGES.get(family.name)
        if key is None and family.name != DTYPES_GAUGE:
            continue
        for sample in family.samples:
            replica = sample.labels.get("replica")
            if replica and key is not None:
                load[replica][key] = sample.value
            elif replica:
                w, kv = sample.labels.get("weight_dtype"), sample.labels.get("kv_cache_dtype")
                load[replica][f"{w}/{kv}"] = sample.value
    return load


def split_dtypes(load: dict[str, float]) -> tuple[dict[str, float], str]:
    """A replica's scraped entry as (its load gauges, its "<weights>/<kv>" or "-")."""
    gauges = {k: v for k, v in load.items() if "/" not in k}
    dtypes = [k for k in load if "/" in k]
    return gauges, dtypes[0] if dtypes else "-"


def replica_load(load: dict[str, dict[str, float]], replica_id: str) -> dict[str, float]:
    """Metrics carry Serve's replica tag, which may be the id or contain it."""
    if replica_id in load:
        return load[replica_id]
    return next((v for k, v in load.items() if replica_id in k or k in replica_id), {})


def _ray_nodes(
    state: ClusterState, problems: list[str]
) -> tuple[dict[str, NodeState], dict[str, float], list[PlacementGroup]]:
    """Alive Ray nodes by our node name, CPUs reserved per Ray node id (by alive actors
    outside placement groups and by placed bundles) and the placement groups."""
    if state.dashboard_url is None:
        problems.append("no dashboard: Ray's state API is unavailable")
        return {}, {}, []
    from ray.util.state import list_actors, list_nodes, list_placement_groups

    try:
        nodes = list_nodes(address=state.dashboard_url, detail=True, raise_on_missing_output=False)
        actors = list_actors(
            address=state.dashboard_url,
            filters=[("state", "=", "ALIVE")],
            detail=True,
            raise_on_missing_output=False,
        )
        groups = [
            PlacementGroup.from_state(pg)
            for pg in list_placement_groups(
                address=state.dashboard_url, detail=True, raise_on_missing_output=False
            )
        ]
    except Exception as err:  # the state API raises several kinds; status must still print
        problems.append(f"Ray state API at {state.dashboard_url} did not answer: {err}")
        return {}, {}, []
    # An actor in a placement group asks for the group's resources (CPU_group_...), not
    # CPU: its share is counted once, through the group's bundles.
    reserved = reserved_by_groups(groups)
    for actor in actors:
        if actor.node_id is None:  # not placed yet: holds no node's CPUs
            continue
        reserved[actor.node_id] += float((actor.required_resources or {}).get("CPU", 0.0))
    by_name = {
        _node_name(n.labels or {}, n.is_head_node, n.node_id[:8]): n
        for n in nodes
        if n.state == "ALIVE"
    }
    return by_name, reserved, groups


def _node_status(
    record: NodeRecord, node: NodeState | None, reserved: dict[str, float]
) -> NodeStatus:
    pinning = _cpu_pinning(record)
    if node is None:
        return NodeStatus(
            record.name,
            record.pid,
            is_running(record.pid),
            "unknown",
            "",
            record.labels,
            0.0,
            0.0,
            pinning,
        )
    return NodeStatus(
        name=record.name,
        pid=record.pid,
        process_running=is_running(record.pid),
        ray_state=node.state,
        node_id=node.node_id,
        labels={k: v for k, v in (node.labels or {}).items() if k != "ray.io/node-id"},
        cpus_total=float(node.resources_total.get("CPU", 0.0)),
        cpus_reserved=reserved.get(node.node_id, 0.0),
        cpu_pinning=pinning,
    )


def _cpu_pinning(record: NodeRecord) -> str:
    if record.engine_cpus:
        return f"engine {format_cpu_list(record.engine_cpus)}, rest {format_cpu_list(record.cpus)}"
    return f"all {format_cpu_list(record.cpus)}" if record.cpus else "-"


def _serve_app(state: ClusterState, problems: list[str]) -> ApplicationDetails | None:
    """Serve's view of the recorded application, from the dashboard's REST API."""
    if state.dashboard_url is None or state.serve is None:
        return None
    from ray.serve.schema import ServeInstanceDetails

    try:
        raw = _get_json(f"{state.dashboard_url}/api/serve/applications/", auth_header(state))
        details = ServeInstanceDetails.model_validate(raw)
    except (urllib.error.URLError, OSError, ValueError) as err:
        problems.append(f"Serve status did not answer: {err}")
        return None
    return details.applications.get(state.serve.app_name)


def collect_status(state: ClusterState) -> ClusterStatus:
    """Ask the cluster; what cannot be asked is listed in ``problems``, not raised.

    Ray's state API reads the cluster's token from the environment
    (``pdserve.cluster.state.ray_client_env``), which the CLI sets before Ray is imported.
    """
    problems: list[str] = []
    ray_nodes, reserved, groups = _ray_nodes(state, problems)
    tp = tp_by_actor(groups)
    nodes = [_node_status(r, ray_nodes.get(r.name), reserved) for r in state.nodes]
    app = _serve_app(state, problems)
    replicas: list[ReplicaStatus] = []
    if app is not None:
        id_to_name = {n.node_id: n.name for n in nodes if n.node_id}
        load = scrape_load(state.nodes, state.node_ip)
        for deployment, details in app.deployments.items():
            for rep in details.replicas:
                node_id = rep.node_id or "?"
                gauges, dtypes = split_dtypes(replica_load(load, rep.replica_id))
                replicas.append(
                    ReplicaStatus(
                        deployment=deployment,
                        replica_id=rep.replica_id,
                        state=str(rep.state.value),
                        node=id_to_name.get(node_id, node_id[:8]),
                        pid=rep.pid,
                        load=gauges,
                        tp=tp.get(rep.actor_name or "", 1),
                        dtypes=dtypes,
                    )
                )
    return ClusterStatus(
        state=state,
        nodes=nodes,
        replicas=replicas,
        app_status=str(app.status.value) if app is not None else None,
        app_message=app.message if app is not None else "",
        problems=problems,
    )


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _fmt_load(load: dict[str, float]) -> str:
    if not load:
        return "-"
    parts = []
    if "running" in load:
        parts.append(f"{load['running']:.0f} running")
    if "waiting" in load:
        parts.append(f"{load['waiting']:.0f} waiting")
    if "kv" in load:
        parts.append(f"kv {100 * load['kv']:.0f}%")
    return ", ".join(parts)


def format_status(status: ClusterStatus) -> str:
    st = status.state
    lines = [f"cluster  gcs {st.gcs_address}  dashboard {st.dashboard_url or '-'}"]
    lines.append("nodes")
    rows = [["NAME", "PID", "PROCESS", "RAY", "NODE ID", "LABELS", "CPU RESERVED/TOTAL", "CPUS"]]
    for n in status.nodes:
        rows.append(
            [
                n.name,
                str(n.pid),
                "running" if n.process_running else "gone",
                n.ray_state,
                n.node_id[:8] or "-",
                ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())) or "-",
                f"{n.cpus_reserved:g}/{n.cpus_total:g}",
                n.cpu_pinning,
            ]
        )
    lines += _table(rows)
    lines.append("pools")
    pool_nodes = [n for n in status.nodes if POOL_LABEL_KEY in n.labels]
    for n in pool_nodes:
        on_node = [r for r in status.replicas if r.node == n.name]
        counts: dict[str, int] = defaultdict(int)
        for r in on_node:
            counts[f"{r.deployment} {r.state.lower()}"] += 1
        summary = ", ".join(f"{c} {k}" for k, c in sorted(counts.items())) or "no replicas"
        # TP per pool: its replicas' (two sizes while a redeploy changes it).
        sizes = "/".join(str(t) for t in sorted({r.tp for r in on_node}))
        tp_text = f"  tp {sizes}" if sizes else ""
        # Weight and KV dtypes per pool (two while a redeploy changes them).
        kinds = ", ".join(sorted({r.dtypes for r in on_node if r.dtypes != "-"}))
        dtype_text = f"  weights/kv {kinds}" if kinds else ""
        lines.append(
            f"  {n.labels[POOL_LABEL_KEY]:8s} node {n.name}: {summary}{tp_text}{dtype_text}"
        )
    if st.serve is None:
        lines.append("serve    not deployed (run `pdserve serve`)")
    else:
        lines.append(
            f"serve    {st.serve.app_name}: {status.app_status or 'unknown'}  {st.serve.http_url}"
        )
        if st.serve.grpc_address:
            lines.append(f"grpc     {st.serve.grpc_address}")
        if status.app_message:
            lines.append(f"  message: {status.app_message}")
        if status.replicas:
            lines.append("replicas")
            rows = [["DEPLOYMENT", "REPLICA", "STATE", "NODE", "TP", "WEIGHTS/KV", "PID", "LOAD"]]
            for r in sorted(status.replicas, key=lambda r: (r.deployment, r.replica_id)):
                rows.append(
                    [
                        r.deployment,
                        r.replica_id,
                        r.state,
                        r.node,
                        str(r.tp),
                        r.dtypes,
                        str(r.pid or "-"),
                        _fmt_load(r.load),
                    ]
                )
            lines += _table(rows)
    for problem in status.problems:
        lines.append(f"warning: {problem}")
    return "\n".join(lines)
