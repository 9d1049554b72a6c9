"""A real Serve app with API keys and limits: the edge's answers over HTTP, then a bounded
property-based fuzz of its published OpenAPI document (no 5xx, OpenAI error bodies), and the
engine idle afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

from tests.deployments.ingress_harness import ServeApp, running_app, wait_decode_report
from tests.deployments.openapi_fuzz import fuzz

pytestmark = pytest.mark.timeout(600)

KEY = "sk-fuzz-test-key-1"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def app() -> Iterator[ServeApp]:
    with running_app(api={"api_keys": [KEY], "max_body_bytes": MAX_BODY}) as running:
        yield running


@pytest.fixture(scope="module")
def http(app: ServeApp) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app.http_url, timeout=120) as client:
        yield client


def test_edge_answers_over_http(http: httpx.Client) -> None:
    body = {"prompt": "hello", "max_tokens": 2}
    denied = http.post("/v1/completions", json=body)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/health").status_code == 200  # open by default
    assert http.get("/version").json()["version"]
    # The lone surrogate that was a 500, in the model and deep in a message.
    for raw in (
        b'{"model": "\\ud800", "prompt": "x"}',
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
    ):
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        bad = http.post(path, content=raw, headers={**AUTH, "content-type": "application/json"})
        assert bad.status_code == 400 and "surrogate" in bad.json()["error"]["message"]
    ok = http.post("/v1/completions", json={**body, "store": True, "metadata": {}}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert "store, metadata" in ok.headers["warning"]
    big = http.post("/v1/completions", json={"prompt": "x" * MAX_BODY}, headers=AUTH)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    tokens = http.post("/tokenize", json={"prompt": "hello world"}, headers=AUTH).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH).json()
    assert "hello world" in text["prompt"]
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    assert 'pdserve_api_requests_total{model_name="tiny",route="/v1/completions",status="401"}' in (
        metrics.text
    )
    assert 'pdserve_api_pools_ready{model_name="tiny"} 1.0' in metrics.text


def sse_payloads(response: httpx.Response) -> list[dict]:
    lines = [ln.removeprefix("data: ") for ln in response.text.splitlines() if ln]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_n_choices_echo_bias_and_penalties_over_http(http: httpx.Client) -> None:
    greedy = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
    one = http.post("/v1/completions", json=greedy, headers=AUTH).json()
    two = http.post("/v1/completions", json={**greedy, "n": 2}, headers=AUTH).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert {c["text"] for c in two["choices"]} == {one["choices"][0]["text"]}
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # counted once
    assert two["usage"]["completion_tokens"] == 12
    echo = http.post("/v1/completions", json={**greedy, "echo": True}, headers=AUTH).json()
    assert echo["choices"][0]["text"] == greedy["prompt"] + one["choices"][0]["text"]
    # A +100 bias makes greedy decoding pick that token every time.
    tok = http.post("/tokenize", json={"prompt": " fox", "add_special_tokens": False}, headers=AUTH)
    token = tok.json()["tokens"][0]
    biased = {**greedy, "prompt": [5, 6, 7], "logit_bias": {str(token): 100}, "max_tokens": 3}
    out = http.post("/v1/completions", json={**biased, "logprobs": 0}, headers=AUTH).json()
    piece = http.post("/detokenize", json={"tokens": [token]}, headers=AUTH).json()["prompt"]
    assert out["choices"][0]["logprobs"]["tokens"] == [piece] * 3
    # Sampled, seeded choices differ from each other and repeat exactly.
    sampled = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "n": 3,
        "seed": 11,
        "presence_penalty": 1.0,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
        "stream": True,
    }
    runs = []
    for _ in range(2):
        events = sse_payloads(http.post("/v1/chat/completions", json=sampled, headers=AUTH))
        texts = ["", "", ""]
        finished = set()
        for event in events:
            for choice in event["choices"]:
                texts[choice["index"]] += choice["delta"].get("content", "")
                if choice["finish_reason"]:
                    finished.add(choice["index"])
        assert finished == {0, 1, 2}
        runs.append(texts)
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_json_schema_output_streamed_and_not(http: httpx.Client) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "ok", "n"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": "describe yourself"}],
        "temperature": 0,
        "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    whole = http.post("/v1/chat/completions", json=body, headers=AUTH).json()
    text = whole["choices"][0]["message"]["content"]
    assert whole["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), schema)
    events = sse_payloads(
        http.post("/v1/chat/completions", json={**body, "stream": True}, headers=AUTH)
    )
    streamed = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert streamed == text
    mode = {**body, "response_format": {"type": "json_object"}, "temperature": 1.0, "seed": 3}
    out = http.post("/v1/chat/completions", json=mode, headers=AUTH).json()["choices"][0]
    if out["finish_reason"] == "stop":
        assert isinstance(json.loads(out["message"]["content"]), dict)


def test_fuzzed_requests_never_get_a_server_error(app: ServeApp, http: httpx.Client) -> None:
    report = fuzz(app.http_url, headers=AUTH, requests=300, time_budget_s=40.0, timeout_s=60.0)
    print(json.dumps(dict(report.statuses)))
    assert report.total >= 100, report.statuses
    assert not report.failures, "\n".join(report.failures[:10])
    assert any(400 <= s < 500 for s in report.statuses) and 200 in report.statuses
    # Every fuzzed request has finished: the decode replica holds no request and no block.
    report = wait_decode_report(app, lambda r: r.idle, "the fuzzed requests to finish")
    assert report.num_free_blocks == report.num_total_blocks
