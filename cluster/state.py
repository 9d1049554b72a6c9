"""What ``pdserve up`` started, written down so ``serve``, ``status`` and ``down`` can find it.

One JSON file per state directory (``cluster.json``): the node processes (pid = the process
group and session the node's processes live in), addresses, ports and temp dirs, and, once
``pdserve serve`` ran, the Serve endpoints. The state directory is per user
(``$XDG_STATE_HOME/pdserve``, else ``~/.local/state/pdserve``); the CLI's ``--state-dir``
flag and the ``PDSERVE_STATE_DIR`` variable (both read only in ``pdserve.cluster.cli``) override it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pdserve.cluster.topology import NodeRole

STATE_FILE = "cluster.json"


class NodeRecord(BaseModel):
    """One started ``ray start --block`` process and what it owns."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Node name (head, prefill, decode).")
    role: NodeRole = Field(description="head or the pool the node hosts.")
    pid: int = Field(description="Pid of `ray start --block`; leader of its own session.")
    temp_dir: str = Field(description="The node's Ray --temp-dir (removed by `down`).")
    log_file: str = Field(description="stdout/stderr of `ray start`.")
    labels: dict[str, str] = Field(description="Ray node labels.")
    num_cpus: int = Field(description="Logical CPUs the node offers.")
    metrics_export_port: int = Field(description="Prometheus metrics port of the node.")
    cpus: list[int] = Field(
        default_factory=list, description="CPUs the node's processes start on; [] = any."
    )
    engine_cpus: list[int] = Field(
        default_factory=list, description="CPUs reserved for its engine threads; [] = none."
    )


class ServeRecord(BaseModel):
    """Where the Serve application answers, once ``pdserve serve`` deployed it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    app_name: str = Field(description="Serve application name.")
    model_name: str = Field(description="Model id clients send.")
    http_host: str = Field(
        description=(
            "Address of the HTTP front door: the proxy, or the ingress replica under "
            "direct ingress."
        )
    )
    http_port: int = Field(description="Port of the HTTP front door.")
    route_prefix: str = Field(description="Route prefix of the application.")
    grpc_port: int | None = Field(description="Port of the gRPC proxy; None = not enabled.")

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible HTTP API (``/v1/...`` goes after it)."""
        return f"http://{self.http_host}:{self.http_port}{self.route_prefix.rstrip('/')}"

    @property
    def grpc_address(self) -> str | None:
        return None if self.grpc_port is None else f"{self.http_host}:{self.grpc_port}"


class ClusterState(BaseModel):
    """The whole local cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_ip: str = Field(description="Loopback address of every node.")
    gcs_address: str = Field(description="host:port of the head's GCS (ray.init address).")
    dashboard_url: str | None = Field(description="Ray dashboard URL (state API), if started.")
    root_dir: str = Field(description="Directory holding every node's temp dir.")
    auth_token_path: str = Field(description="File with the cluster's Ray auth token (0600).")
    nodes: list[NodeRecord] = Field(description="Started nodes, head first.")
    direct_ingress: bool = Field(
        default=False,
        description="Serve's direct ingress: the ingress replica serves HTTP/gRPC itself.",
    )
    serve: ServeRecord | None = Field(default=None, description="Serve endpoints, if deployed.")

    def node(self, name: str) -> NodeRecord:
        for record in self.nodes:
            if record.name == name:
                return record
        raise KeyError(name)


def ray_client_env(state: ClusterState) -> dict[str, str]:
    """Environment a Ray client (driver, state API, ``ray``/``serve`` CLIs) needs for this
    cluster: its address and its token (the GCS listens on every interface, so the cluster
    uses Ray's token authentication with a token of its own)."""
    return {
        "RAY_ADDRESS": state.gcs_address,
        "RAY_NODE_IP_ADDRESS": state.node_ip,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": state.auth_token_path,
    }


def write_token(path: Path, token: str) -> None:
    """Create the token file readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token)


def auth_header(state: ClusterState) -> dict[str, str]:
    """HTTP header for the dashboard's REST API (state API, Serve status)."""
    return {"Authorization": "Bearer " + Path(state.auth_token_path).read_text().strip()}


def default_state_dir() -> Path:
    """The per-user default; the CLI applies ``--state-dir``/``PDSERVE_STATE_DIR`` first."""
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "pdserve"


def state_path(state_dir: Path) -> Path:
    return state_dir / STATE_FILE


def load_state(state_dir: Path) -> ClusterState | None:
    """The recorded cluster, or None when nothing was started from this state dir."""
    path = state_path(state_dir)
    if not path.is_file():
        return None
    return ClusterState.model_validate_json(path.read_text())


def save_state(state_dir: Path, state: ClusterState) -> None:
    """Write atomically: a reader never sees half a file."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cluster-", suffix=".json", dir=state_dir)
    with os.fdopen(fd, "w") as out:
        json.dump(state.model_dump(mode="json"), out, indent=2)
    os.replace(tmp, state_path(state_dir))


def clear_state(state_dir: Path) -> None:
    state_path(state_dir).unlink(missing_ok=True)
