"""What a prefill replica reports to the autoscaling policy about its demand: the prompt
tokens it must compute per second, so a prefix its cache holds does not count (no Ray: the
real tiny engine on both sides, remote prefill forced)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.deployments.autoscaling import PROMPT_TOKENS_PER_S
from pdserve.deployments.decode_server import DecodeServer
from pdserve.deployments.prefill_server import PrefillServer
from tests.deployments.in_process import LONG_A, collect, config, request, tokens
from tests.deployments.serving_fakes import InProcessPrefill


def test_prefill_replica_counts_only_the_prompt_tokens_it_computes() -> None:
    cfg = config(policy={"mode": "always_remote"})
    model_dir = cfg.model.resolve_path()
    prefill = PrefillServer(cfg, model_dir)
    decode = DecodeServer(cfg, model_dir, prefill=InProcessPrefill(prefill))
    try:
        first = asyncio.run(collect(decode, request("first", LONG_A)))
        assert prefill.record_autoscaling_stats()[PROMPT_TOKENS_PER_S] == pytest.approx(70 / 10)
        # The same 70-token prompt again: the prefill replica holds its first 64 tokens
        # (four full blocks of 16), so only 6 more are demand; the tokens do not change.
        again = asyncio.run(collect(decode, request("again", LONG_A)))
        assert tokens(again) == tokens(first)
        assert again[0].prefill_location == "remote"
        assert again[-1].num_cached_tokens == 64
        assert prefill.record_autoscaling_stats()[PROMPT_TOKENS_PER_S] == pytest.approx(76 / 10)
    finally:
        decode.shutdown()
        prefill.shutdown()


class _PrefillHandle:
    """The prefill pool's ``DeploymentHandle``, recording the methods called on it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, method: str) -> Any:
        calls = self.calls

        class _Method:
            async def remote(self, *args: Any) -> str:
                calls.append(method)
                return "prefill-0"

        return _Method()


def test_a_decode_replica_calls_its_prefill_pool_once_while_it_starts() -> None:
    """A starting decode replica uses its prefill handle once (a cheap read) before any
    request, so the first remote prefill does not wait for the handle's router."""
    from pdserve.deployments.remote_prefill import ServePrefillClient

    cfg = config()
    handle = _PrefillHandle()

    async def start() -> DecodeServer:
        decode = DecodeServer(cfg, cfg.model.resolve_path(), prefill=ServePrefillClient(handle))
        await asyncio.gather(*decode._warmups)
        return decode

    decode = asyncio.run(start())
    try:
        assert handle.calls == ["actor_name"]
    finally:
        decode.shutdown()
