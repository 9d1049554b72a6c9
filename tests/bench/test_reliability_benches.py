"""bench.chaos / bench.soak bookkeeping and their client, without a cluster (the runs
themselves: tests/bench/test_chaos_cluster.py and docs/reliability.md)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from pdserve.bench.chaos import Kill, passed, summarize
from pdserve.bench.cluster_probe import DEPLOYMENTS
from pdserve.bench.mixed_load import LoadMix, Outcome, RequestSpec, stream_request
from pdserve.bench.soak import ProcessRow, growth, verdict


def test_the_probe_names_the_apps_deployments() -> None:
    from pdserve.deployments.app import DECODE_DEPLOYMENT, INGRESS_DEPLOYMENT, PREFILL_DEPLOYMENT

    assert DEPLOYMENTS == {
        "prefill": PREFILL_DEPLOYMENT,
        "decode": DECODE_DEPLOYMENT,
        "ingress": INGRESS_DEPLOYMENT,
    }


def test_the_mix_draws_every_kind_of_request_and_checks_its_fractions() -> None:
    mix = LoadMix(max_tokens=(4, 40), multi_n=0.3, json_mode=0.3, disconnect=0.3, seeded=0.5)
    rng = random.Random(0)
    specs = [mix.sample(rng) for _ in range(400)]
    assert {s.kind for s in specs} == {"completion", "chat"}
    assert all(s.kind == "chat" for s in specs if s.json_mode)
    assert 80 < sum(s.n == 2 for s in specs) < 160
    assert 80 < sum(s.disconnect_after is not None for s in specs) < 160
    assert all(4 <= s.max_tokens <= 40 for s in specs)
    body = RequestSpec("chat", "hi", 8, seed=3, n=2, json_mode=True).body("m")
    assert body["response_format"] == {"type": "json_object"} and body["n"] == 2
    assert body["seed"] == 3 and body["temperature"] > 0 and not body["ignore_eos"]
    with pytest.raises(ValueError, match="disconnect"):
        LoadMix(disconnect=1.5)
    with pytest.raises(ValueError, match="json_mode"):
        RequestSpec("completion", "hi", 8, json_mode=True)


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def test_the_client_tells_completed_cut_failed_and_left_streams_apart() -> None:
    """``stream_request`` against a local SSE server: a whole n=2 chat stream with usage, a
    stream that ends in an error chunk after its first token, a 503 before any, and a
    client that leaves mid-stream."""
    from aiohttp import ClientSession, web

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        if prompt == "unavailable":
            error = {"message": "the decode pool is unavailable", "type": "service_unavailable"}
            return web.json_response({"error": error}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(4):
            choices = [{"index": c, "delta": {"content": f"t{i}"}} for c in range(body["n"])]
            await resp.write(_sse({"choices": choices}))
            if prompt == "dies" and i == 1:
                await resp.write(_sse({"error": {"message": "gone", "type": "server_error"}}))
                return resp
        last = [{"index": c, "delta": {}, "finish_reason": "length"} for c in range(body["n"])]
        await resp.write(_sse({"choices": last}))
        await resp.write(_sse({"choices": [], "usage": {"completion_tokens": 4 * body["n"]}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run() -> list[Outcome]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        specs = [
            RequestSpec("chat", "ok", 4, n=2),
            RequestSpec("completion", "dies", 4),
            RequestSpec("completion", "unavailable", 4),
            RequestSpec("chat", "leaves", 4, disconnect_after=2),
        ]
        outs = [Outcome(s, 0.0) for s in specs]
        try:
            async with ClientSession() as client:
                for out in outs:
                    await stream_request(client, f"http://127.0.0.1:{port}", "m", out, 0.0)
        finally:
            await runner.cleanup()
        return outs

    ok, dies, unavailable, leaves = asyncio.run(run())
    assert ok.finished and not ok.failed and not ok.short and ok.completion_tokens == 8
    assert ok.texts == {0: "t0t1t2t3", 1: "t0t1t2t3"}
    assert dies.failed and dies.after_first_token and dies.server_error
    assert unavailable.failed and not unavailable.after_first_token
    assert unavailable.status == 503 and unavailable.server_error
    assert leaves.disconnected and not leaves.failed and not leaves.server_error
    summary = summarize(
        [ok, dies, unavailable, leaves], [Kill(1.0, "decode", "r", 7, 2, 9.5)], {"actor_died": 2}
    )
    assert (summary["completed"], summary["migrated"]) == (1, 2)
    assert summary["failed_before_first_token"] == 1
    assert summary["failed_after_first_token"] == 1
    assert summary["server_errors_5xx"] == 2 and summary["recover_s_max"] == 9.5
    assert not passed(summary, {"idle": True})
    clean = summarize([ok, leaves], [], {})
    assert passed(clean, {"idle": True}) and not passed(clean, {"idle": False})


def _rows(pid: int, start_mib: float, end_mib: float, fds: int = 40) -> list[ProcessRow]:
    """Samples every 10 s for 600 s, RSS rising linearly from ``start_mib`` to ``end_mib``."""
    return [
        ProcessRow(t, "decode", pid, start_mib + (end_mib - start_mib) * t / 600, fds)
        for t in range(0, 610, 10)
    ]


def test_the_soak_verdict_catches_growth_latency_drift_and_held_kv() -> None:
    flat = growth(_rows(1, 500, 505), warmup_s=60, span_s=60)
    assert flat[0]["rss_growth"] < 0.05 and flat[0]["fds_growth"] == 0
    leaking = growth(_rows(2, 500, 600), warmup_s=60, span_s=60)
    assert leaking[0]["rss_growth"] > 0.05

    def done(ended: float, ttft: float) -> Outcome:
        out = Outcome(RequestSpec("completion", "p", 4), ended - 1, status=200, ttft=ttft)
        out.ended, out.finished = ended, True
        return out

    steady = [done(t, 0.5) for t in range(1, 600, 2)]
    good = verdict(steady, flat, {"idle": True}, end_s=600, edge_s=300)
    assert good["passed"] and good["p99_ratio_last_to_first"] == 1.0
    slower = steady[:150] + [done(t, 0.7) for t in range(301, 600, 2)]
    assert not verdict(slower, flat, {"idle": True}, end_s=600, edge_s=300)["p99_stable"]
    assert not verdict(steady, leaking, {"idle": True}, end_s=600, edge_s=300)["rss_flat"]
    assert not verdict(steady, flat, {"idle": False}, end_s=600, edge_s=300)["passed"]
