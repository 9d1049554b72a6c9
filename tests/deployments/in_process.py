"""Prefill and decode servers in one process (no Ray), for the tests that drive them
directly: their config on the tiny model, prompts that prefill locally or remotely, and a
client that collects what the decode server streams."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.deployments.config import AppConfig
from pdserve.deployments.decode_server import DecodeServer
from pdserve.deployments.messages import GenerateChunk, GenerateRequest, SamplingOptions

SHORT = [11, 12, 13, 14, 15, 16, 17]  # 7 tokens: local


def long_prompt(seed: int, n: int) -> list[int]:
    """A distinct prompt per test: a prompt seen before would hit the prefix cache and
    (correctly) be prefilled locally."""
    return [(i * 7 + seed * 101) % 1800 + 20 for i in range(n)]


LONG_A = long_prompt(1, 70)  # 70 tokens: remote
LONG_B = long_prompt(2, 45)


def config(**overrides: Any) -> AppConfig:
    data: dict[str, Any] = {
        "model": {"test_model": "tiny", "dtype": "float32", "device": "cpu"},
        "prefill": {"engine": {"num_kv_blocks": 64, "max_num_seqs": 8}},
        "decode": {"engine": {"num_kv_blocks": 64, "max_num_seqs": 8}},
        "slo": {"ttft_ms": 60_000},
        "transport": {"timeout_s": 3.0},
        "policy": {"local_prefill_max_tokens": 32},
        "observability": {"metrics_enabled": False},
    }
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value}
    return AppConfig.from_dict(data)


def request(rid: str, prompt: list[int], max_tokens: int = 12, **kw: Any) -> GenerateRequest:
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, **kw)


async def collect(decode: DecodeServer, req: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in decode.generate(req)]


async def behind(
    decode: DecodeServer, ahead: GenerateRequest, req: GenerateRequest
) -> list[GenerateChunk]:
    """``req``'s chunks, sent while ``ahead`` is admitted and not yet prefilled: a queue
    ahead of it (an idle replica serves a request whose own work misses the SLO)."""
    first = asyncio.create_task(collect(decode, ahead))
    await asyncio.sleep(0)  # ``ahead`` runs up to its first wait: admitted, prompt queued
    try:
        return await collect(decode, req)
    finally:
        await first


def tokens(chunks: list[GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]
