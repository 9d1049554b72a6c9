"""The OpenAI HTTP API of a real Serve app (ingress -> decode replica -> engine on the tiny
test model), checked with raw HTTP and with the official ``openai`` client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from pdserve.engine.loader import load_tokenizer
from tests.deployments.ingress_harness import (
    MAX_MODEL_LEN,
    ServeApp,
    no_request_held,
    running_app,
    wait_decode_report,
)

pytestmark = pytest.mark.timeout(600)

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def app() -> Iterator[ServeApp]:
    with running_app() as running:
        yield running


@pytest.fixture(scope="module")
def http(app: ServeApp) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app.http_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(app: ServeApp):
    return load_tokenizer(app.model_dir)


@pytest.fixture(scope="module")
def reference_text(app: ServeApp, tokenizer) -> str:
    """What the engine itself generates for PROMPT greedily (12 tokens), outside Serve."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(app.model_dir, num_kv_blocks=64, max_model_len=256)
    ids = tokenizer(PROMPT)["input_ids"]
    engine.add_request("ref", ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    text = None
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                text = out.text
        if text is not None:
            return text
    raise AssertionError("reference generation did not finish")


def sse(response: httpx.Response) -> list[dict | str]:
    """The events of an SSE body: parsed JSON objects, and the literal "[DONE]"."""
    events: list[dict | str] = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def test_readiness_needs_a_running_replica_in_every_pool() -> None:
    from types import SimpleNamespace

    from pdserve.deployments.ingress import pools_ready

    def app_status(**running: int) -> SimpleNamespace:
        deployments = {
            name: SimpleNamespace(replica_states={"RUNNING": n, "STARTING": 1})
            for name, n in running.items()
        }
        return SimpleNamespace(deployments=deployments)

    pools = ["PrefillServer", "DecodeServer"]
    assert pools_ready(app_status(PrefillServer=1, DecodeServer=2), pools)[0]
    ok, why = pools_ready(app_status(PrefillServer=0, DecodeServer=1), pools)
    assert not ok and "PrefillServer" in why
    ok, why = pools_ready(app_status(DecodeServer=1), pools)
    assert not ok and "PrefillServer" in why
    assert not pools_ready(None, pools)[0]


def test_health_ready_and_models(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    err = assert_openai_error(http.get("/v1/models/gpt-4"), 404)
    assert err["code"] == "model_not_found"
    assert_openai_error(http.get("/v1/nowhere"), 404)


def test_completion_returns_the_engines_greedy_text(http, tokenizer, reference_text) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert out["id"].startswith("cmpl-")
    choice = out["choices"][0]
    assert choice["text"] == reference_text
    assert choice["finish_reason"] == "length"
    n_prompt = len(tokenizer(PROMPT)["input_ids"])
    assert out["usage"]["prompt_tokens"] == n_prompt
    assert out["usage"]["completion_tokens"] == 12
    assert out["usage"]["total_tokens"] == n_prompt + 12
    assert "cached_tokens" in out["usage"]["prompt_tokens_details"]


def test_streamed_completion_with_usage(http, tokenizer, reference_text) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse(resp)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert len(chunks) >= 2  # it really streamed
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference_text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["prompt_tokens"] == len(tokenizer(PROMPT)["input_ids"])


def test_stop_string_cuts_the_text(http, reference_text) -> None:
    stop = reference_text[4:7]
    assert stop.strip(), reference_text
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop": [stop]}  # fmt: skip
    out = http.post("/v1/completions", json=body).json()
    assert out["choices"][0]["text"] == reference_text[: reference_text.index(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"


def test_chat_uses_the_template_and_streams(http, tokenizer) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}]
    template_ids = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    body = {"messages": messages, "max_completion_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    full = http.post("/v1/chat/completions", json=body).json()
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["role"] == "assistant"
    assert full["usage"]["prompt_tokens"] == len(template_ids)
    assert full["usage"]["completion_tokens"] == 6

    streamed = http.post(
        "/v1/chat/completions",
        json=body | {"stream": True, "stream_options": {"include_usage": True}},
    )
    events = sse(streamed)
    assert events[-1] == "[DONE]"
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == []
    assert usage["prompt_tokens"] == len(template_ids) and usage["completion_tokens"] == 6
    assert usage["total_tokens"] == len(template_ids) + 6
    # The same prompt again: its full KV blocks came from the prefix cache.
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < len(template_ids)


def test_chat_logprobs_and_seeded_sampling(http) -> None:
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 5,
            "logprobs": True, "top_logprobs": 2, "seed": 7, "temperature": 1.0,
            "ignore_eos": True}  # fmt: skip
    first = http.post("/v1/chat/completions", json=body).json()
    second = http.post("/v1/chat/completions", json=body).json()
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    content = first["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert entry["logprob"] <= 0.0
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "12"}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "guided_json": {}}, "guided_json"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": [1, 2, 99999]}, "prompt"),
        ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ],
)
def test_bad_requests_get_400_with_the_openai_body(http, body, param) -> None:
    assert_openai_error(http.post("/v1/completions", json=body), 400, param)


def test_malformed_json_and_oversized_prompt_then_still_serving(http) -> None:
    bad = http.post(
        "/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}
    )
    assert assert_openai_error(bad, 400)["code"] == "invalid_json"
    long_prompt = {"prompt": list(range(10, 10 + MAX_MODEL_LEN + 5)), "max_tokens": 1}
    err = assert_openai_error(http.post("/v1/completions", json=long_prompt), 400, "prompt")
    assert "maximum context length" in err["message"]
    chat_bad = {"messages": [{"role": "user", "content": 5}]}
    assert_openai_error(http.post("/v1/chat/completions", json=chat_bad), 400)
    vip = {"x-pdserve-priority": "vip"}
    bad_class = http.post("/v1/completions", json={"prompt": "x"}, headers=vip)
    assert_openai_error(bad_class, 400, "x-pdserve-priority")
    ok = http.post(
        "/v1/completions",
        json={"prompt": "still here?", "max_tokens": 2},
        headers={"x-pdserve-priority": "batch"},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_official_openai_client(app: ServeApp, reference_text) -> None:
    client = openai.OpenAI(base_url=f"{app.http_url}/v1", api_key="none", max_retries=0)
    done = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].text == reference_text and done.usage.completion_tokens == 12
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference_text
    assert chunks[-1].usage.completion_tokens == 12
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_completion_tokens=4,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chat_chunks = list(chat)
    assert chat_chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_client_disconnect_aborts_the_request(app: ServeApp, http: httpx.Client) -> None:
    body = {"prompt": "tell me everything", "max_tokens": MAX_MODEL_LEN - 16,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times = []
    with (
        httpx.Client(base_url=app.http_url, timeout=120) as client,  # its own connection
        client.stream("POST", "/v1/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
            if len(times) == 6:
                break
    closed_at = time.monotonic()
    per_chunk = (times[-1] - times[0]) / (len(times) - 1)
    full_run_s = per_chunk * body["max_tokens"]
    report = wait_decode_report(app, no_request_held, "the decode replica to drop the left stream")
    idle_after = time.monotonic() - closed_at
    assert idle_after < full_run_s / 2, (idle_after, full_run_s)
    assert report.num_free_blocks == report.num_total_blocks
