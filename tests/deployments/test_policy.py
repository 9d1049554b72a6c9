"""Disaggregation policy: which requests prefill locally or remotely."""

from __future__ import annotations

import pytest

from pdserve.deployments.config import PolicyConfig, SLOConfig
from pdserve.deployments.policy import DisaggregationPolicy, LocalLoad, RemotePrefillEstimator

IDLE = LocalLoad(
    queued_prefill_tokens=0, prefill_tokens_per_s=1000.0, num_running=0, max_num_seqs=8
)


def policy(**overrides: object) -> DisaggregationPolicy:
    cfg = PolicyConfig(**{"local_prefill_max_tokens": 64, **overrides})
    return DisaggregationPolicy(cfg, SLOConfig(ttft_ms=1000, tpot_ms=100), 1000.0)


def fresh_remote() -> RemotePrefillEstimator:
    return RemotePrefillEstimator(default_tokens_per_s=1000.0)


def decide(p: DisaggregationPolicy, prompt: int, cached: int = 0, **kw: object):
    args = {"load": IDLE, "remote": fresh_remote(), **kw}
    return p.decide(num_prompt_tokens=prompt, num_cached_tokens=cached, **args)


def test_short_prompt_is_local_and_long_prompt_is_remote() -> None:
    p = policy()
    assert decide(p, 40).location == "local"
    assert decide(p, 40).reason == "short_prompt"
    long = decide(p, 400)
    assert long.location == "remote" and long.reason == "long_prompt"


def test_cached_prefix_makes_a_long_prompt_local() -> None:
    d = decide(policy(), 400, cached=368)
    assert d.location == "local" and d.reason == "cached_prefix"


def test_saturated_prefill_pool_falls_back_to_local() -> None:
    remote = fresh_remote()
    remote.started(5000)  # 5 s of queued prompts at 1000 tok/s: misses the 1 s SLO
    d = decide(policy(), 400, remote=remote)
    assert d.location == "local" and d.reason == "prefill_pool_saturated"
    assert d.predicted_remote_s == pytest.approx(5.4)
    assert d.predicted_local_s == pytest.approx(0.4)
    # An operator who keeps long prompts off the decode batch whatever the TTFT.
    steady = decide(policy(local_when_saturated=False), 400, remote=remote)
    assert steady.location == "remote" and steady.reason == "long_prompt"
    assert decide(policy(local_when_saturated=False), 40, remote=remote).location == "local"
    remote.finished(5000)
    assert decide(policy(), 400, remote=remote).location == "remote"


def test_busy_decode_replica_does_not_pull_work_local() -> None:
    # Both miss the SLO but remote is faster: stay remote.
    busy = LocalLoad(
        queued_prefill_tokens=9000, prefill_tokens_per_s=1000.0, num_running=8, max_num_seqs=8
    )
    remote = fresh_remote()
    remote.started(2000)
    assert decide(policy(), 400, load=busy, remote=remote).location == "remote"


def test_no_prefill_pool_means_local_and_modes_force_a_side() -> None:
    assert decide(policy(), 4000, remote=None).reason == "no_prefill_pool"
    assert decide(policy(mode="always_remote"), 4).location == "remote"
    assert decide(policy(mode="always_local"), 4000).location == "local"


def test_estimator_learns_rate_and_overhead_from_observations() -> None:
    est = RemotePrefillEstimator(default_tokens_per_s=1000.0, alpha=1.0)
    # 500 tokens at the replica's measured 2000 tokens/s = 0.25 s of the 0.75 s observed.
    est.observe(num_tokens=500, total_s=0.75, tokens_per_s=2000.0)
    assert est.tokens_per_s == pytest.approx(2000.0)
    assert est.overhead_s == pytest.approx(0.5)
    assert est.predict_s(1000) == pytest.approx(1.0)
    # Prompts already in flight are part of the prediction...
    assert est.started(1500) == 0 and est.started(500) == 1500
    assert est.predict_s(1000) == pytest.approx(0.5 + 3000 / 2000)
    # ...so a prompt that waited behind them adds no overhead for that wait (0.75 s queued
    # + 0.25 s computing + the same 0.5 s as before), and the queue is not counted twice.
    est.observe(num_tokens=500, total_s=1.5, tokens_per_s=2000.0, ahead_tokens=1500)
    assert est.overhead_s == pytest.approx(0.5)
    est.finished(1500)
    est.finished(500)
    assert est.predict_s(1000) == pytest.approx(1.0)
    # A failed call reports no rate: the rate stays, its time raises the overhead.
    est.observe(num_tokens=500, total_s=10.25, ahead_tokens=0)
    assert (est.tokens_per_s, est.overhead_s) == (pytest.approx(2000.0), pytest.approx(10.0))
    # The remote-prefill deadline counts only the compute (plus its slack), so timeouts do
    # not lengthen the next deadline and the time to detect a stuck replica stays bounded.
    assert est.compute_s(1000) == pytest.approx(0.5)
    assert est.predict_s(1000) == pytest.approx(10.5)
    with pytest.raises(ValueError, match="alpha"):
        RemotePrefillEstimator(1000.0, alpha=0.0)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        decide(policy(), 0)


def test_the_first_measured_rate_replaces_the_configured_prior() -> None:
    est = RemotePrefillEstimator(default_tokens_per_s=250.0, alpha=0.3)
    assert not est.rate_measured
    est.observe(num_tokens=128, total_s=0.2)  # a failed call reports no rate
    assert (est.tokens_per_s, est.rate_measured) == (250.0, False)
    est.observe(num_tokens=128, total_s=0.2, tokens_per_s=800.0)
    assert (est.tokens_per_s, est.rate_measured) == (pytest.approx(800.0), True)
    est.observe(num_tokens=128, total_s=0.2, tokens_per_s=1000.0)  # then an average
    assert est.tokens_per_s == pytest.approx(0.7 * 800.0 + 0.3 * 1000.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_queue_ahead_drains_over_every_prefill_replica_that_answered() -> None:
    clock = FakeClock()
    est = RemotePrefillEstimator(1000.0, alpha=1.0, pool_window_s=60.0, clock=clock)
    # Answers that name no replica (an older prefill server) leave the pool at one replica.
    est.observe(num_tokens=100, total_s=0.1, tokens_per_s=1000.0)
    assert (est.pool_size, est.pool_tokens_per_s()) == (0, pytest.approx(1000.0))
    # Two replicas answer, at 1000 and 3000 tokens/s (alpha=1: the last rate is the rate).
    est.observe(num_tokens=100, total_s=0.1, tokens_per_s=1000.0, replica="p1")
    clock.now = 10.0
    est.observe(num_tokens=300, total_s=0.1, tokens_per_s=3000.0, replica="p2")
    assert (est.pool_size, est.pool_tokens_per_s()) == (2, pytest.approx(4000.0))
    # 8000 tokens in flight drain at 4000 tokens/s: 2 s; a 600-token prompt then computes
    # on one replica at the last measured 3000 tokens/s: 0.2 s.
    est.started(8000)
    assert est.queue_s() == pytest.approx(2.0)
    assert est.compute_s(600) == pytest.approx(2.2)
    # As one queue at 3000 tokens/s the same 2 s are 6000 tokens (admission's QueueAhead).
    assert est.as_one_queue(8000) == 6000
    # A prompt that waited behind the 8000 tokens and took 2.7 s added 0.5 s of overhead.
    est.observe(num_tokens=600, total_s=2.7, tokens_per_s=3000.0, ahead_tokens=8000, replica="p2")
    assert est.overhead_s == pytest.approx(0.5)
    assert est.predict_s(600) == pytest.approx(2.7)
    # p1 has not answered for longer than the window: the pool is p2 alone again.
    clock.now = 60.5
    assert (est.pool_size, est.pool_tokens_per_s()) == (1, pytest.approx(3000.0))
    assert est.compute_s(600) == pytest.approx((8000 + 600) / 3000)
    clock.now = 200.0  # nobody answered for a while: one queue at the measured rate
    assert (est.pool_size, est.pool_tokens_per_s()) == (0, pytest.approx(3000.0))
    with pytest.raises(ValueError, match="pool_window_s"):
        RemotePrefillEstimator(1000.0, pool_window_s=0.0)


def test_one_prefill_replica_keeps_the_one_queue_estimate() -> None:
    # The small real cluster: every answer comes from the same replica.
    named = RemotePrefillEstimator(1000.0, alpha=0.3)
    anonymous = RemotePrefillEstimator(1000.0, alpha=0.3)
    for rate, total in ((800.0, 0.9), (1200.0, 0.4), (900.0, 1.3)):
        named.observe(num_tokens=400, total_s=total, tokens_per_s=rate, replica="prefill#0")
        anonymous.observe(num_tokens=400, total_s=total, tokens_per_s=rate)
    named.started(2000)
    anonymous.started(2000)
    assert named.pool_size == 1
    assert named.pool_tokens_per_s() == pytest.approx(named.tokens_per_s)
    assert named.predict_s(500) == pytest.approx(anonymous.predict_s(500))
    assert named.as_one_queue(2000) == 2000


def test_a_long_queue_spread_over_the_pool_does_not_saturate_it() -> None:
    # 2000 tokens in flight: as one queue at 1000 tokens/s the 400-token prompt waits 2.4 s
    # (misses the 1 s SLO: kept local); spread over four replicas at 1000 tokens/s each,
    # 0.5 s + 0.4 s = 0.9 s: remote.
    one = fresh_remote()
    one.started(2000)
    assert decide(policy(), 400, remote=one).reason == "prefill_pool_saturated"
    pool = fresh_remote()
    for replica in ("p1", "p2", "p3", "p4"):
        pool.observe(num_tokens=400, total_s=0.4, tokens_per_s=1000.0, replica=replica)
    pool.started(2000)
    d = decide(policy(), 400, remote=pool)
    assert (d.location, d.reason) == ("remote", "long_prompt")
    assert d.predicted_remote_s == pytest.approx(0.9)
