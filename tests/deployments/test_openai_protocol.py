"""OpenAI schema validation and the request/response logic of ``OpenAIServing`` (no Ray).

The serving tests use the tiny test model's real tokenizer and a scripted decode stream, so
they check exactly what a client would see: status codes, error bodies, SSE framing, usage.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import pytest

from pdserve.deployments.ingress_telemetry import IngressTelemetry
from pdserve.deployments.messages import ErrorInfo, GenerateChunk, GenerateRequest, TokenLogprob
from pdserve.deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    ignored_fields_header,
    parse_json_body,
    validate_request,
)
from pdserve.deployments.openai_serving import ModelInfo, OpenAIServing
from pdserve.engine.loader import load_tokenizer
from pdserve.engine.testmodel import ensure_test_model

# ----------------------------------------------------------------------------- schema


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_p": 1.1}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream": 1}, "stream"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "seed": 1.5}, "seed"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
        ({"prompt": "x", "logits_processors": ["x"]}, "logits_processors"),
        ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_bad_completion_requests_get_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        validate_request(CompletionRequest, body)
    err = info.value
    assert err.status_code == 400
    assert err.param is not None and err.param.split(".")[0] == param
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"
    assert param in body["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, None),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "f"}]}, "tools"),
    ],
)
def test_bad_chat_requests_get_400(body: dict, param: str | None) -> None:
    with pytest.raises(OpenAIError) as info:
        validate_request(ChatCompletionRequest, body)
    assert info.value.status_code == 400
    if param is not None:
        assert info.value.param.split(".")[0] == param


def test_valid_requests_keep_what_the_client_sent() -> None:
    req = validate_request(
        CompletionRequest,
        {
            "model": "m",
            "prompt": [[1, 2, 3]],
            "max_tokens": 5,
            "temperature": 0,  # an int is fine for a float field
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "user": "u1",
            "frequency_penalty": 0,
            "repetition_penalty": 1.0,
        },
    )
    assert req.single_prompt() == [1, 2, 3]
    assert req.stop_list() == ["\n"] and req.include_usage()
    chat = validate_request(
        ChatCompletionRequest,
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 7,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    assert chat.output_limit() == 7 and chat.num_logprobs() == 2
    assert chat.messages[0].text() == "hi"


def test_null_means_the_default() -> None:
    nulls = {"n": None, "stream": None, "seed": None, "stop": None, "logprobs": None,
             "temperature": None, "stream_options": None, "user": None}  # fmt: skip
    req = validate_request(CompletionRequest, {"prompt": "x", "echo": None, **nulls})
    assert not req.stream and req.stop_list() == [] and not req.include_usage()
    chat = validate_request(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], **nulls}
    )
    assert chat.num_logprobs() is None


def test_top_logprobs_without_logprobs_is_rejected() -> None:
    chat = validate_request(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    )
    with pytest.raises(OpenAIError, match="top_logprobs"):
        chat.num_logprobs()


def test_unknown_fields_are_ignored_and_named_in_a_warning_header() -> None:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "refusal": "no", "tool_calls": []},
            {"role": "user", "content": "again", "audio": {"id": "a"}},
        ],
        "store": True,
        "metadata": {"k": "v"},
        "parallel_tool_calls": False,
        "reasoning_effort": "low",
        "service_tier": "auto",
        "na\u00efve\n": 1,
    }
    chat = validate_request(ChatCompletionRequest, body)
    assert chat.messages[1].refusal == "no"
    assert chat.ignored_fields() == (
        "store",
        "metadata",
        "reasoning_effort",
        "service_tier",
        "na\u00efve\n",
        "messages.2.audio",
    )
    header = ignored_fields_header(chat.ignored_fields())["Warning"]
    assert header.isascii() and header.isprintable() and "service_tier" in header
    assert validate_request(CompletionRequest, {"prompt": "x"}).ignored_fields() == ()
    assert ignored_fields_header(()) == {}


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "\\ud800", "prompt": "x"}', "model"),
        (b'{"prompt": ["\\udfff"]}', "prompt.0"),
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
        (b'{"\\ud800": 1}', None),
    ],
)
def test_lone_surrogates_anywhere_are_a_400(raw: bytes, param: str | None) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_json_body(raw)
    assert info.value.status_code == 400 and info.value.param == param
    # The error body itself must be encodable: that was the 500.
    json.dumps(info.value.body(), ensure_ascii=False).encode("utf-8")
    # A valid surrogate pair is ordinary text.
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_json_is_a_400(raw: bytes) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_json_body(raw)
    assert info.value.status_code == 400 and info.value.code == "invalid_json"


# ----------------------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_test_model("tiny"))


class ScriptedDecode:
    """Stands in for the decode deployment: replies with prepared chunks, records requests."""

    def __init__(self, script: list[dict | Exception]) -> None:
        self.script = script
        self.requests: list[GenerateRequest] = []
        self.closed_early = False

    async def __call__(self, req: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        self.requests.append(req)
        finished = False
        try:
            for fields in self.script:
                if isinstance(fields, Exception):
                    raise fields
                chunk = GenerateChunk(
                    request_id=req.request_id,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    **fields,
                )
                finished = chunk.finish_reason is not None or chunk.error is not None
                yield chunk
                await asyncio.sleep(0)
        finally:
            self.closed_early = not finished


THREE_TOKENS = [
    {"token_ids": [10], "text": "a", "num_cached_tokens": 2},
    {"token_ids": [11, 12], "text": "bc"},
    {"token_ids": [], "text": "", "finish_reason": "length"},
]


def make_serving(
    tokenizer,
    script: list[dict | Exception],
    max_model_len: int = 64,
    telemetry: IngressTelemetry | None = None,
):
    decode = ScriptedDecode(script)
    info = ModelInfo(name="tiny", max_model_len=max_model_len)
    return OpenAIServing(tokenizer, info, decode, telemetry), decode


def sse_payloads(events: list[str]) -> list:
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    return [e[len("data: ") : -2] for e in events]


async def collect(agen) -> list[str]:
    return [e async for e in agen]


def test_streamed_completion_with_usage(tokenizer) -> None:
    serving, decode = make_serving(tokenizer, THREE_TOKENS)
    req = validate_request(
        CompletionRequest,
        {"prompt": "hello world", "max_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip

    async def run() -> list[str]:
        stream = await serving.start(req)
        return await collect(serving.completion_events(req, stream, 0))

    payloads = sse_payloads(asyncio.run(run()))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["a", "bc", ""]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert all(c["object"] == "text_completion" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    prompt_len = len(tokenizer("hello world")["input_ids"])
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 3,
        "total_tokens": prompt_len + 3,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    sent = decode.requests[0]
    assert sent.prompt_token_ids == tokenizer("hello world")["input_ids"]
    assert sent.sampling.max_tokens == 3 and not decode.closed_early


def test_chat_applies_the_models_template(tokenizer) -> None:
    serving, decode = make_serving(tokenizer, THREE_TOKENS, max_model_len=256)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    req = validate_request(ChatCompletionRequest, {"messages": messages, "temperature": 0})

    async def run():
        stream = await serving.start(req)
        return await serving.chat(req, stream, 0)

    resp = asyncio.run(run())
    expected = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    sent = decode.requests[0]
    assert sent.prompt_token_ids == expected
    assert sent.sampling.temperature == 0.0
    # no max tokens given: the rest of the context
    assert sent.sampling.max_tokens == 256 - len(expected)
    assert resp.choices[0].message.content == "abc"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3 and resp.object == "chat.completion"


def test_streamed_chat_starts_with_role_and_ends_with_done(tokenizer) -> None:
    serving, _ = make_serving(tokenizer, THREE_TOKENS)
    req = validate_request(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    )

    async def run() -> list[str]:
        stream = await serving.start(req)
        return await collect(serving.chat_events(req, stream, 0))

    payloads = sse_payloads(asyncio.run(run()))
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "abc"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)


def test_prompt_too_long_and_context_overflow_are_400(tokenizer) -> None:
    serving, decode = make_serving(tokenizer, THREE_TOKENS, max_model_len=8)
    long_prompt = validate_request(CompletionRequest, {"prompt": list(range(4, 12))})
    with pytest.raises(OpenAIError, match="maximum context length") as info:
        asyncio.run(serving.start(long_prompt))
    assert info.value.status_code == 400 and info.value.param == "prompt"
    overflow = validate_request(CompletionRequest, {"prompt": [5, 6, 7], "max_tokens": 6})
    with pytest.raises(OpenAIError) as info:
        asyncio.run(serving.start(overflow))
    assert info.value.param == "max_tokens"
    bad_id = validate_request(CompletionRequest, {"prompt": [5, len(tokenizer)]})
    with pytest.raises(OpenAIError, match="out of range"):
        asyncio.run(serving.start(bad_id))
    wrong_model = validate_request(CompletionRequest, {"prompt": "x", "model": "gpt-4"})
    with pytest.raises(OpenAIError) as info:
        asyncio.run(serving.start(wrong_model))
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    assert decode.requests == []  # nothing bad reached the decode pool


def test_engine_rules_reject_min_tokens_above_max_tokens(tokenizer) -> None:
    serving, decode = make_serving(tokenizer, THREE_TOKENS)
    req = validate_request(CompletionRequest, {"prompt": "x", "max_tokens": 2, "min_tokens": 5})
    with pytest.raises(OpenAIError, match="min_tokens") as info:
        asyncio.run(serving.start(req))
    assert info.value.status_code == 400 and decode.requests == []


def test_shed_request_becomes_429_with_retry_after(tokenizer) -> None:
    shed = ErrorInfo(code=429, type="overloaded", message="TTFT SLO cannot be met",
                     retry_after_s=2.0)  # fmt: skip
    serving, _ = make_serving(tokenizer, [{"error": shed}])
    req = validate_request(CompletionRequest, {"prompt": "x", "stream": True})
    with pytest.raises(OpenAIError) as info:
        asyncio.run(serving.start(req))
    assert info.value.status_code == 429
    assert info.value.headers() == {"Retry-After": "2"}
    assert info.value.body()["error"]["type"] == "overloaded"


def test_pool_unavailable_before_any_token_is_503(tokenizer) -> None:
    busy = OpenAIError("pool full", status_code=503, retry_after_s=1.0)
    serving, _ = make_serving(tokenizer, [busy])
    with pytest.raises(OpenAIError) as info:
        asyncio.run(serving.start(validate_request(CompletionRequest, {"prompt": "x"})))
    assert info.value.status_code == 503 and info.value.headers() == {"Retry-After": "1"}
    # Whole seconds, rounded up (never sooner than the predicted drain), at least 1.
    for drain_s, header in ((0.1, "1"), (1.0, "1"), (1.25, "2"), (17.25, "18")):
        assert OpenAIError("x", status_code=429, retry_after_s=drain_s).headers() == {
            "Retry-After": header
        }


def test_replica_crash_mid_stream_is_a_server_error_event(tokenizer) -> None:
    serving, _ = make_serving(tokenizer, [{"token_ids": [10], "text": "a"}, KeyError("boom")])
    req = validate_request(CompletionRequest, {"prompt": "x", "stream": True})

    async def run() -> list[str]:
        stream = await serving.start(req)
        return await collect(serving.completion_events(req, stream, 0))

    payloads = sse_payloads(asyncio.run(run()))
    error = json.loads(payloads[1])["error"]
    assert error["type"] == "server_error" and "boom" in error["message"]
    assert payloads[2:] == ["[DONE]"]


def test_failure_after_streaming_began_is_an_error_event_then_done(tokenizer) -> None:
    boom = ErrorInfo(code=500, type="server_error", message="decode replica died")
    serving, _ = make_serving(tokenizer, [{"token_ids": [10], "text": "a"}, {"error": boom}])
    req = validate_request(CompletionRequest, {"prompt": "x", "stream": True})

    async def run() -> list[str]:
        stream = await serving.start(req)
        return await collect(serving.completion_events(req, stream, 0))

    payloads = sse_payloads(asyncio.run(run()))
    assert json.loads(payloads[0])["choices"][0]["text"] == "a"
    assert json.loads(payloads[1]) == {
        "error": {"message": "decode replica died", "type": "server_error", "param": None,
                  "code": "500"}
    }  # fmt: skip
    assert payloads[2:] == ["[DONE]"]


def test_closing_a_stream_early_cancels_it_downstream(tokenizer) -> None:
    many = [{"token_ids": [10 + i], "text": "x"} for i in range(50)]
    serving, decode = make_serving(tokenizer, many)
    req = validate_request(CompletionRequest, {"prompt": "x", "stream": True})

    async def run() -> None:
        stream = await serving.start(req)
        events = serving.completion_events(req, stream, 0)
        await anext(events)
        await events.aclose()  # what Starlette does when the client disconnects

    asyncio.run(run())
    assert decode.closed_early


def test_logprobs_are_reported_in_openai_shape(tokenizer) -> None:
    lp = TokenLogprob(token_id=10, token="a", logprob=-0.5, top_logprobs=[
        {"token_id": 10, "token": "a", "logprob": -0.5},
        {"token_id": 11, "token": "b", "logprob": -1.5},
    ])  # fmt: skip
    script = [{"token_ids": [10], "text": "a", "logprobs": [lp], "finish_reason": "stop"}]
    serving, decode = make_serving(tokenizer, script)
    req = validate_request(CompletionRequest, {"prompt": "x", "logprobs": 2})
    chat_req = validate_request(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2},
    )

    async def run():
        done = await serving.completion(req, await serving.start(req), 0)
        chat = await serving.chat(chat_req, await serving.start(chat_req), 0)
        return done, chat

    done, chat = asyncio.run(run())
    assert [r.sampling.logprobs for r in decode.requests] == [2, 2]
    assert done.choices[0].logprobs.model_dump() == {
        "tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5, "b": -1.5}],
        "text_offset": [0],
    }  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert content[0].token == "a" and content[0].logprob == -0.5
    assert [t.token for t in content[0].top_logprobs] == ["a", "b"]


def test_root_span_is_parent_of_the_decode_side_and_records_usage(tokenizer) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdserve.deployments.metrics import ServingMetrics

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = ServingMetrics(model_name="tiny", role="ingress", replica="r", enabled=False)
    telemetry = IngressTelemetry("tiny", metrics, tracer=provider.get_tracer("test"))
    serving, decode = make_serving(tokenizer, THREE_TOKENS, telemetry=telemetry)
    req = validate_request(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    )

    async def run() -> None:
        await serving.chat(req, await serving.start(req), 0)

    asyncio.run(run())
    (span,) = exporter.get_finished_spans()
    assert span.name == "chat tiny"
    attrs = dict(span.attributes)
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.max_tokens"] == 3
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.provider.name"] == "pdserve" and attrs["gen_ai.response.model"] == "tiny"
    assert attrs["gen_ai.response.id"] == decode.requests[0].request_id
    # The decode side continues this very span's trace.
    traceparent = decode.requests[0].trace_carrier["traceparent"]
    _, trace_id, parent_id, _ = traceparent.split("-")
    assert int(trace_id, 16) == span.context.trace_id
    assert int(parent_id, 16) == span.context.span_id

    # A client's traceparent (HTTP header or gRPC metadata) becomes the root's parent.
    exporter.clear()
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"TraceParent": f"00-{client_trace}-{client_span}-01", "authorization": "x"}

    async def run_with_parent() -> None:
        await serving.chat(req, await serving.start(req, trace_headers=headers), 0)

    asyncio.run(run_with_parent())
    (child,) = exporter.get_finished_spans()
    assert child.context.trace_id == int(client_trace, 16)
    assert child.parent.span_id == int(client_span, 16)

    # n = 3 choices: one root span, the prompt counted once, completions summed, and every
    # choice's decode side in that one trace.
    exporter.clear()
    three = validate_request(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3, "seed": 5},
    )

    async def run_choices():
        return await serving.chat(three, await serving.start_choices(three), 0)

    response = asyncio.run(run_choices())
    (root,) = exporter.get_finished_spans()
    attrs = dict(root.attributes)
    assert attrs["gen_ai.usage.input_tokens"] == response.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == 9 == response.usage.completion_tokens
    assert attrs["gen_ai.request.choice.count"] == 3
    assert attrs["gen_ai.response.id"] == response.id
    assert attrs["gen_ai.response.finish_reasons"] == ("length",) * 3
    choice_requests = decode.requests[-3:]
    assert [r.sampling.seed for r in choice_requests] == [5, 6, 7]
    parents = {r.trace_carrier["traceparent"].split("-")[2] for r in choice_requests}
    assert parents == {format(root.context.span_id, "016x")}
