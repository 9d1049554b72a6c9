"""The API's edge without Ray: keys, rate limits, body and request size limits, the
chat-template rule, /tokenize and /detokenize, and the CLI's key merging."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from pdserve.cluster.cli import API_KEYS_ENV, _load_config
from pdserve.deployments.api_guard import APIGuard, read_body
from pdserve.deployments.config import APIConfig, AppConfig
from pdserve.deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    validate_request,
)
from pdserve.deployments.openai_serving import ModelInfo, OpenAIServing, RequestLimits
from pdserve.engine.loader import load_tokenizer
from pdserve.engine.testmodel import ensure_test_model

KEYS = ["sk-first-key-123", "sk-second-key-456"]


def status_of(fn, *args) -> int:
    try:
        fn(*args)
    except OpenAIError as err:
        return err.status_code
    return 200


def test_api_keys_bearer_or_x_api_key_and_open_health() -> None:
    guard = APIGuard(APIConfig(api_keys=KEYS, open_metrics=False))
    call = guard.caller
    assert status_of(call, "/v1/completions", {}, "1.2.3.4") == 401
    assert status_of(call, "/v1/completions", {"authorization": "Bearer nope-nope"}, None) == 401
    assert status_of(call, "/v1/completions", {"authorization": f"Basic {KEYS[0]}"}, None) == 401
    assert call("/v1/completions", {"authorization": f"Bearer {KEYS[0]}"}, None) == "key:0"
    assert call("/v1/completions", {"x-api-key": KEYS[1]}, None) == "key:1"
    assert call("/health", {}, None) is None
    assert status_of(call, "/metrics", {}, None) == 401
    with pytest.raises(OpenAIError) as info:
        call("/v1/models", {}, None)
    assert info.value.body()["error"]["code"] == "invalid_api_key"
    # Without keys every route is open.
    assert APIGuard(APIConfig()).caller("/v1/completions", {}, "h") == "addr:h"


def test_rate_limit_per_key_answers_429_with_retry_after() -> None:
    now = [0.0]
    guard = APIGuard(
        APIConfig(api_keys=KEYS, rate_limit_per_minute=60, rate_limit_burst=2),
        clock=lambda: now[0],
    )
    first = {"authorization": f"Bearer {KEYS[0]}"}
    guard.caller("/v1/completions", first, None)
    guard.caller("/v1/completions", first, None)
    with pytest.raises(OpenAIError) as info:
        guard.caller("/v1/completions", first, None)
    assert info.value.status_code == 429 and info.value.headers() == {"Retry-After": "1"}
    # Another key has its own bucket; the first one refills at 1 request per second.
    guard.caller("/v1/completions", {"x-api-key": KEYS[1]}, None)
    now[0] = 1.0
    guard.caller("/v1/completions", first, None)


def test_body_over_the_limit_is_413_declared_or_not() -> None:
    async def chunks(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield b"x" * 1000

    assert asyncio.run(read_body(chunks(2), "2000", 2000)) == b"x" * 2000
    for declared in ("5000", None):
        with pytest.raises(OpenAIError) as info:
            asyncio.run(read_body(chunks(5), declared, 2000))
        assert info.value.status_code == 413


def test_short_keys_are_refused_without_echoing_them() -> None:
    with pytest.raises(ValueError, match="at least 8") as info:
        AppConfig.from_dict({"api": {"api_keys": ["short"]}})
    assert "short'" not in str(info.value)


def test_cli_merges_flag_and_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, f" {KEYS[1]} ,")
    config = _load_config(None, [KEYS[0]])
    assert isinstance(config, AppConfig) and config.api.api_keys == KEYS
    monkeypatch.delenv(API_KEYS_ENV)
    assert _load_config(None, []).api.api_keys == []


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_test_model("tiny"))


async def _never(_request):  # the decode pool: the limits must stop requests before it
    raise AssertionError("a request past the limits reached the decode pool")
    yield


def serving(tokenizer, **limits) -> OpenAIServing:
    return OpenAIServing(tokenizer, ModelInfo("tiny", 256), _never, limits=RequestLimits(**limits))


def test_prompt_message_and_stop_limits_are_400(tokenizer) -> None:
    s = serving(tokenizer, max_prompt_tokens=4, max_messages=2, max_stop_strings=1)
    long = validate_request(CompletionRequest, {"prompt": [5, 6, 7, 8, 9]})
    stops = validate_request(CompletionRequest, {"prompt": [5], "stop": ["a", "b"]})
    chat = validate_request(ChatCompletionRequest, {"messages": [{"role": "user"}] * 3})
    for req, param in ((long, "prompt"), (stops, "stop"), (chat, "messages")):
        with pytest.raises(OpenAIError) as info:
            asyncio.run(s.start(req))
        assert info.value.status_code == 400 and info.value.param == param


def test_chat_without_a_template_is_a_clear_400_unless_configured(tokenizer) -> None:
    bare = tokenizer.__class__.from_pretrained(ensure_test_model("tiny"))
    bare.chat_template = None
    req = validate_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(OpenAIError) as info:
        serving(bare).chat_request(req, request_id="r")
    assert info.value.code == "chat_template_missing"
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    gen = serving(bare, chat_template=template).chat_request(req, request_id="r")
    assert gen.prompt_token_ids == bare("[hi]", add_special_tokens=False)["input_ids"]


def test_tokenize_and_detokenize_round_trip(tokenizer) -> None:
    s = serving(tokenizer)
    out = s.tokenize(validate_request(TokenizeCompletionRequest, {"prompt": "hello world"}))
    assert out.tokens == tokenizer("hello world")["input_ids"] and out.count == len(out.tokens)
    assert out.max_model_len == 256
    chat = s.tokenize(
        validate_request(TokenizeChatRequest, {"messages": [{"role": "user", "content": "hi"}]})
    )
    assert chat.tokens == s.apply_chat_template([{"role": "user", "content": "hi"}])
    back = s.detokenize(validate_request(DetokenizeRequest, {"tokens": out.tokens}))
    assert back.prompt == tokenizer.decode(out.tokens)
    with pytest.raises(OpenAIError) as info:
        s.detokenize(validate_request(DetokenizeRequest, {"tokens": [len(tokenizer)]}))
    assert info.value.param == "tokens"


def test_sampling_fields_and_generation_config_defaults_reach_the_engine(
    tokenizer, tmp_path
) -> None:
    from pdserve.deployments.sampling_defaults import SamplingDefaults

    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}'
    )
    s = OpenAIServing(
        tokenizer,
        ModelInfo("tiny", 256),
        _never,
        defaults=SamplingDefaults.from_model_dir(tmp_path),
    )
    unset = s.completion_request(
        validate_request(CompletionRequest, {"prompt": "x"}), request_id="a"
    )
    params = unset.sampling.to_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    assert params.repetition_penalty == 1.1 and params.min_p == 0.0
    body = {
        "prompt": "x",
        "temperature": 0,
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.3,
        "logit_bias": {"7": -100, "11": 2.5},
        "min_p": 0.1,
    }
    sent = s.completion_request(validate_request(CompletionRequest, body), request_id="b")
    params = sent.sampling.to_params()
    assert params.temperature == 0.0 and params.repetition_penalty == 1.3
    assert (params.presence_penalty, params.frequency_penalty, params.min_p) == (0.5, -1.0, 0.1)
    assert params.logit_bias == ((7, -100.0), (11, 2.5))
    oov = validate_request(CompletionRequest, {"prompt": "x", "logit_bias": {"99999": 1}})
    with pytest.raises(OpenAIError) as info:
        s.completion_request(oov, request_id="c")
    assert info.value.param == "logit_bias"


def test_response_format_becomes_grammar_fields_or_a_400(tokenizer) -> None:
    s = serving(tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def sampling(response_format: dict):
        req = validate_request(
            ChatCompletionRequest, {"messages": messages, "response_format": response_format}
        )
        return s.chat_request(req, request_id="r").sampling

    assert sampling({"type": "json_object"}).json_object
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert json.loads(sampling(fmt).json_schema) == schema
    assert not sampling({"type": "text"}).to_params().structured
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(OpenAIError) as info:
        sampling(bad)
    assert info.value.param == "response_format"
    with pytest.raises(OpenAIError):
        sampling({"type": "json_schema"})
