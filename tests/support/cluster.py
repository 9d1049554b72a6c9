"""Ray for the tests that need a real one, on loopback and stopped when the block ends.

``local_cluster`` is the multi-node one (a head without CPUs, a prefill-labelled and a
decode-labelled node, three raylets on 127.0.0.2) with a pdserve app deployed on it;
``private_ray`` is one node for tests that need Serve but no node pools. Both take their
ports from the OS and their own temp dir, and never join a cluster someone else started on
the machine. Clients of the deployed app (``collect``, ``wait_idle``) sit beside them.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.deployments.config import AppConfig
from pdserve.deployments.messages import GenerateChunk, GenerateRequest, SamplingOptions
from tests.support import free_port, wait_until

NODE_IP = "127.0.0.2"  # Ray keeps this loopback address as given (it rewrites 127.0.0.1)
OBJECT_STORE_BYTES = 80 * 1024 * 1024


@dataclass(frozen=True)
class PD:
    """A deployed prefill/decode app: its two deployment handles, the node ids of the
    labelled nodes, and the HTTP address of Serve's proxy."""

    decode: Any  # DeploymentHandle to DecodeServer
    prefill: Any  # DeploymentHandle to PrefillServer
    prefill_node: str
    decode_node: str
    http: str


@contextmanager
def local_cluster(cfg: AppConfig, pool_cpus: int) -> Iterator[PD]:
    """A head (no CPUs), a prefill-labelled and a decode-labelled node of ``pool_cpus``
    logical CPUs each, all on 127.0.0.2, with ``cfg``'s application deployed by Serve;
    everything is stopped on exit."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from pdserve.deployments.app import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, build_application

    temp_dir = tempfile.mkdtemp(prefix="pdray-", dir="/tmp")  # short: unix socket paths
    # ray.cluster_utils records the head's address in Ray's default temp dir whatever
    # temp_dir says, and fails where that dir does not exist yet (a fresh machine).
    Path(ray._private.utils.get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    common = {"node_ip_address": NODE_IP, "object_store_memory": OBJECT_STORE_BYTES}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**common, "num_cpus": 0, "temp_dir": temp_dir, "include_dashboard": False},
    )
    try:
        prefill_node = cluster.add_node(
            **common, num_cpus=pool_cpus, labels={"pdserve.io/pool": "prefill"}
        )
        decode_node = cluster.add_node(
            **common, num_cpus=pool_cpus, labels={"pdserve.io/pool": "decode"}
        )
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address=NODE_IP, log_to_driver=False)
        port = free_port(NODE_IP)
        serve.start(http_options={"host": NODE_IP, "port": port})
        serve.run(build_application(cfg), name=cfg.name, route_prefix="/")
        yield PD(
            decode=serve.get_deployment_handle(DECODE_DEPLOYMENT, app_name=cfg.name),
            prefill=serve.get_deployment_handle(PREFILL_DEPLOYMENT, app_name=cfg.name),
            prefill_node=prefill_node.node_id,
            decode_node=decode_node.node_id,
            http=f"http://{NODE_IP}:{port}",
        )
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


@contextmanager
def private_ray(prefix: str) -> Iterator[None]:
    """A private Ray instance (2 CPUs, node address 127.0.0.2) for the span of the block,
    with Serve shut down after it: address="local" never joins a cluster someone else
    started on this machine, and its own temp dir keeps it out of /tmp/ray (where
    `ray.init()` looks)."""
    import ray
    from ray import serve

    temp_dir = tempfile.mkdtemp(prefix=prefix)
    ray.init(
        address="local",
        _temp_dir=temp_dir,
        _node_ip_address=NODE_IP,
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary, different for each ``seed``."""
    return [(i * 11 + seed * 97) % 1800 + 20 for i in range(n)]


def request(rid: str, ids: list[int], max_tokens: int = 10) -> GenerateRequest:
    """A greedy request that ignores EOS: exactly ``max_tokens`` tokens, comparable with a
    single engine's."""
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling)


async def collect(pd: PD, req: GenerateRequest) -> list[GenerateChunk]:
    """Every chunk the decode deployment streams for ``req``."""
    return [c async for c in pd.decode.options(stream=True).generate.remote(req)]


def tokens(chunks: list[GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def wait_idle(pd: PD, timeout_s: float = 30.0) -> None:
    """Until both pools report nothing held (blocks, transfers, streams) and consistent
    pools; the error names the last reports."""
    last: list[Any] = []

    def idle() -> bool:
        d = pd.decode.check_integrity.remote().result(timeout_s=timeout_s)
        p = pd.prefill.check_integrity.remote().result(timeout_s=timeout_s)
        last[:] = [d, p]
        return d.idle and p.idle

    try:
        wait_until(idle, timeout_s, interval=0.2, what="both pools idle")
    except TimeoutError as e:
        raise AssertionError(f"not idle: {last}") from e


def app_config(name: str = "pdserve-test") -> AppConfig:
    """The small disaggregated app the cluster tests serve: tiny model, float32, one CPU a pool."""
    return AppConfig.from_dict(
        {
            "name": name,
            "model": {"test_model": "tiny", "dtype": "float32", "device": "cpu"},
            "prefill": {"num_cpus": 1, "engine": {"num_kv_blocks": 256, "max_num_seqs": 8}},
            "decode": {"num_cpus": 1, "engine": {"num_kv_blocks": 256, "max_num_seqs": 8}},
            "slo": {"ttft_ms": 60_000},
            "transport": {"timeout_s": 5.0},
            "policy": {"local_prefill_max_tokens": 32},
            "router": {"stats_period_s": 0.5},
        }
    )
