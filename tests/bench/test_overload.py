"""bench/overload.py's bookkeeping (the run itself needs a real cluster: run the module)."""

from __future__ import annotations

import json

from pdserve.bench.overload import (
    Outcome,
    by_decode_replicas,
    client_lag_by_phase,
    replica_changes,
    summarize,
)


def test_client_lag_is_reported_per_phase() -> None:
    phases = [("1x", 1.0, 10.0), ("10x", 10.0, 10.0), ("1x-after", 1.0, 10.0)]
    samples = [(t / 10, 0.001) for t in range(100)] + [(10.0 + t / 10, 0.2) for t in range(100)]
    lag = client_lag_by_phase(samples, phases)
    assert lag["1x"] == {"p99_s": 0.001, "max_s": 0.001}
    assert lag["10x"]["p99_s"] == 0.2
    assert lag["1x-after"] == {"p99_s": None, "max_s": None}  # no sample: nothing claimed


def test_summary_counts_what_the_client_saw() -> None:
    ok = Outcome(
        "10x", "interactive", 1.0, status=200, headers_s=0.5, ttft=0.5, finished=True,
        finish_reason="length",
    )  # fmt: skip
    cut = Outcome("10x", "interactive", 1.1, status=200, headers_s=0.5, ttft=0.6)
    shed = Outcome(
        "10x", "interactive", 1.2, status=429, headers_s=0.05, retry_after="2", refused_by="proxy"
    )
    failed = Outcome("10x", "batch", 1.3, status=503, headers_s=0.01)
    silent = Outcome("10x", "batch", 1.4)
    rows = summarize([ok, cut, shed, failed, silent], slo_s=2.0)
    inter = rows["10x/interactive"]
    assert (inter["sent"], inter["admitted"], inter["shed_429"]) == (3, 2, 1)
    assert inter["lost"] == 1  # admitted but never finished
    assert inter["failed_or_truncated"] == 1  # the cut stream; the 429 is not a failure
    assert inter["shed_with_retry_after"] == 1 and inter["reject_p99_s"] == 0.05
    assert inter["shed_by_proxy"] == 1 and inter["shed_reasons"] == {"proxy": 1}
    batch = rows["10x/batch"]
    assert (batch["5xx"], batch["lost"]) == (1, 1)  # no answer at all is lost
    assert batch["failed_or_truncated"] == 2  # the 503 and the silent one


def test_the_client_reads_streams_429s_and_cut_streams() -> None:
    """``send`` against a local SSE server: a whole stream (TTFT, tokens, finished), a 429
    with Retry-After and the OpenAI body (admission control), one in plain text (Serve's
    proxy), and a stream cut before [DONE] (lost)."""
    import asyncio

    from aiohttp import web

    from pdserve.bench.overload import client_session, send

    def event(text: str, finish: str | None = None) -> bytes:
        choice = {"index": 0, "text": text, "finish_reason": finish}
        return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["prompt"] == "shed":
            error = {"message": "overloaded (ttft_slo): predicted ..."}
            return web.json_response({"error": error}, status=429, headers={"Retry-After": "3"})
        if body["prompt"] == "proxy":
            return web.Response(text="Request dropped", status=429, headers={"Retry-After": "2"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event("a"))
        await resp.write(event("b", "length" if body["prompt"] == "ok" else None))
        if body["prompt"] == "ok":
            await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run() -> list[Outcome]:
        app = web.Application()
        app.router.add_post("/v1/completions", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        outs = [Outcome("x", "interactive", 0.0) for _ in range(4)]
        try:
            async with client_session() as client:
                url = f"http://127.0.0.1:{port}/v1/completions"
                for prompt, out in zip(("ok", "shed", "proxy", "cut"), outs, strict=True):
                    await send(client, url, {"prompt": prompt}, out, 0.0)
        finally:
            await runner.cleanup()
        return outs

    ok, shed, proxy, cut = asyncio.run(run())
    assert ok.status == 200 and ok.finished and ok.tokens == 2 and ok.ttft is not None
    assert not ok.lost and ok.finish_reason == "length" and not ok.truncated
    assert shed.status == 429 and shed.retry_after == "3" and not shed.lost
    assert shed.refused_by == "pdserve" and proxy.refused_by == "proxy"
    assert shed.shed_reason == "ttft_slo"
    # Timed from each request's send, which the session's trace stamped.
    assert all(o.send_wait_s is not None and o.send_wait_s > 0 for o in (ok, shed, proxy, cut))
    assert all(o.headers_s is not None and o.headers_s > 0 for o in (ok, shed, proxy, cut))
    assert cut.status == 200 and cut.tokens == 2 and not cut.finished and cut.lost
    assert cut.truncated


def test_replica_changes_list_the_decode_pool_where_it_changes() -> None:
    samples = [
        {"t": 0.0, "decode": 1, "decode_starting": 0, "decode_stopping": 0},
        {"t": 2.0, "decode": 1, "decode_starting": 0, "decode_stopping": 0},
        {"t": 4.1, "decode": 1, "decode_starting": 1, "decode_stopping": 0},
        {"t": 20.0, "decode": 2, "decode_starting": 0, "decode_stopping": 0},
        {"t": 90.0, "decode": 1, "decode_starting": 0, "decode_stopping": 1},
        {"t": 94.0, "decode": 1, "decode_starting": 0, "decode_stopping": 0},
    ]
    assert replica_changes(samples) == ["0s: 1/0/0", "4s: 1/1/0", "20s: 2/0/0", "90s: 1/0/1",
                                        "94s: 1/0/0"]  # fmt: skip


def test_requests_are_split_where_the_decode_pool_changed_size() -> None:
    def done(sent: float, ttft: float) -> Outcome:
        return Outcome("x", "interactive", sent, status=200, ttft=ttft, finished=True,
                       finish_reason="length")  # fmt: skip

    samples = [{"t": 0.0, "decode": 1}, {"t": 2.0, "decode": 1}, {"t": 10.0, "decode": 2},
               {"t": 20.0, "decode": 1}]  # fmt: skip
    outcomes = [done(1.0, 0.5), done(5.0, 3.0), Outcome("x", "interactive", 6.0, status=429),
                done(12.0, 0.4), Outcome("x", "interactive", 13.0, status=200, ttft=0.2),
                done(25.0, 0.1)]  # fmt: skip
    one, two, back = by_decode_replicas(outcomes, samples, slo_s=2.0)
    assert (one["from_s"], one["decode_replicas"], one["sent"], one["admitted"]) == (0, 1, 3, 2)
    assert one["slo_attainment"] == 0.5 and one["goodput_of_sent"] == 1 / 3
    assert (two["from_s"], two["decode_replicas"], two["failed_or_truncated"]) == (10.0, 2, 1)
    assert (back["decode_replicas"], back["sent"], back["slo_attainment"]) == (1, 1, 1.0)
