"""The simulator runs the decode server's own admission control: fed the same queue (the
engine's counts, the replica's measurements, the requests it admitted before), the decode
server and the simulator's ``LiveAdmission`` admit or shed each request alike, for the same
reason, with the same predicted TTFT and Retry-After."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from pdserve.deployments.decode_server import DecodeServer
from pdserve.deployments.policy import Decision
from pdserve.engine.stats import EngineStats
from pdserve.sim.cluster import AdmissionQuery, LiveAdmission
from pdserve.sim.request import SimRequest
from tests.deployments.in_process import config, request

LOCAL = Decision("local", "forced", 0.0, None)
NOW = 1000.0


@pytest.fixture(scope="module")
def decode() -> Iterator[DecodeServer]:
    cfg = config(
        policy={"mode": "always_local"},
        slo={"ttft_ms": 1000.0, "tpot_ms": 50.0},
        admission={"on_slo_miss": "shed", "shed_ttft_factor": 1.5},
        decode={"max_ongoing_requests": 16},
    )
    server = DecodeServer(cfg, cfg.model.resolve_path())
    yield server
    server.shutdown()


def queues(idle: EngineStats) -> list[EngineStats]:
    """An idle engine, then queues that a measured and an unmeasured rate make long."""
    return [
        dataclasses.replace(idle, prefill_tokens_per_s=2000.0),
        dataclasses.replace(idle, prefill_tokens_per_s=2000.0, queued_prefill_tokens=2500),
        dataclasses.replace(idle, prefill_tokens_per_s=2000.0, queued_prefill_tokens=9000),
        dataclasses.replace(idle, prefill_tokens_per_s=0.0, queued_prefill_tokens=9000),
        dataclasses.replace(idle, prefill_tokens_per_s=500.0, num_running=8, num_waiting=6),
    ]


def test_the_simulator_and_the_decode_server_decide_alike(decode: DecodeServer) -> None:
    sim = LiveAdmission(decode.cfg)
    assert type(sim.of("decode-0")) is type(decode.admission)  # the live class itself
    idle = decode.engine.stats()
    seen: set[tuple[str, str]] = set()
    admitted: list[str] = []
    i = 0
    for stats in queues(idle):
        for prompt, waited in ((7, 0.0), (120, 0.0), (600, 0.5), (30, 5.0)):
            rid = str(i)
            i += 1
            prompt_ids = list(range(10, 10 + prompt))
            req = request(rid, prompt_ids, max_tokens=16, arrival_time=NOW - waited)
            decode.engine.stats = lambda s=stats: s  # type: ignore[method-assign]
            server = decode._admit(req, LOCAL, 0, NOW)
            sim_req = SimRequest(int(rid), NOW - waited, prompt_tokens=prompt, output_tokens=16)
            query = AdmissionQuery(
                sim_req, NOW, "decode-0", LOCAL, stats, 1, 0.0, 0.0, None, 8, 1000.0
            )
            admits = sim.admit(query)
            # The same action, reason, predicted TTFT and drain time (the client's 429).
            assert sim.last_verdict == server, (stats, prompt, waited)
            assert admits == (server.action == "admit")
            assert sim.of("decode-0").num_open == decode.admission.num_open
            seen.add((server.action, server.reason))
            if admits:
                admitted.append(rid)
                # The engine takes it in: its counts (the next ``stats``) carry it.
                decode.admission.taken_in(rid)
                sim.taken_in(sim_req)
    # Every kind of decision was compared, not only admissions.
    assert {"admitted", "ttft_slo", "unmeasured", "deadline", "queue_full"} <= {r for _, r in seen}
    for rid in admitted:
        decode.admission.finished(rid)
        sim.finished(SimRequest(int(rid), 0.0, prompt_tokens=1, output_tokens=1))
    assert decode.admission.num_open == sim.of("decode-0").num_open == 0
