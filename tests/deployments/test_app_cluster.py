"""End to end on a real local multi-node Ray cluster (head, prefill-labelled node,
decode-labelled node; three raylets on 127.0.0.2) with the real engine on the tiny test
model: placement by label, greedy outputs equal to a single engine, local vs remote
prefill, a prefill replica killed during a burst, a cancelled stream, and HTTP through the
ingress. One cluster for the module; everything is stopped by the fixture."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from pdserve.deployments.app import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, build_application  # noqa: E402
from pdserve.deployments.config import AppConfig  # noqa: E402
from pdserve.deployments.messages import GenerateChunk, GenerateRequest, SamplingOptions  # noqa: E402

pytestmark = pytest.mark.cluster

NODE_IP = "127.0.0.2"
APP = "pdserve-test"
OBJECT_STORE_BYTES = 80 * 1024 * 1024
MAX_TOKENS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind((NODE_IP, 0))
        return s.getsockname()[1]


def app_config() -> AppConfig:
    return AppConfig.from_dict(
        {
            "name": APP,
            "model": {"test_model": "tiny", "dtype": "float32", "device": "cpu"},
            "prefill": {"num_cpus": 1, "engine": {"num_kv_blocks": 256, "max_num_seqs": 8}},
            "decode": {"num_cpus": 1, "engine": {"num_kv_blocks": 256, "max_num_seqs": 8}},
            "slo": {"ttft_ms": 60_000},
            "transport": {"timeout_s": 5.0},
            "policy": {"local_prefill_max_tokens": 32},
            "router": {"stats_period_s": 0.5},
        }
    )


@dataclass
class PD:
    decode: Any  # DeploymentHandle to DecodeServer
    prefill: Any  # DeploymentHandle to PrefillServer
    prefill_node: str
    decode_node: str
    http: str


@contextlib.contextmanager
def serve_on_local_cluster(cfg: AppConfig, pool_cpus: int) -> Iterator[PD]:
    """A head (no CPUs), a prefill-labelled and a decode-labelled node of ``pool_cpus``
    logical CPUs each, all on 127.0.0.2, with ``cfg``'s application deployed by Serve;
    everything is stopped on exit."""
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
        port = free_port()
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


@pytest.fixture(scope="module")
def pd() -> Iterator[PD]:
    with serve_on_local_cluster(app_config(), pool_cpus=1) as pd:
        yield pd


@pytest.fixture(scope="module")
def reference() -> Callable[[list[int]], list[int]]:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    model_dir = app_config().model.resolve_path()
    engine = LLMEngine.from_pretrained(model_dir, dtype="float32", device="cpu", num_kv_blocks=256)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return lambda prompt: engine.generate([prompt], greedy)[0].token_ids


def prompt(seed: int, n: int) -> list[int]:
    return [(i * 11 + seed * 97) % 1800 + 20 for i in range(n)]


def request(rid: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> GenerateRequest:
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling)


async def collect(pd: PD, req: GenerateRequest) -> list[GenerateChunk]:
    return [c async for c in pd.decode.options(stream=True).generate.remote(req)]


def tokens(chunks: list[GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def wait_idle(pd: PD, timeout_s: float = 30.0) -> None:
    """Both pools report nothing held (blocks, transfers, streams) and consistent pools."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = pd.decode.check_integrity.remote().result(timeout_s=timeout_s)
        p = pd.prefill.check_integrity.remote().result(timeout_s=timeout_s)
        if d.idle and p.idle:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle: {d} {p}")
        time.sleep(0.2)


def test_replicas_run_on_their_labelled_nodes(pd: PD) -> None:
    d = pd.decode.check_integrity.remote().result(timeout_s=60)
    p = pd.prefill.check_integrity.remote().result(timeout_s=60)
    assert d.node_id == pd.decode_node
    assert p.node_id == pd.prefill_node


def test_concurrent_greedy_outputs_match_a_single_engine(pd: PD, reference: Callable) -> None:
    before = pd.decode.counters.remote().result()
    prompts = {"long-1": prompt(1, 90), "long-2": prompt(2, 60), "short-1": prompt(3, 9),
               "short-2": prompt(4, 20)}  # fmt: skip

    async def run() -> dict[str, list[GenerateChunk]]:
        outs = await asyncio.gather(*(collect(pd, request(r, p)) for r, p in prompts.items()))
        return dict(zip(prompts, outs, strict=True))

    results = asyncio.run(run())
    for rid, ids in prompts.items():
        assert tokens(results[rid]) == reference(ids), rid
        assert results[rid][-1].finish_reason == "length"
    where = {rid: chunks[0].prefill_location for rid, chunks in results.items()}
    assert where == {"long-1": "remote", "long-2": "remote", "short-1": "local", "short-2": "local"}
    after = pd.decode.counters.remote().result()
    assert after.remote - before.remote == 2 and after.local - before.local == 2
    assert after.kv_bytes_received > before.kv_bytes_received
    wait_idle(pd)


def test_openai_http_through_the_ingress(pd: PD) -> None:
    import httpx

    body = {"model": "ignored-if-unknown", "prompt": "the river", "max_tokens": 5}
    models = httpx.get(f"{pd.http}/v1/models", timeout=30).json()
    body["model"] = models["data"][0]["id"]
    resp = httpx.post(f"{pd.http}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["usage"]["completion_tokens"] == 5 and data["choices"][0]["text"]


def test_cancelled_stream_frees_blocks_on_both_sides(pd: PD) -> None:
    async def run() -> int:
        response = pd.decode.options(stream=True).generate.remote(
            request("cancel-me", prompt(5, 80), max_tokens=400)
        )
        got = 0
        async for chunk in response:
            got += len(chunk.token_ids)
            if got >= 2:
                response.cancel()
                break
        return got

    assert asyncio.run(run()) >= 2
    wait_idle(pd)


def test_killing_the_prefill_replica_during_a_burst(pd: PD, reference: Callable) -> None:
    before = pd.decode.counters.remote().result()
    actor_name = pd.prefill.actor_name.remote().result(timeout_s=30)
    burst = {f"burst-{i}": prompt(10 + i, 360 + 10 * i) for i in range(8)}
    rids = list(burst)

    async def run() -> dict[str, list[GenerateChunk]]:
        def send(batch: list[str]) -> dict[str, asyncio.Task]:
            return {
                rid: asyncio.create_task(collect(pd, request(rid, burst[rid]))) for rid in batch
            }

        # The tiny model prefills in milliseconds, so a kill timed against in-flight work
        # alone races with it (and with Serve starting the replacement). Instead the
        # replica is frozen first: the second half is sent to it while Serve still lists
        # it, and it dies with that half in flight.
        actor = ray.get_actor(actor_name, namespace="serve")
        pid = await actor.__ray_call__.remote(lambda _self: os.getpid())
        tasks = send(rids[:4])
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGSTOP)
        try:
            tasks |= send(rids[4:])
            await asyncio.sleep(1.0)
        finally:
            ray.kill(actor, no_restart=True)
        return {rid: await t for rid, t in tasks.items()}

    results = asyncio.run(run())
    for rid, ids in burst.items():
        assert all(c.error is None for c in results[rid]), rid
        assert tokens(results[rid]) == reference(ids), rid
    after = pd.decode.counters.remote().result()
    assert after.fallbacks > before.fallbacks
    # Serve replaces the replica; afterwards nothing is held anywhere.
    deadline = time.monotonic() + 90
    while pd.prefill.actor_name.remote().result(timeout_s=90) == actor_name:
        assert time.monotonic() < deadline, "prefill replica was not replaced"
        time.sleep(0.5)
    wait_idle(pd)
