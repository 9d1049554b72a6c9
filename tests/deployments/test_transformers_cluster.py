"""Models built by transformers on a real local multi-node Ray cluster: tiny Qwen3-MoE and
Gemma 3 (sliding-window layers) and gpt-oss (sinks, sliding-window layers), all three on
their native classes under ``model_impl`` auto, served disaggregated; prompts
longer than the local-prefill limit are prefilled on the prefill node and their KV moved to
the decode node, and every stream's greedy tokens equal ``transformers.generate``. One
cluster per model, stopped after it."""

from __future__ import annotations

import asyncio
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


@pytest.mark.parametrize("name", ["qwen3-moe", "gemma3", "gpt-oss"])
def test_remote_prefill_on_a_cluster_gives_transformers_tokens(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model_dir = build_tiny_model(name, tmp_path / name, tiny_model_dir)
    data = app_config().model_dump()
    data["model"] = {"path": str(model_dir), "dtype": "float32", "device": "cpu"}
    cfg = AppConfig.model_validate(data)
    # Longer than the windows (32 / 40 tokens) and than the local-prefill limit (32).
    prompts = {"long-1": prompt(1, 90), "long-2": prompt(2, 60), "short": prompt(3, 9)}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gc = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    expected = {}
    for rid, ids in prompts.items():
        t = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(t, generation_config=gc, attention_mask=torch.ones_like(t))
        expected[rid] = out[0, len(ids) :].tolist()
    with local_cluster(cfg, pool_cpus=1) as pd:

        async def run() -> dict[str, list[GenerateChunk]]:
            reqs = [collect(pd, request(r, p, MAX_TOKENS)) for r, p in prompts.items()]
            return dict(zip(prompts, await asyncio.gather(*reqs), strict=True))

        results = asyncio.run(run())
        for rid in prompts:
            assert tokens(results[rid]) == expected[rid], rid
        where = {rid: chunks[0].prefill_location for rid, chunks in results.items()}
        assert where == {"long-1": "remote", "long-2": "remote", "short": "local"}
        wait_idle(pd)
