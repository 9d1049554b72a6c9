"""End to end on a real local multi-node Ray cluster (head, prefill-labelled node,
decode-labelled node; three raylets on 127.0.0.2) with the real engine on the tiny test
model: placement by label, greedy outputs equal to a single engine, local vs remote
prefill, a prefill replica killed during a burst, a cancelled stream, and HTTP through the
ingress. One cluster for the module; everything is stopped by the fixture."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator

import pytest

ray = pytest.importorskip("ray")

from pdserve.deployments.messages import GenerateChunk  # noqa: E402
from tests.support import async_wait_until, wait_until  # noqa: E402
from tests.support.cluster import (  # noqa: E402
    PD,
    app_config,
    collect,
    local_cluster,
    prompt,
    request,
    tokens,
    wait_idle,
)

pytestmark = pytest.mark.cluster

APP = "pdserve-test"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def pd() -> Iterator[PD]:
    with local_cluster(app_config(), pool_cpus=1) as pd:
        yield pd


@pytest.fixture(scope="module")
def reference() -> Callable[[list[int]], list[int]]:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    model_dir = app_config().model.resolve_path()
    engine = LLMEngine.from_pretrained(model_dir, dtype="float32", device="cpu", num_kv_blocks=256)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return lambda prompt: engine.generate([prompt], greedy)[0].token_ids


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
        await asyncio.sleep(0.3)  # some of the first half may finish first: either is fine
        os.kill(pid, signal.SIGSTOP)
        try:
            tasks |= send(rids[4:])

            async def second_half_awaits_kv() -> bool:
                report = await pd.decode.check_integrity.remote()
                return set(rids[4:]) <= set(report.pending_transfers)

            await async_wait_until(
                second_half_awaits_kv,
                timeout=60,
                interval=0.1,
                what="the second half to wait for KV from the frozen prefill replica",
            )
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
    wait_until(
        lambda: pd.prefill.actor_name.remote().result(timeout_s=90) != actor_name,
        timeout=90,
        interval=0.5,
        what="Serve to replace the killed prefill replica",
    )
    wait_idle(pd)
