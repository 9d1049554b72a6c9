"""What the served-split tests of a window model share: the tiny gpt-oss they serve (window
32, block 16), one engine's greedy tokens, a replica's integrity report, the local recompute
of a failed remote prefill."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.deployments.in_process import collect, request, tokens
from tests.engine.tiny_hf_models import build_tiny_model

WINDOW = 32  # the tiny gpt-oss's sliding window


def tiny_window_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny gpt-oss built by transformers: one window and one full-attention layer."""
    out = tmp_path_factory.mktemp("gpt-oss")
    return str(build_tiny_model("gpt-oss", out, tiny_model_dir, swiglu_limit=1.5))


def greedy_tokens(reference: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    """One engine's greedy tokens for ``prompt`` (the whole request in one place)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return list(reference.generate([prompt], params)[0].token_ids)


def integrity(server: Any) -> Any:
    """A prefill or decode server's ``check_integrity`` report."""
    return asyncio.run(server.check_integrity())


def check_failed_prefill_is_recomputed(
    decode: Any, client: Any, reference: LLMEngine, rid: str, prompt: list[int], max_tokens: int
) -> None:
    """A remote prefill whose call fails (``client``: the decode replica's
    ``InProcessPrefill``) is recomputed on ``decode`` with one engine's tokens, counted as a
    fallback, and the replica ends idle."""
    client.fail = RuntimeError("ActorDiedError: the prefill replica died")
    before = decode.counters().fallbacks
    try:
        chunks = asyncio.run(collect(decode, request(rid, prompt, max_tokens)))
    finally:
        client.fail = None
    assert chunks[0].prefill_location == "fallback"
    assert tokens(chunks) == greedy_tokens(reference, prompt, max_tokens)
    assert decode.counters().fallbacks == before + 1
    assert integrity(decode).idle
