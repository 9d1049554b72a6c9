"""The simulated cluster drives pdserve's live routers, policy and autoscaling policies.

The first test is small enough to compute by hand: two prefill replicas behind the live
TTFT-aware router, one decode replica, 1 ms per token, no network. Stats are published
only at t=0 (all zeros), so the router ranks by its own in-flight books alone.
"""

from __future__ import annotations

import pytest

from pdserve.deployments.config import AppConfig
from pdserve.sim.cluster import AdmissionQuery, LiveAdmission, SimCluster
from pdserve.sim.config import SimSettings
from pdserve.sim.cost import roofline
from pdserve.sim.request import SimRequest
from pdserve.sim.scenario import gpu_app, simulate
from pdserve.sim.workload import generate
from tests.sim.fakes import LinearCost

NO_NETWORK = SimSettings(rpc_s=0.0, ingress_s=0.0)


def _app(**over: object) -> AppConfig:
    base: dict[str, object] = {
        "prefill": {
            "min_replicas": 2,
            "max_replicas": 2,
            "engine": {"max_num_batched_tokens": 2048},
        },
        "decode": {"min_replicas": 1, "max_replicas": 1},
        "policy": {"mode": "always_remote"},
        "router": {"stats_period_s": 1000.0, "default_prefill_tokens_per_s": 1000.0},
        "autoscaling": False,
    }
    return AppConfig.from_dict(base | over)


def test_live_prefill_router_places_by_its_inflight_tokens_hand_computed() -> None:
    a = SimRequest(0, 0.00, prompt_tokens=1000, output_tokens=2)
    b = SimRequest(1, 0.10, prompt_tokens=100, output_tokens=2)
    c = SimRequest(2, 0.15, prompt_tokens=100, output_tokens=2)
    cluster = SimCluster(_app(), LinearCost(0.001), LinearCost(0.001), NO_NETWORK)
    cluster.run([a, b, c])
    # a: both replicas predict 1000/1000 s: a tie keeps the input order -> prefill-1.
    # b: prefill-1 has 1000 tokens in flight (1.1 s) vs prefill-2's 0.1 s -> prefill-2.
    # c: prefill-1 1.1 s vs prefill-2 (b's 100 in flight + 100) 0.2 s -> prefill-2.
    assert [cluster.routes[r.rid] for r in (a, b, c)] == [
        ("decode-3", "prefill-1"),
        ("decode-3", "prefill-2"),
        ("decode-3", "prefill-2"),
    ]
    # b prefills 0.10-0.20 on prefill-2, c queues behind it: 0.20-0.30. Each lands on the
    # decode replica, whose next step (one decode, 1 ms) carries its first token out.
    # a prefills 0.0-1.0 on prefill-1.
    assert b.ttft == pytest.approx(0.101, abs=1e-12)
    assert c.ttft == pytest.approx(0.151, abs=1e-12)
    assert a.ttft == pytest.approx(1.001, abs=1e-12)
    assert [r.placement for r in (a, b, c)] == ["remote"] * 3
    # Every book the live code keeps is balanced again.
    assert cluster.ingress_books.by_replica == {}
    decode = cluster.pools["decode"][0]
    assert decode.prefill_books.by_replica == {}
    assert decode.estimate is not None and decode.estimate.in_flight_tokens == 0
    assert all(r.engine.idle and r.engine.used_blocks == 0 for r in cluster.pools["prefill"])


class AdmitWhileFewer:
    """Admits while the replica holds at most ``limit`` requests (this one included)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen: list[AdmissionQuery] = []
        self.firsts: list[int] = []
        self.done: list[int] = []

    def admit(self, q: AdmissionQuery) -> bool:
        self.seen.append(q)
        return q.ongoing <= self.limit

    def taken_in(self, request: SimRequest) -> None:
        pass

    def first_token(self, request: SimRequest, now: float) -> None:
        self.firsts.append(request.rid)

    def finished(self, request: SimRequest) -> None:
        self.done.append(request.rid)


def test_an_admission_plugs_in_after_the_policy_and_hears_what_became_of_requests() -> None:
    admission = AdmitWhileFewer(2)
    reqs = [SimRequest(i, i * 0.001, prompt_tokens=50, output_tokens=4) for i in range(4)]
    cluster = SimCluster(
        _app(policy={"mode": "always_local"}), LinearCost(), LinearCost(), NO_NETWORK, admission
    )
    cluster.run(reqs)
    assert [r.placement for r in reqs] == ["local", "local", "shed", "shed"]
    # Each arrives while the ones before are still running (Serve counts them ongoing).
    assert [q.ongoing for q in admission.seen] == [1, 2, 3, 3]
    assert all(q.decision.location == "local" for q in admission.seen)
    assert sorted(admission.firsts) == sorted(admission.done) == [0, 1]


def test_the_live_admission_control_runs_in_the_simulator() -> None:
    app = _app(
        prefill={"min_replicas": 0, "max_replicas": 1},
        policy={"mode": "always_local"},
        admission={"on_slo_miss": "shed", "shed_ttft_factor": 1.0},
        slo={"ttft_ms": 500.0, "tpot_ms": 100.0},
    )
    # A flood: 40 prompts of 100 tokens at once, 0.1 s of prefill each, after one request
    # that measured the prefill rate (a cold replica admits on its prior: "unmeasured").
    warm = SimRequest(40, 0.0, prompt_tokens=100, output_tokens=2)
    reqs = [SimRequest(i, 1.0, prompt_tokens=100, output_tokens=2) for i in range(40)]
    live = LiveAdmission(app)
    SimCluster(app, LinearCost(), LinearCost(), NO_NETWORK, live).run([warm, *reqs])
    admitted = [r for r in reqs if r.placement != "shed"]
    assert 0 < len(admitted) < len(reqs)  # some shed, not all
    # Those it admitted were predicted within the SLO and got their first token in time
    # (the queue ahead of the k-th is k x 0.1 s).
    assert max(r.ttft for r in admitted) <= 0.5 + 0.1


def test_live_autoscaling_grows_the_pools_under_load() -> None:
    cost = roofline("llama-3-8b", "h100")
    app = gpu_app(1, 1, ttft_ms=300, tpot_ms=40, cost=cost, autoscale_to=(8, 8))
    app = app.model_copy(
        update={
            "prefill": app.prefill.model_copy(update={"upscale_delay_s": 2.0}),
            "decode": app.decode.model_copy(update={"upscale_delay_s": 2.0}),
        }
    )
    settings = SimSettings(replica_startup_s=5.0)
    report, cluster = simulate(app, generate("chat", 60, 3000, seed=0), cost, cost, settings)
    peak_p = max(p for _, p, _ in report.timeline)
    assert peak_p > 1  # the prefill policy asked for more replicas and got them
    assert report.completed + report.shed == 3000  # shed only by the live policy, if at all
    assert report.gpu_seconds > 0


def test_prompts_kept_local_by_a_saturated_prefill_pool_scale_decode_jointly() -> None:
    # One prefill replica that cannot grow: the live policy keeps long prompts on the decode
    # replicas. Both the joint (application) policy and the per-deployment decode policy
    # as the app deploys it (with the TTFT SLO) size decode by that local queue.
    cost = roofline("llama-3-8b", "h100")
    runs = {}
    for mode in ("application", "deployment"):
        app = gpu_app(1, 1, ttft_ms=500, tpot_ms=200, cost=cost, autoscale_to=(1, 8))
        app = app.model_copy(
            update={"decode": app.decode.model_copy(update={"upscale_delay_s": 2.0})}
        )
        settings = SimSettings(replica_startup_s=5.0, autoscaling_policy=mode)
        requests = generate("summarisation", 40, 4000, seed=0)
        report, cluster = simulate(app, requests, cost, cost, settings)
        assert cluster.reasons["local", "prefill_pool_saturated"] > 0
        runs[mode] = (max(d for *_, d in report.timeline), report.shed)
    assert runs["application"][0] > 1 and runs["deployment"][0] > 1, runs


def test_remote_prefills_refused_for_kv_room_are_counted_for_the_autoscaler() -> None:
    # The decode replica holds 100 blocks of 16 tokens: the first 1000-token prompt reserves
    # 63 of them, the second finds no room while the first is in flight and prefills here.
    app = _app(decode={"min_replicas": 1, "max_replicas": 1, "engine": {"num_kv_blocks": 100}})
    cluster = SimCluster(app, LinearCost(0.001), LinearCost(0.001), NO_NETWORK)
    reqs = [SimRequest(0, 0.0, 1000, 2), SimRequest(1, 0.01, 1000, 2)]
    seen: list[dict[str, dict[str, float]]] = []
    for t in (0.005, 0.5):  # what the decode pool reports to the autoscaler, before and after
        cluster.loop.at(t, lambda: seen.append(cluster.autoscaler.metrics("decode")))
    cluster.run(reqs)
    assert [r.placement for r in reqs] == ["remote", "local"]
    assert cluster.kv_refused == 1
    assert cluster.reasons["remote", "forced"] == 2  # the policy wanted both remote
    (replica,) = cluster.pools["decode"]
    assert [m["kv_refused_per_s"] for m in seen] == [
        {replica.replica_id: 0.0},
        {replica.replica_id: pytest.approx(0.1)},  # one in the 10 s window
    ]


def test_the_live_estimator_counts_the_prefill_pool_its_prompts_went_to_hand_computed() -> None:
    # Two prefill replicas, each 1000 tokens/s; the live policy decides (SLO 1 s).
    app = _app(
        policy={"mode": "auto", "local_prefill_max_tokens": 16},
        slo={"ttft_ms": 1000.0, "tpot_ms": 100.0},
    )
    reqs = [
        SimRequest(0, 0.00, prompt_tokens=300, output_tokens=2),
        SimRequest(1, 0.01, prompt_tokens=300, output_tokens=2),
        *(SimRequest(i, 1.0, prompt_tokens=600, output_tokens=2) for i in (2, 3, 4)),
    ]
    cluster = SimCluster(app, LinearCost(0.001), LinearCost(0.001), NO_NETWORK)
    (decode,) = cluster.pools["decode"]
    est = decode.estimate
    assert est is not None
    pools: list[tuple[int, float]] = []
    for t in (0.2, 0.5):  # the pool as the decode replica knows it, before and after answers
        cluster.loop.at(t, lambda: pools.append((est.pool_size, est.pool_tokens_per_s())))
    cluster.run(reqs)
    # 0: nothing in flight, 0.3 s -> remote, prefill-1 (a tie keeps the order).
    # 1: no answer yet, one queue: (300 + 300) / 1000 = 0.6 s -> remote; the router's books
    #    hold 300 tokens on prefill-1 -> prefill-2. Both answer by t = 0.31, at 1000 tok/s.
    # 2: nothing in flight, 0.6 s -> remote, prefill-1.
    # 3: 600 in flight over the two replicas: 600 / 2000 + 600 / 1000 = 0.9 s -> remote,
    #    prefill-2 (as one queue, 1.2 s, it would have been kept local).
    # 4: 1200 in flight: 0.6 + 0.6 = 1.2 s misses the SLO; locally 600 / 1000 = 0.6 s.
    assert [cluster.routes[r.rid] for r in reqs] == [
        ("decode-3", "prefill-1"),
        ("decode-3", "prefill-2"),
        ("decode-3", "prefill-1"),
        ("decode-3", "prefill-2"),
        ("decode-3", None),
    ]
    assert cluster.reasons == {
        ("remote", "long_prompt"): 4,
        ("local", "prefill_pool_saturated"): 1,
    }
    assert pools == [(0, pytest.approx(1000.0)), (2, pytest.approx(2000.0))]
    assert est.in_flight_tokens == 0
    # Every answer took exactly its own compute: no overhead was learned.
    assert est.overhead_s == pytest.approx(0.0)


def test_warm_up_sends_one_request_after_the_other_and_is_not_counted() -> None:
    # Each warm-up prompt of 100 tokens prefills remotely in 0.1 s; its KV lands and the
    # next 1 ms decode step sends the first token with the second: done at 0.101 s, when
    # the second is sent (done at 0.202 s).
    w1 = SimRequest(-1, 0.0, prompt_tokens=100, output_tokens=2)
    w2 = SimRequest(-2, 0.0, prompt_tokens=100, output_tokens=2)
    cluster = SimCluster(_app(), LinearCost(0.001), LinearCost(0.001), NO_NETWORK)
    start = cluster.warm_up([w1, w2])
    assert (w1.arrival, w2.arrival) == (0.0, pytest.approx(0.101))
    assert start == pytest.approx(0.202) == w2.finished_at
    assert cluster.counts["remote"] == 0 and not cluster.routes
    # The measured requests then run from there, on the warmed-up cluster.
    a = SimRequest(0, start, prompt_tokens=100, output_tokens=2)
    cluster.run([a])
    assert a.ttft == pytest.approx(0.101) and cluster.counts["remote"] == 1


def test_live_prefill_ranking_from_worked_out_reports_matches_the_per_request_one() -> None:
    import random

    from pdserve.deployments.messages import ReplicaStats
    from pdserve.deployments.routers import (
        PrefillRouterParams,
        predict_from_terms,
        predict_prefill_ttft_s,
        prefill_terms,
        rank_prefill_stats,
        rank_prefill_terms,
    )

    class R:
        def __init__(self, i: int) -> None:
            self.replica_id = f"r{i}"

    rng = random.Random(0)
    fields = ReplicaStats.model_fields
    for trial in range(200):
        p = PrefillRouterParams(
            default_prefill_tokens_per_s=rng.choice([250.0, 1000.0]),
            transfer_bytes_per_s=rng.choice([1e9, 3e9]),
            kv_bytes_per_token=rng.choice([0, 12288]),
        )
        pairs = []
        for i in range(rng.randint(1, 12)):
            if rng.random() < 0.2:
                pairs.append((R(i), None))
                continue
            stats = ReplicaStats.model_validate(
                {
                    k: v
                    for k, v in {
                        "role": "prefill",
                        "queued_prefill_tokens": rng.choice([0, 100, 500, 500]),
                        "prefill_tokens_per_s": rng.choice([0.0, 700.0, 1000.0]),
                        "kv_bytes_per_token": rng.choice([0, 4096]),
                    }.items()
                    if k in fields
                }
            )
            pairs.append((R(i), stats))
        inflight = {f"r{i}": rng.choice([0, 200, 500]) for i in range(12) if rng.random() < 0.5}
        n = rng.choice([1, 100, 500])
        expected = sorted(
            range(len(pairs)),
            key=lambda i: (predict_prefill_ttft_s(pairs[i][1], inflight.get(f"r{i}", 0), n, p), i),
        )
        terms = [(r, prefill_terms(s, p)) for r, s in pairs]
        got = rank_prefill_terms(terms, n, inflight)
        assert [t[0].replica_id for t in got] == [f"r{i}" for i in expected], trial
        assert got == rank_prefill_stats(pairs, n, inflight, p)
        for (r, s), (_, t) in zip(pairs, terms, strict=True):
            f = inflight.get(r.replica_id, 0)
            assert predict_from_terms(t, f, n) == predict_prefill_ttft_s(s, f, n, p)


def test_live_decode_ranking_from_worked_out_reports_matches_the_load_score() -> None:
    import random

    from pdserve.deployments.messages import ReplicaStats
    from pdserve.deployments.routers import (
        DecodeRouterParams,
        decode_load_score,
        decode_terms,
        rank_decode_stats,
        rank_decode_terms,
    )

    class R:
        def __init__(self, i: int) -> None:
            self.replica_id = f"r{i}"

    rng = random.Random(1)
    for trial in range(200):
        p = DecodeRouterParams(
            kv_weight=rng.choice([1.0, 0.5]), batch_weight=rng.choice([1.0, 2.0])
        )
        pairs = []
        for i in range(rng.randint(1, 10)):
            stats = None
            if rng.random() > 0.2:
                stats = ReplicaStats(
                    role="decode",
                    num_running=rng.choice([0, 3, 8]),
                    num_waiting=rng.choice([0, 1]),
                    num_waiting_remote_kv=rng.choice([0, 2]),
                    num_free_blocks=rng.choice([0, 10, 50, 100]),
                    num_total_blocks=rng.choice([0, 100]),
                    max_num_seqs=rng.choice([0, 8, 64]),
                )
            pairs.append((R(i), stats))
        inflight = {f"r{i}": rng.choice([0, 4, 9]) for i in range(10) if rng.random() < 0.5}
        blocks = rng.choice([0, 5, 20, 60])

        keys = []
        for i, (_, stats) in enumerate(pairs):
            fits, score = decode_load_score(stats, inflight.get(f"r{i}", 0), blocks, p)
            keys.append((not fits, score, i))
        expected = [f"r{i}" for *_, i in sorted(keys)]
        terms = [(r, decode_terms(s)) for r, s in pairs]
        got = rank_decode_terms(terms, blocks, inflight, p)
        assert [t[0].replica_id for t in got] == expected, trial
        assert got == rank_decode_stats(pairs, blocks, inflight, p)
