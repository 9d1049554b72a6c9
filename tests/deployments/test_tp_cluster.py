"""Tensor-parallel pools on a real local Ray cluster: prefill TP=2 and decode
TP=2 replicas, each a STRICT_PACK placement group whose ranks 1.. are Ray actors, serve
greedy outputs equal to a single engine, locally and across the P/D split (KV moving rank
to rank); a prefill rank killed mid-flight ends in the decode side's local fallback with the
same tokens, and Serve replaces the broken replica.

Both pools hold an int8 KV cache (each rank its heads' one-byte blocks and scales), and the
single engine too; ``test_tp_handoff.py`` moves the float cache between TP sizes."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from pdserve.deployments.config import AppConfig  # noqa: E402
from pdserve.engine.loader import load_model_config  # noqa: E402
from tests.support import wait_until  # noqa: E402
from tests.support.cluster import (  # noqa: E402
    PD,
    collect,
    local_cluster,
    prompt,
    request,
    tokens,
    wait_idle,
)

pytestmark = pytest.mark.cluster

APP = "pdserve-tp-test"


def app_config() -> AppConfig:
    pool = {"num_cpus": 1, "tensor_parallel_size": 2}
    engine = {"num_kv_blocks": 128, "max_num_seqs": 8, "kv_cache_dtype": "int8"}
    return AppConfig.from_dict(
        {
            "name": APP,
            "model": {"test_model": "tiny", "dtype": "float32", "device": "cpu"},
            "prefill": {**pool, "engine": engine},
            "decode": {**pool, "engine": engine},
            "slo": {"ttft_ms": 60_000},
            "transport": {"timeout_s": 5.0},
            "policy": {"local_prefill_max_tokens": 32},
            "router": {"stats_period_s": 0.5},
        }
    )


@pytest.fixture(scope="module")
def pd() -> Iterator[PD]:
    # Two logical CPUs per pool node: one bundle per rank of a TP=2 replica.
    with local_cluster(app_config(), pool_cpus=2) as pd:
        yield pd


@pytest.fixture(scope="module")
def reference() -> Any:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    model_dir = app_config().model.resolve_path()
    engine = LLMEngine.from_pretrained(
        model_dir, dtype="float32", device="cpu", num_kv_blocks=128, kv_cache_dtype="int8"
    )
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return lambda ids: engine.generate([ids], greedy)[0].token_ids


def _ranks(handle: Any) -> list[dict[str, Any]]:
    """Where the replica's ranks 1.. run (its integrity report)."""
    return handle.check_integrity.remote().result(timeout_s=60).tp_ranks


def test_tp_replicas_serve_the_single_engine_tokens(pd: PD, reference) -> None:
    # Each replica's rank 1 is a Ray actor on its replica's node (STRICT_PACK).
    assert [(r["rank"], r["node_id"]) for r in _ranks(pd.prefill)] == [(1, pd.prefill_node)]
    assert [(r["rank"], r["node_id"]) for r in _ranks(pd.decode)] == [(1, pd.decode_node)]
    prompts = {"long-1": prompt(1, 90), "long-2": prompt(2, 60), "short-1": prompt(3, 9)}

    async def run() -> dict[str, Any]:
        outs = await asyncio.gather(*(collect(pd, request(r, p)) for r, p in prompts.items()))
        return dict(zip(prompts, outs, strict=True))

    before = pd.decode.counters.remote().result()
    results = asyncio.run(run())
    for rid, ids in prompts.items():
        assert tokens(results[rid]) == reference(ids), rid
    where = {rid: chunks[0].prefill_location for rid, chunks in results.items()}
    assert where == {"long-1": "remote", "long-2": "remote", "short-1": "local"}
    after = pd.decode.counters.remote().result()
    # What rank 0's receiver counts: every block of the two remote prompts, every layer, K
    # and V, its one of the 2 KV heads, one byte an element.
    cfg = load_model_config(app_config().model.resolve_path())
    blocks = sum(-(-len(prompts[rid]) // 16) for rid in ("long-1", "long-2"))
    want = blocks * cfg.num_layers * 2 * 16 * (cfg.num_kv_heads // 2) * cfg.head_dim
    assert after.kv_bytes_received - before.kv_bytes_received == want
    wait_idle(pd)


def test_a_killed_prefill_rank_falls_back_and_is_replaced(pd: PD, reference) -> None:
    [worker] = _ranks(pd.prefill)
    os.kill(worker["pid"], signal.SIGKILL)
    ids = prompt(7, 80)
    chunks = asyncio.run(collect(pd, request("after-kill", ids)))
    assert tokens(chunks) == reference(ids)  # recomputed locally, same tokens
    # Serve sees the replica's failed health check and starts a fresh TP=2 replica; until
    # then every request falls back to a local prefill, with the same tokens.
    attempts = iter(range(1000))

    def prefilled_remotely() -> bool:
        attempt = next(attempts)
        ids = prompt(100 + attempt, 80)  # new prompts: no prefix-cache hit on the decode side
        chunks = asyncio.run(collect(pd, request(f"again-{attempt}", ids)))
        assert tokens(chunks) == reference(ids)
        return chunks[0].prefill_location == "remote"

    wait_until(prefilled_remotely, timeout=180, interval=2, what="the prefill pool to come back")
    [fresh] = _ranks(pd.prefill)
    assert fresh["pid"] != worker["pid"] and fresh["node_id"] == pd.prefill_node
    wait_idle(pd)
