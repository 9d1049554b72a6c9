"""The simulator's prefix caches and multi-turn conversations: the live prefix index learns
what the simulated caches hold from their KV events, a follow-up turn goes back to its
conversation's decode replica, the prefill computes only what it lacks and only the
blocks the decode side lacks cross the link; and on a multi-turn workload prefix-aware
routing hits more and moves less KV than prefix-blind routing."""

from __future__ import annotations

import pytest

from pdserve.deployments.config import AppConfig
from pdserve.deployments.prefix_index import PrefixIndex
from pdserve.sim.cluster import SimCluster
from pdserve.sim.config import SimSettings
from pdserve.sim.cost import roofline
from pdserve.sim.multiturn import main as multiturn_main
from pdserve.sim.multiturn import run_mode, with_routing
from pdserve.sim.prefix import ConversationSpec, SimPrefixCache, chain, multiturn_requests
from pdserve.sim.request import SimRequest
from pdserve.sim.scenario import gpu_app
from tests.sim.fakes import LinearCost

NO_NETWORK = SimSettings(rpc_s=0.0, ingress_s=0.0)


def test_cache_evicts_least_recently_used_and_its_events_reach_the_live_index() -> None:
    cache, index = SimPrefixCache(capacity_blocks=3), PrefixIndex(history_ttl_s=0.0)
    cache.insert([1, 2, 3])
    assert cache.held_blocks([1, 2, 9]) == 2  # touches 1 and 2: 3 is now the oldest
    cache.insert([4])
    assert sorted(cache.hashes()) == [1, 2, 4]
    index.apply("r", cache.publisher.publish())
    assert index.matched_blocks("r", [1, 2, 4]) == 3
    assert index.matched_blocks("r", [1, 2, 3]) == 2  # 3 was evicted, and the index knows
    with pytest.raises(ValueError, match="capacity_blocks"):
        SimPrefixCache(0)


def test_a_turns_chain_extends_the_previous_turns_and_shares_the_system_prompt() -> None:
    spec = ConversationSpec(
        conversation_rate=1.0, num_conversations=6, min_turns=3, max_turns=3, system_len=64,
        num_system_prompts=1, context_len=(40, 40), user_len=(10, 30), output_len=(5, 9),
        think_s=2.0, seed=1,
    )  # fmt: skip
    reqs = multiturn_requests(spec, block_size=16)
    assert [r.rid for r in reqs] == list(range(18))
    assert reqs == sorted(reqs, key=lambda r: r.arrival)
    by_conv: dict[int, list[SimRequest]] = {}
    for r in reqs:  # block 4 onwards is the conversation's own
        by_conv.setdefault(r.block_hashes[4], []).append(r)
    assert len(by_conv) == 6
    for turns in by_conv.values():
        assert [r.turn for r in turns] == [1, 2, 3]
        for a, b in zip(turns, turns[1:], strict=False):
            assert b.prompt_tokens > a.prompt_tokens and b.arrival >= a.arrival
            assert b.block_hashes[: len(a.block_hashes)] == a.block_hashes
            assert len(b.block_hashes) == (b.prompt_tokens - 1) // 16
    # Every conversation opens with the same 4 blocks of the one system prompt.
    assert len({r.block_hashes[:4] for r in reqs}) == 1
    assert chain(0, 0, 64, 17, 16) == chain(0, 1, 64, 17, 16)  # inside the system prompt
    assert chain(0, 0, 0, 33, 16) != chain(0, 1, 0, 33, 16)


def _app(prefix_aware: bool) -> AppConfig:
    return AppConfig.from_dict({
        "prefill": {"min_replicas": 1, "max_replicas": 1,
                    "engine": {"max_num_batched_tokens": 2048}},
        "decode": {"min_replicas": 2, "max_replicas": 2},
        "policy": {"mode": "always_remote"},
        "router": {"stats_period_s": 0.5, "default_prefill_tokens_per_s": 1000.0,
                   "prefix_aware": prefix_aware},
        "autoscaling": False,
    })  # fmt: skip


def _turn(rid: int, at: float, prompt: int, conversation: int, output: int = 4) -> SimRequest:
    req = SimRequest(rid, at, prompt, output)
    req.block_hashes = chain(0, conversation, 0, prompt, 16)
    return req


def _turns() -> tuple[SimRequest, SimRequest, SimRequest]:
    return _turn(0, 0.0, 1000, 0), _turn(1, 1.6, 200, 1, output=500), _turn(2, 2.1, 1100, 0)


def test_a_follow_up_returns_to_its_replica_and_sends_only_the_missing_blocks() -> None:
    # Conversation 0 opens (1000 tokens: 62 full blocks); conversation 1 decodes on the
    # same replica (prefilled 1.6-1.8 s, 500 tokens) when conversation 0's second turn
    # (1100 tokens) arrives.
    first, other, follow = _turns()
    cluster = SimCluster(_app(True), LinearCost(0.001), LinearCost(0.001), NO_NETWORK)
    cluster.run([first, other, follow])
    assert all(r.finished_at is not None for r in (first, other, follow))
    assert cluster.routes[follow.rid][0] == cluster.routes[first.rid][0]
    assert cluster.routes[other.rid][0] == cluster.routes[first.rid][0]
    # The prefill replica holds the first turn's 62 blocks: it computes 1100 - 992 tokens,
    # in 0.108 s at 1 ms per token (the next 1 ms decode step there brings the token out).
    assert follow.cached_tokens == 992 and first.cached_tokens == 0
    assert follow.ttft == pytest.approx(0.108, abs=0.003)
    # The decode replica holds those 62 blocks too: only the rest crosses.
    assert cluster.kv_transfer_tokens == 1000 + 200 + (1100 - 992)
    assert cluster.prefix_reasons["decode", "prefix"] == 1


def test_blind_routing_recomputes_and_resends_a_follow_up_elsewhere() -> None:
    first, other, follow = _turns()
    cluster = SimCluster(_app(False), LinearCost(0.001), LinearCost(0.001), NO_NETWORK)
    cluster.run([first, other, follow])
    # Blind, the decode replica busy with conversation 1 loses to the idle one, which lacks the
    # history: all 1100 tokens cross, though the one prefill replica still has its hit.
    assert cluster.routes[follow.rid][0] != cluster.routes[first.rid][0]
    assert follow.cached_tokens == 992
    assert cluster.kv_transfer_tokens == 1000 + 200 + 1100
    assert not cluster.prefix_reasons


def test_at_cluster_scale_aware_routing_hits_more_and_moves_less_kv(tmp_path, capsys) -> None:
    cost = roofline("llama-3-8b", "h100")
    spec = ConversationSpec(
        conversation_rate=4.0, num_conversations=60, min_turns=3, max_turns=5,
        system_len=1024, num_system_prompts=4, context_len=(1000, 2000), user_len=(50, 150),
        output_len=(20, 60), think_s=5.0, seed=2,
    )  # fmt: skip
    base = gpu_app(8, 8, ttft_ms=500, tpot_ms=50, cost=cost)
    aware, blind = (
        run_mode(with_routing(base, on), multiturn_requests(spec, 16), cost, name)
        for on, name in ((True, "aware"), (False, "blind"))
    )
    for row in (aware, blind):
        assert row["completed"] == row["num_requests"]
    assert aware["hit_rate_later_turns"] > blind["hit_rate_later_turns"] + 0.2
    assert aware["kv_bytes_per_request"] < 0.7 * blind["kv_bytes_per_request"]
    assert aware["busy_gpu_seconds_per_1k"]["prefill"] < blind["busy_gpu_seconds_per_1k"]["prefill"]
    assert aware["ttft_later_turns"]["p50"] < blind["ttft_later_turns"]["p50"]
    # The command line runs the same comparison and writes its JSON.
    code = multiturn_main([
        "--rates", "10", "--conversations", "20", "--prefill", "2", "--decode", "2",
        "--out-dir", str(tmp_path),
    ])  # fmt: skip
    assert code == 0 and (tmp_path / "multiturn.json").is_file()
    assert "aware" in capsys.readouterr().out
