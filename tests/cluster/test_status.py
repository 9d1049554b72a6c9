"""`pdserve status` rendering and its load column, from a fake metrics endpoint (no Ray)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pdserve.cluster.state import ClusterState, NodeRecord, ServeRecord
from pdserve.cluster.status import (
    ClusterStatus,
    NodeStatus,
    PlacementGroup,
    ReplicaStatus,
    format_status,
    replica_load,
    reserved_by_groups,
    scrape_load,
    split_dtypes,
    tp_by_actor,
)

METRICS = """\
# HELP ray_pdserve_num_requests_running Requests in the running batch.
# TYPE ray_pdserve_num_requests_running gauge
ray_pdserve_num_requests_running{model_name="m",role="decode",replica="dec1"} 3.0
ray_pdserve_num_requests_running{model_name="m",role="ingress",replica=""} 9.0
# TYPE ray_pdserve_num_requests_waiting gauge
ray_pdserve_num_requests_waiting{model_name="m",role="decode",replica="dec1"} 2.0
# TYPE ray_pdserve_kv_cache_usage_perc gauge
ray_pdserve_kv_cache_usage_perc{model_name="m",role="decode",replica="dec1"} 0.25
# TYPE ray_pdserve_engine_dtypes gauge
ray_pdserve_engine_dtypes{replica="dec1",weight_dtype="int8 a8 int8",kv_cache_dtype="fp8_e4m3"} 1.0
# TYPE ray_serve_num_http_requests counter
ray_serve_num_http_requests_total{route="/"} 7.0
"""


@pytest.fixture()
def metrics_port() -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _node(name: str, port: int, labels: dict[str, str]) -> NodeRecord:
    return NodeRecord(
        name=name,
        role=name if name in ("prefill", "decode") else "head",  # type: ignore[arg-type]
        pid=1,
        temp_dir="/tmp/x",
        log_file="/tmp/x.log",
        labels=labels,
        num_cpus=1,
        metrics_export_port=port,
    )


def test_load_comes_from_pdserve_gauges_per_replica(metrics_port: int) -> None:
    records = [_node("decode", metrics_port, {"pdserve.io/pool": "decode"})]
    load = scrape_load(records, "127.0.0.1")
    gauges = {"running": 3.0, "waiting": 2.0, "kv": 0.25}
    assert load == {"dec1": {**gauges, "int8 a8 int8/fp8_e4m3": 1.0}}
    assert replica_load(load, "dec1") == load["dec1"]
    assert split_dtypes(load["dec1"]) == (gauges, "int8 a8 int8/fp8_e4m3")
    assert replica_load(load, "other") == {}


def test_format_status_shows_nodes_pools_replicas_and_load() -> None:
    state = ClusterState(
        node_ip="127.0.0.2",
        gcs_address="127.0.0.2:6000",
        dashboard_url="http://127.0.0.2:6001",
        root_dir="/tmp/x",
        auth_token_path="/tmp/x/token",
        nodes=[
            _node("head", 1, {}),
            _node("prefill", 2, {"pdserve.io/pool": "prefill"}),
            _node("decode", 3, {"pdserve.io/pool": "decode"}),
        ],
        serve=ServeRecord(
            app_name="pdserve",
            model_name="m",
            http_host="127.0.0.2",
            http_port=6002,
            route_prefix="/",
            grpc_port=None,
        ),
    )
    nodes = [
        NodeStatus("head", 10, True, "ALIVE", "aaaaaaaa11", {}, 0.0, 0.0),
        NodeStatus(
            "prefill", 11, True, "ALIVE", "bbbbbbbb22", {"pdserve.io/pool": "prefill"}, 1, 1
        ),
        NodeStatus("decode", 12, False, "unknown", "", {"pdserve.io/pool": "decode"}, 0, 0),
    ]
    replicas = [
        ReplicaStatus(
            "PrefillServer", "pre1", "RUNNING", "prefill", 21, tp=2, dtypes="bfloat16/int8"
        ),
        ReplicaStatus(
            "DecodeServer",
            "dec1",
            "STARTING",
            "decode",
            22,
            {"running": 3, "kv": 0.5},
            dtypes="bfloat16/int8",
        ),  # fmt: skip
    ]
    text = format_status(ClusterStatus(state, nodes, replicas, "DEPLOYING", "", ["dashboard slow"]))
    lines = text.splitlines()
    assert lines[0] == "cluster  gcs 127.0.0.2:6000  dashboard http://127.0.0.2:6001"
    (decode_row,) = [line for line in lines if line.split()[:2] == ["decode", "12"]]
    assert "gone" in decode_row and "unknown" in decode_row
    assert (
        "  prefill  node prefill: 1 PrefillServer running  tp 2  weights/kv bfloat16/int8" in lines
    )
    assert (
        "  decode   node decode: 1 DecodeServer starting  tp 1  weights/kv bfloat16/int8" in lines
    )
    assert "serve    pdserve: DEPLOYING  http://127.0.0.2:6002" in lines
    (header,) = [line for line in lines if line.split()[:1] == ["DEPLOYMENT"]]
    assert header.split() == [
        "DEPLOYMENT", "REPLICA", "STATE", "NODE", "TP", "WEIGHTS/KV", "PID", "LOAD"
    ]  # fmt: skip
    (dec_replica,) = [line for line in lines if line.split()[:1] == ["DecodeServer"]]
    assert dec_replica.split()[1:7] == ["dec1", "STARTING", "decode", "1", "bfloat16/int8", "22"]
    assert dec_replica.endswith("3 running, kv 50%")
    (pre_replica,) = [line for line in lines if line.split()[:1] == ["PrefillServer"]]
    assert pre_replica.split()[1:7] == ["pre1", "RUNNING", "prefill", "2", "bfloat16/int8", "21"]
    assert lines[-1] == "warning: dashboard slow"


def test_a_replicas_tp_and_reservation_come_from_its_placement_group() -> None:
    from ray.util.state.common import PlacementGroupState

    def bundle(index: int, node_id: str, cpus: float) -> dict:
        return {
            "bundle_id": {"placement_group_id": "pg1", "bundle_index": index},
            "unit_resources": {"CPU": cpus, "GPU": 1.0},
            "node_id": node_id,
            "label_selector": {"pdserve.io/pool": "prefill"},
        }

    # As Ray's state API returns them: Serve names a replica's group after its actor.
    placed = PlacementGroupState(
        placement_group_id="pg1",
        name="SERVE_REPLICA::pdserve#PrefillServer#abc",
        creator_job_id="01000000",
        state="CREATED",
        bundles=[bundle(i, "node-p", 2.0) for i in range(4)],
        is_detached=True,
        stats={},
    )
    pending = PlacementGroupState(
        placement_group_id="pg2",
        name="SERVE_REPLICA::pdserve#PrefillServer#def",
        creator_job_id="01000000",
        state="PENDING",
        bundles=[bundle(i, "", 2.0) for i in range(4)],
        is_detached=True,
        stats={},
    )
    removed = PlacementGroupState(
        placement_group_id="pg3",
        name="SERVE_REPLICA::pdserve#PrefillServer#old",
        creator_job_id="01000000",
        state="REMOVED",
        bundles=[bundle(i, "node-p", 2.0) for i in range(2)],
        is_detached=True,
        stats={},
    )
    groups = [PlacementGroup.from_state(g) for g in (placed, pending, removed)]
    assert groups[0].bundles == [("node-p", 2.0)] * 4
    assert tp_by_actor(groups) == {
        "SERVE_REPLICA::pdserve#PrefillServer#abc": 4,
        "SERVE_REPLICA::pdserve#PrefillServer#def": 4,  # known before it is placed
    }
    # Only placed bundles of live groups hold CPUs (4 ranks x 2 CPUs on one node).
    assert reserved_by_groups(groups) == {"node-p": 8.0}
