"""``pdserve.bench.serve`` against a scripted OpenAI-compatible server (a real HTTP server on
127.0.0.1 streaming SSE with known delays), and its statistics on known numbers."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from pdserve.bench.serve import Endpoint, RunOptions, main, run_endpoint, send_request
from pdserve.bench.serve_metrics import RequestRecord, summarize
from pdserve.bench.serve_workload import LengthDist, PromptBuilder, build_workload
from pdserve.engine.testmodel import ensure_test_model
from tests.bench.fake_openai import FAIL_AT, ITL_S, TTFT_S


def test_percentiles_and_attainment_on_known_numbers() -> None:
    records = []
    for i in range(100):
        ttft = (i + 1) / 1000  # 1..100 ms
        # 11 tokens: tpot = (e2e - ttft) / 10 = 2 ms for even i, 20 ms for odd i
        e2e = ttft + (0.02 if i % 2 == 0 else 0.2)
        records.append(RequestRecord(i, 10, output_tokens=11, ok=True, ttft=ttft, e2e=e2e,
                                     itl=[0.001 * (i % 10)]))  # fmt: skip
    records.append(RequestRecord(100, 10, ok=False, error="HTTP 503: busy"))
    s = summarize("x", records, 10.0, slo_ttft_s=0.050, slo_tpot_s=0.010)
    assert (s.completed, s.failed) == (100, 1)
    assert s.ttft.p50 == pytest.approx(0.0505)  # numpy linear interpolation of 1..100 ms
    assert s.ttft.p90 == pytest.approx(0.0901)
    assert s.ttft.p99 == pytest.approx(0.09901)
    assert s.ttft.mean == pytest.approx(0.0505)
    assert s.tpot.p50 == pytest.approx(0.011)  # half 2 ms, half 20 ms
    assert s.itl.count == 100 and s.itl.p50 == pytest.approx(0.0045)
    assert s.total_output_tokens == 1100 and s.output_throughput == pytest.approx(110.0)
    assert s.request_throughput == pytest.approx(10.0)
    assert s.ttft_attainment == pytest.approx(50 / 101)  # ttft <= 50 ms; the failure misses
    assert s.tpot_attainment == pytest.approx(50 / 101)
    assert s.slo_attainment == pytest.approx(25 / 101)  # even i among the first 50
    assert s.errors == {"HTTP 503: busy": 1}


def test_length_distributions_and_exact_prompt_lengths(tokenizer) -> None:
    rng = random.Random(0)
    mix = LengthDist.parse("mix:8:300:0.25")
    draws = [mix.sample(rng) for _ in range(2000)]
    assert set(draws) == {8, 300} and 0.2 < draws.count(300) / 2000 < 0.3
    uni = LengthDist.parse("uniform:5:9")
    assert {uni.sample(rng) for _ in range(500)} == {5, 6, 7, 8, 9}
    for bad in ("fixed:0", "uniform:9:5", "mix:1:2:1.5", "normal:3", "fixed:x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)
    builder = PromptBuilder(tokenizer, rng)
    for n in (1, 17, 128):
        text, got = builder.build(n)
        assert got == n
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == n


def test_poisson_run_reports_what_the_server_did(fake_server, tokenizer) -> None:
    fake, url = fake_server
    fake.bodies.clear()
    workload = build_workload(
        tokenizer,
        num_requests=8,
        prompt_len=LengthDist.parse("uniform:16:48"),
        output_len=LengthDist.parse("fixed:6"),
        rate=20.0,
        seed=1,
    )
    records, duration = asyncio.run(
        run_endpoint(Endpoint.parse(f"f={url}"), workload, RunOptions(api="chat"))
    )
    assert all(r.ok for r in records), [r.error for r in records]
    # The prompts had the exact token counts the workload promised.
    for req, body in zip(workload, fake.bodies, strict=True):
        assert body["messages"][0]["content"] == req.prompt
        assert body["ignore_eos"] is True and body["max_completion_tokens"] == 6
        assert body["stream_options"] == {"include_usage": True}
        assert len(tokenizer(req.prompt, add_special_tokens=False)["input_ids"]) == (
            req.prompt_tokens
        )
    # Sent on the Poisson schedule (not all at once, not serialised).
    for req, rec in zip(workload, records, strict=True):
        assert rec.send_time == pytest.approx(req.send_at, abs=0.15)
    s = summarize("f", records, duration)
    assert s.total_output_tokens == 8 * 6  # from usage, not the 3 chunks per request
    assert s.total_prompt_tokens == 8 * 7  # server-reported prompt tokens
    # TTFT ignores the empty role chunk that arrives immediately.
    assert TTFT_S <= s.ttft.p50 < TTFT_S + 0.25
    assert s.itl.count == 8 * 2 and ITL_S <= s.itl.p50 < ITL_S + 0.2
    expected_tpot = 2 * ITL_S / 5  # 6 tokens: 2 gaps of ITL_S spread over 5 tokens
    assert expected_tpot <= s.tpot.p50 < expected_tpot + 0.05


def test_runs_are_bounded_in_time_and_concurrency(fake_server, tokenizer) -> None:
    fake, url = fake_server
    endpoint = Endpoint.parse(f"f={url}")
    workload = build_workload(
        tokenizer,
        num_requests=12,
        prompt_len=LengthDist.parse("fixed:8"),
        output_len=LengthDist.parse("fixed:4"),
        rate=4.0,
        seed=3,
    )
    bounded = RunOptions(max_duration_s=1.0)
    records, _ = asyncio.run(run_endpoint(endpoint, workload, bounded))
    expected = [r.index for r in workload if r.send_at < 1.0]
    assert [r.index for r in records] == expected and len(expected) < len(workload)
    fake.max_in_flight = 0
    records, duration = asyncio.run(
        run_endpoint(endpoint, workload, RunOptions(concurrency=2, max_duration_s=60))
    )
    assert len(records) == 12 and all(r.ok for r in records)
    assert fake.max_in_flight == 2
    # 12 requests two at a time, each at least TTFT_S + ITL_S long
    assert duration >= 6 * (TTFT_S + ITL_S)


def test_errors_and_http_failures_are_recorded(fake_server) -> None:
    _, url = fake_server

    async def go() -> tuple[RequestRecord, RequestRecord]:
        async with httpx.AsyncClient() as client:
            mid = await send_request(
                client, f"{url}/v1/completions",
                {"model": "fake", "prompt": "x", "max_tokens": FAIL_AT, "stream": True},
                RequestRecord(0, 1), 10.0,
            )  # fmt: skip
            missing = await send_request(
                client, f"{url}/v1/nope", {"prompt": "x"}, RequestRecord(1, 1), 10.0
            )
        return mid, missing

    mid, missing = asyncio.run(go())
    assert not mid.ok and "replica died" in mid.error
    assert not missing.ok and "HTTP 404" in missing.error


def test_cli_compares_endpoints_and_writes_json_and_png(fake_server, tmp_path, capsys) -> None:
    _, url = fake_server
    model_dir = str(ensure_test_model("tiny"))
    code = main([
        "--endpoint", f"first={url}", "--endpoint", f"second={url}/v1",
        "--tokenizer", model_dir, "--num-requests", "6", "--concurrency", "3",
        "--prompt-len", "fixed:32", "--output-len", "fixed:4",
        "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000",
        "--out-dir", str(tmp_path), "--save-requests",
    ])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "summary.json").read_text())
    assert [s["endpoint"] for s in report["summaries"]] == ["first", "second"]
    for s in report["summaries"]:
        assert s["completed"] == 6 and s["failed"] == 0
        assert s["total_output_tokens"] == 24 and s["slo_attainment"] == 1.0
        assert s["ttft"]["p50"] >= TTFT_S
    assert len(report["requests"]["first"]) == 6
    png = (tmp_path / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    table = capsys.readouterr().out
    assert "TTFT p99 (ms)" in table and "first" in table and "second" in table
