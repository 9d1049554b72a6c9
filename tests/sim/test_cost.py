"""The cost models: roofline arithmetic from datasheet numbers, measured-profile
interpolation, KV capacity and transfer times."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from pdserve.sim.cost import (
    LoopOverheadCost,
    ProfileCost,
    StepProfile,
    loop_overhead_s,
    prefill_tokens_per_s,
    roofline,
)
from pdserve.sim.hardware import GPUS, MODELS


def test_llama3_shapes_match_their_published_sizes() -> None:
    assert MODELS["llama-3-8b"].params == pytest.approx(8.03e9, rel=0.01)
    assert MODELS["llama-3-70b"].params == pytest.approx(70.6e9, rel=0.01)
    # 2 (K and V) x layers x kv heads x head dim x 2 bytes
    assert MODELS["llama-3-8b"].kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert MODELS["llama-3-70b"].kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_decode_is_bandwidth_bound_and_long_prefill_compute_bound() -> None:
    cost = roofline("llama-3-8b", "h100")
    m, gpu, eff = MODELS["llama-3-8b"], GPUS["h100"], cost.eff
    one = cost.step_s(1, 0.0, 1, 1000)
    traffic = m.weight_bytes + m.kv_bytes_per_token * 1001
    assert one == pytest.approx(traffic / (gpu.hbm_bytes_per_s * eff.mbu) + eff.step_overhead_s)
    # A decode batch of 32 costs little more than a batch of 1 (weights are read once)...
    assert cost.step_s(32, 0.0, 32, 32 * 1000) < 1.3 * one
    # ...while a long prefill costs in proportion to its tokens.
    t4k, t8k = cost.step_s(4096, 0.0, 0, 0), cost.step_s(8192, 0.0, 0, 0)
    assert t8k - cost.eff.step_overhead_s == pytest.approx(
        2 * (t4k - cost.eff.step_overhead_s), rel=0.02
    )


def test_faster_memory_and_more_gpus_make_decode_faster() -> None:
    args = (64, 0.0, 64, 64 * 2000)
    h100, h200 = roofline("llama-3-8b", "h100"), roofline("llama-3-8b", "h200")
    over = h100.eff.step_overhead_s
    ratio = (h100.step_s(*args) - over) / (h200.step_s(*args) - over)
    assert ratio == pytest.approx(4.8 / 3.35, rel=1e-6)
    assert roofline("llama-3-70b", "h100", tp=8).step_s(*args) < roofline(
        "llama-3-70b", "h100", tp=4
    ).step_s(*args)


def test_kv_capacity_is_what_memory_leaves_after_the_weights() -> None:
    cost = roofline("llama-3-8b", "h100")
    m, eff = MODELS["llama-3-8b"], cost.eff
    free = 80e9 * eff.memory_utilization - eff.activation_reserve_bytes - m.weight_bytes
    assert cost.kv_capacity_tokens == int(free // m.kv_bytes_per_token)
    assert roofline("llama-3-8b", "l4").kv_capacity_tokens < cost.kv_capacity_tokens / 10
    with pytest.raises(ValueError, match="does not fit"):
        roofline("llama-3-70b", "h100", tp=1)
    with pytest.raises(ValueError, match="unknown gpu 'b300'"):
        roofline("llama-3-8b", "b300")


def test_kv_transfer_time_follows_the_link() -> None:
    n = 4096
    nvl = roofline("llama-3-8b", "h100", link="nvlink").transfer_s(n)
    ib = roofline("llama-3-8b", "h100", link="infiniband").transfer_s(n)
    eth = roofline("llama-3-8b", "h100", link="ethernet").transfer_s(n)
    data = n * MODELS["llama-3-8b"].kv_bytes_per_token
    assert ib == pytest.approx(data / 50e9 + 32 * 5e-6)
    assert nvl < ib < eth
    assert eth == pytest.approx(data / 12.5e9 + 32 * 50e-6)


def _profile(**kw: object) -> StepProfile:
    base = dict(
        token_points=(1, 10, 100),
        token_seconds=(0.010, 0.020, 0.200),
        attn_s_per_pair=1e-7,
        ctx_s_per_token=1e-6,
        kv_bytes_per_token=1000,
        kv_capacity_tokens=5000,
        transfer_bytes_per_s=1e9,
        transfer_latency_s=0.002,
    )
    return StepProfile(**(base | kw))  # type: ignore[arg-type]


def test_profile_interpolates_between_points_and_extrapolates_past_them() -> None:
    cost = ProfileCost(_profile())
    assert cost.tokens_s(10) == pytest.approx(0.020)
    assert cost.tokens_s(55) == pytest.approx(0.110)
    assert cost.tokens_s(200) == pytest.approx(0.400)  # along the last segment
    assert cost.step_s(100, 5000.0, 0, 0) == pytest.approx(0.200 + 5000 * 1e-7)
    assert cost.step_s(8, 0.0, 8, 800) == pytest.approx(cost.tokens_s(8) + 800e-6)
    assert cost.transfer_s(1000) == pytest.approx(0.002 + 1e-3)


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(asdict(_profile()) | {"raw": {"ignored": 1}}))
    assert StepProfile.load(path) == _profile()
    with pytest.raises(ValueError, match="increase"):
        _profile(token_points=(10, 1, 100))


def test_prefill_rate_accounts_for_chunks_and_attention() -> None:
    cost = ProfileCost(_profile())
    # 200 tokens in chunks of 100: two steps of 0.2 s plus their attention pairs.
    pairs = 100 * 50 + 100 * 150
    assert prefill_tokens_per_s(cost, 200, 100) == pytest.approx(200 / (0.4 + pairs * 1e-7))


def test_the_engine_loop_overhead_is_the_one_at_a_time_tpot_less_the_profiled_step() -> None:
    profile = StepProfile(
        token_points=(1, 64),
        token_seconds=(0.010, 0.050),
        attn_s_per_pair=0.0,
        ctx_s_per_token=1e-5,
        kv_bytes_per_token=1,
        kv_capacity_tokens=1000,
        transfer_bytes_per_s=1e9,
        transfer_latency_s=0.001,
    )
    cost = ProfileCost(profile)
    # 64-token prompts, 49 tokens: decodes at a mean context of 64 + 24.5 -> 88 tokens,
    # 10 ms + 88 x 10 us = 10.88 ms a step; the client saw 12.5 ms between tokens.
    assert loop_overhead_s(cost, 0.0125, 64, 49) == pytest.approx(0.0125 - 0.01088)
    assert loop_overhead_s(cost, 0.009, 64, 49) == 0.0  # never negative
    loop = LoopOverheadCost(cost, 0.002)
    assert loop.step_s(1, 0.0, 1, 88) == pytest.approx(0.01088 + 0.002)
    assert loop.step_s(64, 0.0, 0, 0) == pytest.approx(0.052)  # every step, prefill too
    assert loop.step_s(0, 0.0, 0, 0) == 0.0  # no step, no overhead
    assert loop.kv_capacity_tokens == 1000 and loop.transfer_s(10) == cost.transfer_s(10)
