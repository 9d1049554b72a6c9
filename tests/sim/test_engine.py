"""The simulated engine: the real scheduler's policy (chunked prefill under a token budget,
decodes first, preemption by recompute) timed by a cost model, and macro steps that give
the very same times as stepping one by one."""

from __future__ import annotations

import random

import pytest

from pdserve.sim.engine import EngineShape, Seq, SimEngine
from pdserve.sim.events import EventLoop
from pdserve.sim.request import SimRequest
from tests.sim.fakes import LinearCost


def _run(requests: list[SimRequest], shape: EngineShape, macro: bool) -> SimEngine:
    loop = EventLoop()
    engine = SimEngine(
        loop,
        LinearCost(0.001),
        shape,
        on_first_token=lambda s, t: setattr(s.req, "first_token_at", t),
        on_finish=lambda s, t: setattr(s.req, "finished_at", t),
        macro_steps=macro,
    )
    for req in requests:
        loop.at(req.arrival, engine.add, Seq(req))
    loop.run()
    return engine


def test_one_request_prefills_in_chunks_then_decodes() -> None:
    req = SimRequest(0, 0.0, prompt_tokens=100, output_tokens=5)
    engine = _run([req], EngineShape(64, 8, 16, 100), macro=False)
    # Chunks of 64 and 36 tokens (0.064 s + 0.036 s) sample the first token; 4 decodes follow.
    assert req.first_token_at == pytest.approx(0.100)
    assert req.finished_at == pytest.approx(0.104)
    assert engine.used_blocks == 0 and engine.idle


def test_decodes_go_first_and_a_new_prompt_takes_what_the_budget_leaves() -> None:
    a = SimRequest(0, 0.0, prompt_tokens=10, output_tokens=50)
    b = SimRequest(1, 0.0105, prompt_tokens=100, output_tokens=2)
    _run([a, b], EngineShape(64, 8, 16, 100), macro=False)
    # a: prefill 10 ms, then 1 ms decodes. b arrives during the decode step ending at
    # 0.011; from then each step is a's decode + up to 63 of b's tokens (64 ms), twice
    # (63 + 37 tokens: 0.064 + 0.038 s): b's first token at 0.113.
    assert a.first_token_at == pytest.approx(0.010)
    assert b.first_token_at == pytest.approx(0.011 + 0.064 + 0.038)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_macro_steps_give_the_times_of_single_steps(seed: int) -> None:
    def workload() -> list[SimRequest]:
        r = random.Random(seed)
        t = 0.0
        out = []
        for i in range(40):
            t += r.expovariate(20.0)
            out.append(SimRequest(i, t, r.randint(1, 300), r.randint(1, 80)))
        return out

    shape = EngineShape(256, 16, 16, 10_000)
    slow, fast = workload(), workload()
    one = _run(slow, shape, macro=False)
    many = _run(fast, shape, macro=True)
    for a, b in zip(slow, fast, strict=True):
        assert b.first_token_at == pytest.approx(a.first_token_at, abs=1e-9)
        assert b.finished_at == pytest.approx(a.finished_at, abs=1e-9)
    assert one.used_blocks == many.used_blocks == 0


def test_out_of_blocks_preempts_by_recompute_and_everything_finishes() -> None:
    reqs = [SimRequest(i, 0.0, prompt_tokens=30, output_tokens=40) for i in range(4)]
    # 12 blocks of 16 tokens: 4 requests of 70 tokens (5 blocks each) cannot all stay.
    engine = _run(reqs, EngineShape(512, 8, 16, 12), macro=True)
    assert engine.num_preemptions > 0
    assert all(r.finished_at is not None for r in reqs)
    assert engine.used_blocks == 0 and engine.idle


def test_remote_kv_reserves_blocks_and_lands_as_a_decode() -> None:
    loop = EventLoop()
    firsts: dict[int, float] = {}
    engine = SimEngine(
        loop,
        LinearCost(0.001),
        EngineShape(64, 8, 16, 10),
        on_first_token=lambda s, t: firsts.setdefault(s.req.rid, t),
    )
    big = Seq(SimRequest(0, 0.0, prompt_tokens=200, output_tokens=3))
    assert not engine.reserve_remote(big)  # 13 blocks > 10: nothing kept
    assert engine.used_blocks == 0
    seq = Seq(SimRequest(1, 0.0, prompt_tokens=100, output_tokens=3))
    assert engine.reserve_remote(seq)
    assert engine.used_blocks == 7 and engine.stats().num_waiting_remote_kv == 1
    loop.at(0.5, engine.complete_remote, seq)
    loop.run()
    # Landed at 0.5: the first token goes out with the next step (one decode, 1 ms).
    assert firsts == {1: pytest.approx(0.501)}
    assert engine.used_blocks == 0 and engine.idle


def test_output_rate_is_the_decode_tokens_per_second_of_the_step_being_computed() -> None:
    loop = EventLoop()
    engine = SimEngine(loop, LinearCost(0.001), EngineShape(64, 8, 16, 100))
    assert engine.output_rate == 0.0
    for i in range(2):
        engine.add(Seq(SimRequest(i, 0.0, prompt_tokens=10, output_tokens=50)))
    # The first prompt alone (10 ms), then its decode with the second prompt (11 ms: one
    # decode token in that step), then both decoding, 2 tokens per 2 ms step.
    assert engine.step_rate == 0.0  # the first prompt's step streams nothing
    loop.run(until=0.015)
    assert engine.output_rate == pytest.approx(1 / 0.011)
    assert engine.step_rate == pytest.approx(1 / 0.011)
    loop.run(until=0.025)
    assert engine.output_rate == pytest.approx(1000.0)
    assert engine.step_rate == pytest.approx(500.0)  # 2 tokens per step
    loop.run()
    assert engine.output_rate == 0.0 and engine.step_rate == 0.0 and engine.idle


def test_a_one_token_prompt_is_prefilled_and_reports_its_first_token() -> None:
    """A one-token prompt has one token to compute, as a request whose KV landed from a
    prefill replica has; unlike that one, its step samples its first token."""
    req = SimRequest(0, 0.0, prompt_tokens=1, output_tokens=3)
    engine = _run([req], EngineShape(64, 8, 16, 100), macro=False)
    assert req.first_token_at == pytest.approx(0.001)
    assert req.finished_at == pytest.approx(0.003)
    assert engine.prefill_meter.rate > 0 and engine.idle


def test_landed_kv_streams_its_first_token_with_the_next_steps_outputs() -> None:
    """As the live engine: KV that lands while a step runs joins the next step, and its
    first token goes out with that step's outputs, not the running one's."""
    loop = EventLoop()
    engine = SimEngine(
        loop,
        LinearCost(0.001),
        EngineShape(64, 8, 16, 100),
        on_first_token=lambda s, t: setattr(s.req, "first_token_at", t),
        on_finish=lambda s, t: setattr(s.req, "finished_at", t),
        macro_steps=False,
    )
    a = SimRequest(0, 0.0, prompt_tokens=10, output_tokens=50)
    b, one = SimRequest(1, 0.0105, 16, 3), SimRequest(2, 0.0105, 16, 1)
    seqs = {r.rid: Seq(r) for r in (a, b, one)}
    loop.at(0.0, engine.add, seqs[0])
    loop.at(0.0105, lambda: engine.reserve_remote(seqs[1]) and engine.reserve_remote(seqs[2]))
    # Both land during the decode step [0.011, 0.012); the next step is a's and b's decodes.
    loop.at(0.0115, engine.complete_remote, seqs[1])
    loop.at(0.0115, engine.complete_remote, seqs[2])
    loop.run()
    assert b.first_token_at == pytest.approx(0.014)
    assert one.first_token_at == one.finished_at == pytest.approx(0.014)
    assert b.finished_at == pytest.approx(0.016)  # the next step samples its third token
    assert engine.idle and engine.used_blocks == 0
