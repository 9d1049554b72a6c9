"""Deploy the pdserve application onto a running local cluster (``pdserve serve``).

Connects a driver to the recorded cluster, starts Serve with one HTTP proxy and (unless the
config turns it off) one gRPC proxy on the head, at the cluster's loopback address and
OS-chosen ports, deploys ``pdserve.deployments.app.build_app(config)`` and reports progress until
every replica runs. On a cluster started with ``--direct-ingress`` there is no proxy: the
ingress replica serves HTTP and gRPC on ports Serve's controller gives it, read back from
the controller's target groups once it runs. The application outlives this driver
(Serve's controller is detached); ``pdserve down`` ends it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.cluster.local import Progress
from pdserve.cluster.ports import free_port, free_port_all_interfaces
from pdserve.cluster.state import ClusterState, ServeRecord
from pdserve.deployments.config import AppConfig

if TYPE_CHECKING:  # Ray is imported only when deploying
    from ray.serve.schema import ServeStatus

GRPC_SERVICER = "pdserve.deployments.grpc.pdserve_pb2_grpc.add_PDServeServicer_to_server"
# grpc.health.v1.Health: load balancers and Kubernetes gRPC probes call Health/Check.
HEALTH_SERVICER = "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"


def resolve_model(config: AppConfig, progress: Progress) -> AppConfig:
    """Pin the model directory before deploying (the test model is generated on first use).

    Resolving here, once, shows the user what takes time and hands every replica a path.
    """
    if config.model.path is None:
        progress(f"model: test model {config.model.test_model!r} (generated once, on first use)")
    path = config.model.resolve_path()
    progress(f"model: {path}")
    # Keep the name clients see ("pdserve-small", not the cache directory's hashed name).
    name = config.model.served_name(str(path))
    pinned = config.model.model_copy(update={"path": path, "name": name})
    return config.model_copy(update={"model": pinned})


def prepare_model_in_background(config: AppConfig) -> threading.Thread:
    """Resolve (and on first use generate) the model while the cluster starts.

    Errors are left for ``resolve_model`` to raise again in the foreground: generation is
    idempotent and safe to repeat.
    """

    def prepare() -> None:
        with contextlib.suppress(Exception):
            config.model.resolve_path()

    thread = threading.Thread(target=prepare, name="pdserve-model", daemon=True)
    thread.start()
    return thread


def bind_front_door(
    config: AppConfig, node_ip: str, running: ServeRecord | None = None
) -> AppConfig:
    """HTTP/gRPC on the cluster's address and OS-chosen ports, unless the config set them.

    A Serve instance that already runs keeps its proxies: reuse their ports then.
    """
    http_set, grpc_set = config.http.model_fields_set, config.grpc.model_fields_set
    http_port = config.http.port if config.http.port and "port" in http_set else None
    if http_port is None:
        http_port = running.http_port if running is not None else free_port(node_ip)
    http = config.http.model_copy(
        update={"host": config.http.host if "host" in http_set else node_ip, "port": http_port}
    )
    grpc = config.grpc
    if grpc.enabled and not (grpc.port and "port" in grpc_set):
        port = running.grpc_port if running is not None and running.grpc_port else None
        grpc = grpc.model_copy(update={"port": port or free_port_all_interfaces()})
    return config.model_copy(update={"http": http, "grpc": grpc})


def _describe(status: ServeStatus, app_name: str) -> str:
    """One line: the app's status and each deployment's replica states."""
    app = status.applications.get(app_name)
    if app is None:
        return "application: not created yet"
    parts = []
    for name, dep in app.deployments.items():
        states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(dep.replica_states.items()))
        parts.append(f"{name} [{dep.status.lower()}{': ' + states if states else ''}]")
    return f"application {app.status.lower()}: " + "; ".join(parts)


def connect_driver(state: ClusterState) -> None:
    """``ray.init`` this process as a driver of the cluster ``state`` describes.

    Ray puts the driver's working directory first on every worker's sys.path. In a checkout
    of pdserve that directory holds the source folders (``kernels``, ``engine``...), which
    would shadow same-named packages in the replicas (transformers imports Hugging Face's
    ``kernels``); so the driver connects from the cluster's own directory.
    """
    import ray

    cwd = os.getcwd()
    os.chdir(state.root_dir)
    try:
        ray.init(
            address=state.gcs_address,
            _node_ip_address=state.node_ip,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    finally:
        os.chdir(cwd)


@dataclass(frozen=True)
class NodeCapacity:
    """What one alive Ray node offers: its labels and total resources."""

    name: str
    labels: dict[str, str]
    resources: dict[str, float]


def unplaceable_pools(config: AppConfig, nodes: list[NodeCapacity]) -> list[str]:
    """One message per pool whose replica no node can ever hold: a replica needs
    ``tensor_parallel_size`` x its per-rank CPUs and GPUs on ONE node whose labels match
    the pool's selector (STRICT_PACK). Serve would otherwise wait for it forever."""
    problems = []
    for role in ("prefill", "decode"):
        pool = config.pool(role)
        if role == "prefill" and pool.max_replicas == 0:
            continue
        tp = pool.tensor_parallel_size
        need = {"CPU": pool.num_cpus * tp, "GPU": config.gpus_per_replica(role)}
        selector = pool.label_selector(role)
        matching = [n for n in nodes if all(n.labels.get(k) == v for k, v in selector.items())]
        if any(all(n.resources.get(r, 0.0) >= v for r, v in need.items()) for n in matching):
            continue
        offered = ", ".join(
            f"{n.name} ({n.resources.get('CPU', 0):g} CPU, {n.resources.get('GPU', 0):g} GPU)"
            for n in matching
        )
        problems.append(
            f"{role}: a replica needs {need['CPU']:g} CPU and {need['GPU']:g} GPU on one node "
            f"(tensor_parallel_size {tp} x per-rank num_cpus {pool.num_cpus:g} / num_gpus "
            f"{config.gpus_per_rank(role):g}) with labels {selector}; "
            f"nodes: {offered or 'none match'}"
        )
    return problems


def _cluster_nodes() -> list[NodeCapacity]:
    import ray

    return [
        NodeCapacity(
            name=n.get("NodeManagerAddress", "?") + ":" + n.get("NodeID", "")[:8],
            labels=dict(n.get("Labels") or {}),
            resources=dict(n.get("Resources") or {}),
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]


def deploy(
    state: ClusterState, config: AppConfig, *, timeout_s: float, progress: Progress
) -> ServeRecord:
    """Deploy and wait until the application runs; raise with Serve's message if it fails."""
    import ray
    from ray import serve

    from pdserve.deployments.app import build_app

    config = bind_front_door(resolve_model(config, progress), state.node_ip, state.serve)
    progress(f"connecting to the cluster at {state.gcs_address}")
    if not ray.is_initialized():
        # ray.init replaces SIGINT/SIGTERM handlers with its own (which end the process at
        # once); the caller's handlers decide what a signal means here (`run` cleans up).
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        connect_driver(state)
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # we report progress ourselves
    problems = unplaceable_pools(config, _cluster_nodes())
    if problems:
        raise ValueError("no node can hold a replica of:\n  " + "\n  ".join(problems))
    grpc_options = None
    if config.grpc.enabled:
        servicers = [GRPC_SERVICER, HEALTH_SERVICER]
        grpc_options = {"port": config.grpc.port, "grpc_servicer_functions": servicers}
    # One proxy, on the head: proxies on every node would all bind the same address here.
    serve.start(
        proxy_location="HeadOnly",
        http_options={"host": config.http.host, "port": config.http.port},
        grpc_options=grpc_options,
    )
    app = build_app(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            serve.run(app, name=config.name, route_prefix=config.http.route_prefix)
        except BaseException as err:  # reported by the waiting thread below
            errors.append(err)

    worker = threading.Thread(target=run, name="pdserve-deploy", daemon=True)
    worker.start()
    started, last = time.monotonic(), ""
    while worker.is_alive():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"application not running after {timeout_s:.0f} s ({last})")
        line = _describe(serve.status(), config.name)
        if line != last:
            progress(f"[{time.monotonic() - started:5.1f} s] {line}")
            last = line
        worker.join(timeout=1.0)
    if errors:
        raise RuntimeError(f"deploying {config.name!r} failed: {errors[0]}") from errors[0]
    line = _describe(serve.status(), config.name)
    if line != last:
        progress(f"[{time.monotonic() - started:5.1f} s] {line}")
    http_port, grpc_port = config.http.port, config.grpc.port if config.grpc.enabled else None
    if state.direct_ingress:
        remaining = max(5.0, timeout_s - (time.monotonic() - started))
        http_port, direct_grpc = ingress_ports(config.name, timeout_s=remaining)
        grpc_port = direct_grpc if config.grpc.enabled else None
    record = ServeRecord(
        app_name=config.name,
        model_name=config.model.served_name(str(config.model.path)),
        http_host=config.http.host,
        http_port=http_port,
        route_prefix=config.http.route_prefix,
        grpc_port=grpc_port,
    )
    wait_for_http(record, timeout_s=max(30.0, timeout_s - (time.monotonic() - started)))
    progress(f"[{time.monotonic() - started:5.1f} s] HTTP API answering at {record.http_url}")
    return record


def wait_for_http(record: ServeRecord, *, timeout_s: float) -> None:
    """Wait until the application's ingress answers ``GET /v1/models`` over HTTP (200, or
    401 where it checks API keys): Serve's proxy learns routes and replicas a moment after
    the application runs. The ingress's answer also tells the proxy its door's bound
    (``deployments/edge_bound.py``), so that a flood's first 429s come from the proxy."""
    url = f"{record.http_url}/v1/models"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            with opener.open(url, timeout=5) as response:
                status = response.status
        except urllib.error.HTTPError as err:
            status = err.code
        except (urllib.error.URLError, OSError) as err:
            status, last = 0, repr(err)
        if status in (200, 401):
            return
        if status:
            last = f"HTTP {status}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer after {timeout_s:.0f} s ({last})")
        time.sleep(0.2)


def ingress_ports(app_name: str, *, timeout_s: float) -> tuple[int, int | None]:
    """(HTTP, gRPC) ports of the application's ingress replica under direct ingress, from
    the controller's target groups (``ServeInstanceDetails.target_groups``: a replica's
    targets appear once it runs). With several ingress replicas, the first one's."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve.schema import ServeInstanceDetails

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    deadline = time.monotonic() + timeout_s
    while True:
        details = ServeInstanceDetails(**ray.get(controller.get_serve_instance_details.remote()))
        ports: dict[str, int] = {}
        for group in details.target_groups:
            if group.app_name == app_name and group.targets:
                ports.setdefault(group.protocol.value, group.targets[0].port)
        if "HTTP" in ports:
            return ports["HTTP"], ports.get("gRPC")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no direct-ingress HTTP target for application {app_name!r} after "
                f"{timeout_s:.0f} s (is the cluster started with --direct-ingress?)"
            )
        time.sleep(0.5)


def curl_example(record: ServeRecord) -> str:
    """A request a user can paste into a shell."""
    message = {"role": "user", "content": "Hello!"}
    body = json.dumps({"model": record.model_name, "messages": [message], "max_tokens": 32})
    return (
        f"curl -s {record.http_url}/v1/chat/completions "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )


def grpc_example(record: ServeRecord) -> str | None:
    """A gRPC call a user can paste into a shell (None when gRPC is off)."""
    if record.grpc_address is None:
        return None
    return (
        f"python -m pdserve.deployments.grpc.client --target {record.grpc_address} "
        f"--application {record.app_name} --max-tokens 32 'Hello!'"
    )
