"""A window model served disaggregated on a real local multi-node Ray cluster: a tiny gpt-oss
(one sliding-window layer of window 32, one full layer, block 16) whose prefill and decode
replicas both keep their window layers' KV in a pool of their own. Prompts of 300 and 200
tokens are prefilled on the prefill node; the decode replica receives every block of the
full layer and only the first decoded token's window of the window layer, and every stream's
greedy tokens equal ``transformers.generate`` in float32."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from pdserve.deployments.config import AppConfig  # noqa: E402
from pdserve.deployments.messages import GenerateChunk  # noqa: E402
from tests.engine.tiny_hf_models import build_tiny_model  # noqa: E402
from tests.support.cluster import (  # noqa: E402
    app_config,
    collect,
    local_cluster,
    prompt,
    request,
    tokens,
    wait_idle,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MAX_TOKENS = 16


def transformers_tokens(model_dir: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gc = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    expected = {}
    for rid, ids in prompts.items():
        t = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(t, generation_config=gc, attention_mask=torch.ones_like(t))
        expected[rid] = out[0, len(ids) :].tolist()
    return expected


def test_served_window_model_moves_only_the_window_and_matches_transformers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = build_tiny_model("gpt-oss", tmp_path / "gpt-oss", tiny_model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    window = hf_config["sliding_window"]
    kinds = hf_config["layer_types"]
    num_window, num_full = kinds.count("sliding_attention"), kinds.count("full_attention")
    assert (window, num_window, num_full) == (32, 1, 1)
    data = app_config("pdserve-window").model_dump()
    data["model"] = {"path": str(model_dir), "dtype": "float32", "device": "cpu"}
    cfg = AppConfig.model_validate(data)
    block = cfg.decode.engine.block_size
    # K and V of one block of one layer, float32.
    block_bytes = 2 * block * hf_config["num_key_value_heads"] * hf_config["head_dim"] * 4
    prompts = {"long-300": prompt(1, 300), "long-200": prompt(2, 200), "short": prompt(3, 9)}
    expected = transformers_tokens(model_dir, prompts)
    with local_cluster(cfg, pool_cpus=1) as pd:

        async def run() -> dict[str, list[GenerateChunk]]:
            reqs = [collect(pd, request(r, p, MAX_TOKENS)) for r, p in prompts.items()]
            return dict(zip(prompts, await asyncio.gather(*reqs), strict=True))

        results = asyncio.run(run())
        for rid in prompts:
            assert tokens(results[rid]) == expected[rid], rid
        where = {rid: chunks[0].prefill_location for rid, chunks in results.items()}
        assert where == {"long-300": "remote", "long-200": "remote", "short": "local"}
        windowed = every_block = 0
        for rid in ("long-300", "long-200"):
            n = len(prompts[rid])
            blocks = -(-n // block)
            in_window = blocks - (n - window + 1) // block  # 3 of 19, 3 of 13
            windowed += (blocks * num_full + in_window * num_window) * block_bytes
            every_block += blocks * (num_full + num_window) * block_bytes
        counters = pd.decode.counters.remote().result(timeout_s=30)
        assert counters.kv_bytes_received == windowed < every_block
        assert counters.fallbacks == 0
        for handle in (pd.decode, pd.prefill):
            report = handle.check_integrity.remote().result(timeout_s=30)
            assert report.num_window_total_blocks > 0, report  # the window pool is in use
        wait_idle(pd)
