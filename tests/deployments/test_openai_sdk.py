"""Every parameter the official ``openai`` SDK defines for ``completions.create`` and
``chat.completions.create``, sent through the SDK to a real Serve app: each gets a correct
answer or one of the deliberate 400s the README documents (``DOCUMENTED_400``). A parameter
a newer SDK adds fails ``test_every_sdk_parameter_is_classified`` until it is classified."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.deployments.ingress_harness import ServeApp, running_app

pytestmark = pytest.mark.timeout(600)

SDK_PLUMBING = {"extra_headers", "extra_query", "extra_body", "timeout"}
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": None, "refusal": "no"},
    {"role": "user", "content": [{"type": "text", "text": "again"}]},
]
# One representative value per parameter.
COMPLETION_VALUES: dict[str, Any] = {
    "model": "tiny",
    "prompt": "The quick brown fox",
    "best_of": 2,  # with n=2 below: best_of == n
    "echo": True,
    "frequency_penalty": 0.5,
    "logit_bias": {"5": 1.5},
    "logprobs": 2,
    "max_tokens": 4,
    "n": 2,
    "presence_penalty": 0.5,
    "seed": 7,
    "stop": ["\n\n"],
    "stream": True,
    "stream_options": {"include_usage": True},
    "suffix": "!",
    "temperature": 0.7,
    "top_p": 0.9,
    "user": "user-1",
}
CHAT_VALUES: dict[str, Any] = {
    "messages": MESSAGES,
    "model": "tiny",
    "audio": {"voice": "alloy", "format": "wav"},
    "frequency_penalty": 0.5,
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logit_bias": {"5": -1.0},
    "logprobs": True,
    "max_completion_tokens": 4,
    "max_tokens": 4,
    "metadata": {"team": "a"},
    "modalities": ["text"],
    "moderation": {"model": "omni-moderation-latest"},
    "n": 2,
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "hi"},
    "presence_penalty": 0.5,
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "auto"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "response_format": {"type": "text"},
    "safety_identifier": "s",
    "seed": 7,
    "service_tier": "auto",
    "stop": "\n\n",
    "store": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.7,
    "tool_choice": "none",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "top_logprobs": 2,
    "top_p": 0.9,
    "user": "user-1",
    "verbosity": "low",
    "web_search_options": {},
}
# The deliberate 400s (README, "OpenAI compatibility"): features that would change the
# output and that pdserve does not implement.
DOCUMENTED_400 = {
    ("completions", "suffix"),
    ("chat", "audio"),
    ("chat", "function_call"),
    ("chat", "functions"),
    ("chat", "prediction"),
    ("chat", "tools"),
    ("chat", "web_search_options"),
}
# Needed to make the value above meaningful (n pairs with best_of; logprobs with
# top_logprobs; stream with stream_options).
COMPANIONS = {
    "best_of": {"n": 2},
    "top_logprobs": {"logprobs": True},
    "stream_options": {"stream": True},
    "stream": {"stream_options": {"include_usage": True}},
    "echo": {"logprobs": None},
}


@pytest.fixture(scope="module")
def app() -> Iterator[ServeApp]:
    with running_app() as running:
        yield running


@pytest.fixture(scope="module")
def client(app: ServeApp) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"{app.http_url}/v1", max_retries=0)


def sdk_parameters(method: Any) -> set[str]:
    return set(inspect.signature(method).parameters) - SDK_PLUMBING


def test_every_sdk_parameter_is_classified(client: openai.OpenAI) -> None:
    assert sdk_parameters(client.completions.create) == set(COMPLETION_VALUES)
    assert sdk_parameters(client.chat.completions.create) == set(CHAT_VALUES)


def _call(create: Any, required: dict[str, Any], name: str, value: Any) -> Any:
    kwargs = {**required, **COMPANIONS.get(name, {}), name: value}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if kwargs.get("stream"):
        return list(create(**kwargs))
    return create(**kwargs)


@pytest.mark.parametrize("name", sorted(COMPLETION_VALUES))
def test_completions_parameter(client: openai.OpenAI, name: str) -> None:
    required = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4}
    _check("completions", client.completions.create, required, name, COMPLETION_VALUES[name])


@pytest.mark.parametrize("name", sorted(CHAT_VALUES))
def test_chat_parameter(client: openai.OpenAI, name: str) -> None:
    required = {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 4}
    _check("chat", client.chat.completions.create, required, name, CHAT_VALUES[name])


def _check(api: str, create: Any, required: dict[str, Any], name: str, value: Any) -> None:
    if (api, name) in DOCUMENTED_400:
        with pytest.raises(openai.BadRequestError) as info:
            _call(create, required, name, value)
        assert name in str(info.value.body)
        return
    result = _call(create, required, name, value)
    if isinstance(result, list):  # a stream: chunks, the last with usage
        assert result and result[-1].usage is not None
        assert result[-1].usage.completion_tokens >= 1
        return
    n = COMPANIONS.get(name, {}).get("n") or (value if name == "n" else 1)
    assert len(result.choices) == n
    assert result.usage.completion_tokens >= n
    for choice in result.choices:
        text = choice.text if api == "completions" else choice.message.content
        assert isinstance(text, str) and choice.finish_reason in ("length", "stop")
        if name == "echo":
            assert text.startswith(required["prompt"])
