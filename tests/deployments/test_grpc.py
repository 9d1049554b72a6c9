"""pdserve's gRPC API through Serve's gRPC proxy on a real app (tiny model, real engine)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest

from pdserve.deployments.grpc.client import PDServeClient, main
from pdserve.engine.loader import load_tokenizer
from tests.deployments.ingress_harness import (
    APP_NAME,
    ServeApp,
    no_request_held,
    running_app,
    wait_decode_report,
)

pytestmark = pytest.mark.timeout(600)

PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def app() -> Iterator[ServeApp]:
    with running_app() as running:
        yield running


@pytest.fixture(scope="module")
def client(app: ServeApp) -> Iterator[PDServeClient]:
    with PDServeClient(app.grpc_target, application=APP_NAME, timeout_s=120) as c:
        yield c


def test_unary_complete_matches_http(app: ServeApp, client: PDServeClient) -> None:
    result = client.complete(
        PDServeClient.request(prompt=PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    http = httpx.post(
        f"{app.http_url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
        timeout=120,
    ).json()
    assert result.text == http["choices"][0]["text"]
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 10
    assert result.usage.completion_tokens == 10
    assert result.usage.prompt_tokens == http["usage"]["prompt_tokens"]
    assert result.usage.total_tokens == result.usage.prompt_tokens + 10
    assert result.id.startswith("cmpl-")


def test_server_streaming_generate(client: PDServeClient) -> None:
    request = PDServeClient.request(prompt=PROMPT, max_tokens=10, temperature=0.0,
                                    ignore_eos=True)  # fmt: skip
    chunks = list(client.generate(request))
    assert len(chunks) >= 2  # streamed, not one message
    assert all(not c.finish_reason for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 10
    assert sum(len(c.token_ids) for c in chunks) == 10
    whole = client.complete(request)
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)


def test_chat_messages_use_the_template(app: ServeApp, client: PDServeClient) -> None:
    tokenizer = load_tokenizer(app.model_dir)
    messages = [("system", "Short answers."), ("user", "What is a fox?")]
    expected = tokenizer(
        tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )["input_ids"]
    result = client.complete(PDServeClient.request(messages=messages, max_tokens=3))
    assert result.usage.prompt_tokens == len(expected)
    assert 1 <= result.usage.completion_tokens <= 3


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({}, grpc.StatusCode.INVALID_ARGUMENT),  # neither prompt nor messages
        ({"prompt": "x", "max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "x", "temperature": 9.0}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "x", "messages": [("user", "y")]}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "x", "model": "gpt-4"}, grpc.StatusCode.NOT_FOUND),
    ],
)
def test_invalid_requests_get_grpc_status_codes(client: PDServeClient, fields, code) -> None:
    request = PDServeClient.request(**fields)
    with pytest.raises(grpc.RpcError) as unary:
        client.complete(request)
    assert unary.value.code() == code and unary.value.details()
    with pytest.raises(grpc.RpcError) as streaming:
        list(client.generate(request))
    assert streaming.value.code() == code


def test_cancelled_stream_frees_the_decode_replica(app: ServeApp, client: PDServeClient) -> None:
    request = PDServeClient.request(prompt="go on", max_tokens=900, ignore_eos=True)
    stream = client._stub.Generate(request, metadata=(("application", APP_NAME),))
    for _ in range(5):
        next(stream)
    stream.cancel()
    wait_decode_report(app, no_request_held, "the decode replica to drop the cancelled stream")
    # and the service still answers
    assert client.complete(PDServeClient.request(prompt="x", max_tokens=2)).usage.completion_tokens


def test_token_ids_in_and_out_logprobs_and_stop_token_ids(
    app: ServeApp, client: PDServeClient
) -> None:
    tokenizer = load_tokenizer(app.model_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    by_text = client.complete(
        PDServeClient.request(prompt=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    by_ids = client.complete(
        PDServeClient.request(
            prompt_token_ids=ids, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2
        )
    )
    assert list(by_ids.token_ids) == list(by_text.token_ids)
    assert [lp.token_id for lp in by_ids.logprobs] == list(by_ids.token_ids)
    for lp in by_ids.logprobs:
        assert lp.logprob <= 0.0 and len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
    streamed = list(
        client.generate(
            PDServeClient.request(
                prompt_token_ids=ids, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0
            )
        )
    )
    assert [lp.token_id for c in streamed for lp in c.logprobs] == list(by_text.token_ids)
    # Stopping on the third generated token ends the completion there.
    stop_at = by_text.token_ids[2]
    stopped = client.complete(
        PDServeClient.request(
            prompt_token_ids=ids, max_tokens=6, temperature=0.0, stop_token_ids=[stop_at]
        )
    )
    first = list(by_text.token_ids).index(stop_at)
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids)[:first] == list(by_text.token_ids)[:first]
    assert len(stopped.token_ids) <= first + 1


def test_client_deadline_cancels_the_request_on_the_engine(
    app: ServeApp, client: PDServeClient
) -> None:
    request = PDServeClient.request(prompt="go on", max_tokens=900, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as info:
        client._stub.Complete(request, metadata=(("application", APP_NAME),), timeout=1.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_decode_report(app, lambda r: r.idle, "the decode replica to stop past the deadline")


def test_health_and_cli(app: ServeApp, client: PDServeClient, capsys) -> None:
    assert client.healthy()
    assert client.serving()  # grpc.health.v1
    code = main(["--target", app.grpc_target, "--application", APP_NAME, "--max-tokens", "4",
                 "--temperature", "0", "--ignore-eos", PROMPT])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0
    expected = client.complete(
        PDServeClient.request(prompt=PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    assert out.out == expected.text + "\n"
    assert "completion_tokens=4" in out.err
    code = main(["--target", app.grpc_target, "--max-tokens", "0", "x"])
    assert code == 1 and "INVALID_ARGUMENT" in capsys.readouterr().err
