"""OpenAI request handling without Ray: tokenize, build ``GenerateRequest``s, turn the decode
server's ``GenerateChunk`` stream into OpenAI responses and server-sent events.

``OpenAIServing`` is given a tokenizer, what it serves (``ModelInfo``) and a ``GenerateFn``
(in Serve: a streaming call on the decode deployment handle), so it runs and is tested the
same inside and outside Serve. Every client-visible failure is an ``OpenAIError``; nothing
here may let a bad request reach the decode pool.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.deployments.admission.rules import Priority
from pdserve.deployments.choices import Choices
from pdserve.deployments.decode_stream import DecodeStream
from pdserve.deployments.ingress_telemetry import IngressTelemetry, RequestTelemetry
from pdserve.deployments.messages import (
    GenerateChunk,
    GenerateRequest,
    SamplingOptions,
    TokenLogprob,
)
from pdserve.deployments.openai_protocol import (
    SSE_DONE,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    invalid_param,
    random_id,
    sse_event,
)
from pdserve.deployments.sampling_defaults import SamplingDefaults
from pdserve.engine.grammar import check_json_schema

GenerateFn = Callable[[GenerateRequest], AsyncGenerator[GenerateChunk, None]]


@dataclass(frozen=True)
class RequestLimits:
    """Per-request size limits of the API (``APIConfig``); past them a 400 names the field."""

    max_prompt_tokens: int | None = None
    max_messages: int = 512
    max_stop_strings: int = 16
    # For tokenizers without a chat template of their own; None = chat gets a 400.
    chat_template: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the ingress serves, as /v1/models shows it."""

    name: str
    max_model_len: int
    root: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> ModelCard:
        return ModelCard(
            id=self.name, created=self.created, root=self.root, max_model_len=self.max_model_len
        )


class OpenAIServing:
    """Turns validated OpenAI requests into ``GenerateRequest``s and chunks into responses."""

    def __init__(
        self,
        tokenizer: Any,
        model: ModelInfo,
        generate: GenerateFn,
        telemetry: IngressTelemetry | None = None,
        limits: RequestLimits | None = None,
        defaults: SamplingDefaults | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.limits = limits or RequestLimits()
        self.defaults = defaults or SamplingDefaults()
        self._generate = generate
        self._vocab_size = len(tokenizer)
        self.telemetry = telemetry or IngressTelemetry.disabled(model.name)

    # ------------------------------------------------------------------ models
    def models(self) -> ModelList:
        return ModelList(data=[self.model.card()])

    def model_card(self, model_id: str) -> ModelCard:
        self.check_model(model_id)
        return self.model.card()

    def check_model(self, model_id: str | None) -> None:
        if model_id is not None and model_id != self.model.name:
            raise OpenAIError(
                f"The model `{model_id}` does not exist.",
                status_code=404,
                param="model",
                code="model_not_found",
            )

    # ------------------------------------------------------------------ tokenizer routes
    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            self._check_messages(len(req.messages))
            ids = self.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in req.messages],
                add_generation_prompt=req.add_generation_prompt,
            )
            if req.add_special_tokens and self.tokenizer.bos_token_id is not None:
                ids = [self.tokenizer.bos_token_id, *ids]
        else:
            ids = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)
            ids = list(ids["input_ids"])
        return TokenizeResponse(count=len(ids), max_model_len=self.model.max_model_len, tokens=ids)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self._vocab_size]
        if bad:
            raise invalid_param(
                "tokens", f"token id {bad[0]} is out of range [0, {self._vocab_size})"
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    # ------------------------------------------------------------------ starting requests
    async def start(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        *,
        request_id: str | None = None,
        priority: Priority = "interactive",
        trace_headers: Mapping[str, str] | None = None,
        choice: _Choice | None = None,
    ) -> DecodeStream:
        """Open the root span, tokenize, and start generating.

        Raises ``OpenAIError`` for a bad request or one the decode pool rejects up front;
        the returned stream must be consumed or closed. ``choice``: this stream is one of
        several choices sharing one root span (``start_choices``).
        """
        chat = isinstance(req, ChatCompletionRequest)
        request_id = request_id or random_id("chatcmpl" if chat else "cmpl")
        record = choice.record if choice else self._begin(req, request_id, trace_headers)
        stream: DecodeStream | None = None
        try:
            if isinstance(req, ChatCompletionRequest):
                gen = self.chat_request(
                    req, request_id=request_id, priority=priority, trace_carrier=record.carrier
                )
            else:
                gen = self.completion_request(
                    req, request_id=request_id, priority=priority, trace_carrier=record.carrier
                )
            if choice and choice.index and gen.sampling.seed is not None:
                # Choice i of a seeded request: its own, reproducible, sample.
                seed = gen.sampling.seed + choice.index
                gen = gen.model_copy(
                    update={"sampling": gen.sampling.model_copy(update={"seed": seed})}
                )
            on_close = choice.closed if choice else record.finish
            stream = DecodeStream(gen, self._generate(gen), on_close=on_close)
            await stream.open()
        except BaseException as err:
            if stream is not None:
                await stream.close(err)
            else:
                record.finish(None, err)
            raise
        return stream

    def _begin(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        trace_headers: Mapping[str, str] | None,
    ) -> RequestTelemetry:
        if isinstance(req, ChatCompletionRequest):
            kind, max_tokens = "chat", req.output_limit()
        else:
            kind, max_tokens = "text_completion", req.max_tokens
        return self.telemetry.begin(
            kind,
            request_id,
            sampling={
                "max_tokens": max_tokens,
                "temperature": req.temperature,
                "top_p": req.top_p,
                "top_k": req.top_k,
                "seed": req.seed,
                "frequency_penalty": req.frequency_penalty,
                "presence_penalty": req.presence_penalty,
                "stop_sequences": req.stop_list() or None,
                "choice.count": req.n if (req.n or 1) > 1 else None,
            },
            parent=trace_headers,
        )

    async def start_choices(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        *,
        priority: Priority = "interactive",
        trace_headers: Mapping[str, str] | None = None,
    ) -> Choices:
        """``start`` once per requested choice (``n``) under one root span (usage counted
        once); the streams must be consumed or closed together (``Choices.close``)."""
        n = req.n or 1
        if n == 1:
            stream = await self.start(req, priority=priority, trace_headers=trace_headers)
            return Choices(stream.request.request_id, [stream])
        request_id = random_id("chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl")
        shared = _SharedRecord(self._begin(req, request_id, trace_headers), n)
        streams: list[DecodeStream] = []
        try:
            for i in range(n):
                choice = _Choice(shared.record, i, shared.closed)
                streams.append(
                    await self.start(
                        req,
                        request_id=f"{request_id}-{i}",
                        priority=priority,
                        trace_headers=trace_headers,
                        choice=choice,
                    )
                )
        except BaseException as err:
            for stream in streams:
                await stream.close(err)
            shared.record.finish(None, err)
            raise
        shared.choices = Choices(request_id, streams)
        return shared.choices

    # ------------------------------------------------------------------ preparing requests
    def completion_request(
        self,
        req: CompletionRequest,
        *,
        request_id: str,
        priority: Priority = "interactive",
        trace_carrier: dict[str, str] | None = None,
    ) -> GenerateRequest:
        self.check_model(req.model)
        req.check_stream_options()
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            prompt_ids = list(prompt)
            bad = [t for t in prompt_ids if not 0 <= t < self._vocab_size]
            if bad:
                raise invalid_param(
                    "prompt", f"token id {bad[0]} is out of range [0, {self._vocab_size})"
                )
        return self._generate_request(
            request_id, prompt_ids, req, req.max_tokens, req.logprobs, priority, trace_carrier
        )

    def chat_request(
        self,
        req: ChatCompletionRequest,
        *,
        request_id: str,
        priority: Priority = "interactive",
        trace_carrier: dict[str, str] | None = None,
    ) -> GenerateRequest:
        self.check_model(req.model)
        req.check_stream_options()
        logprobs = req.num_logprobs()
        self._check_messages(len(req.messages))
        prompt_ids = self.apply_chat_template(
            [{"role": m.role, "content": m.text()} for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
        )
        return self._generate_request(
            request_id, prompt_ids, req, req.output_limit(), logprobs, priority, trace_carrier
        )

    def _check_messages(self, count: int) -> None:
        if count > self.limits.max_messages:
            raise invalid_param(
                "messages", f"at most {self.limits.max_messages} messages are allowed, got {count}"
            )

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        template = None  # the tokenizer's own
        if not getattr(self.tokenizer, "chat_template", None):
            # Guessing a format (e.g. ChatML) would silently give a model prompts it was
            # never trained on: without a template, chat is a clear 400.
            if self.limits.chat_template is None:
                raise OpenAIError(
                    f"The model `{self.model.name}` has no chat template; use "
                    "/v1/completions, or configure api.chat_template.",
                    param="messages",
                    code="chat_template_missing",
                )
            template = self.limits.chat_template
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as err:  # templates raise on e.g. a role order they do not allow
            raise invalid_param("messages", f"cannot apply the chat template: {err}") from err
        # The template already holds any BOS/role tokens; do not add them twice.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _generate_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        priority: Priority,
        trace_carrier: dict[str, str] | None,
    ) -> GenerateRequest:
        limit = self.model.max_model_len
        field = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if not prompt_ids:
            raise invalid_param("prompt", "the prompt is empty after tokenization")
        most = self.limits.max_prompt_tokens
        if most is not None and len(prompt_ids) > most:
            raise invalid_param(
                field, f"the prompt has {len(prompt_ids)} tokens; at most {most} are allowed"
            )
        if len(req.stop_list()) > self.limits.max_stop_strings:
            raise invalid_param(
                "stop", f"at most {self.limits.max_stop_strings} stop strings are allowed"
            )
        if len(prompt_ids) >= limit:
            raise invalid_param(
                field,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has {len(prompt_ids)} tokens, leaving no room for output.",
            )
        if max_tokens is None:
            max_tokens = limit - len(prompt_ids)
        elif len(prompt_ids) + max_tokens > limit:
            raise invalid_param(
                "max_tokens",
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the "
                f"prompt, {max_tokens} for the completion).",
            )
        d = self.defaults
        top_k = d.top_k if req.top_k is None else max(req.top_k, 0)
        logit_bias = req.logit_bias_ids()
        bad = [t for t in logit_bias if t >= self._vocab_size]
        if bad:
            raise invalid_param(
                "logit_bias", f"token id {bad[0]} is out of range [0, {self._vocab_size})"
            )
        try:
            sampling = SamplingOptions(
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                temperature=d.temperature if req.temperature is None else req.temperature,
                top_p=d.top_p if req.top_p is None else req.top_p,
                top_k=top_k,
                min_p=d.min_p if req.min_p is None else req.min_p,
                seed=req.seed,
                stop=req.stop_list(),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=(
                    d.repetition_penalty
                    if req.repetition_penalty is None
                    else req.repetition_penalty
                ),
                logit_bias=logit_bias,
                **_structured_output(req),
            )
        except ValueError as err:  # the engine's own rules (e.g. min_tokens > max_tokens)
            message = str(err.errors()[0]["msg"]) if hasattr(err, "errors") else str(err)
            raise OpenAIError(message.removeprefix("Value error, "), code="invalid_value") from None
        return GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            priority=priority,
            trace_carrier=dict(trace_carrier or {}),
            arrival_time=time.time(),
        )

    # ------------------------------------------------------------------ running requests
    async def completion(
        self, req: CompletionRequest, streams: Choices | DecodeStream, created: int
    ) -> CompletionResponse:
        choices = _as_choices(streams)
        n = len(choices.streams)
        echo = self.echo_text(req)
        text: list[list[str]] = [[echo] for _ in range(n)]
        logprobs = [CompletionLogprobs() if req.logprobs is not None else None for _ in range(n)]
        offsets = [0] * n
        try:
            async for i, chunk in choices.merged():
                text[i].append(chunk.text)
                if (lp := logprobs[i]) is not None:
                    offsets[i] = _extend_completion_logprobs(lp, chunk.logprobs, offsets[i])
        finally:
            await choices.close()
        return CompletionResponse(
            id=choices.request_id,
            created=created,
            model=self.model.name,
            choices=[
                CompletionChoice(
                    index=i, text="".join(text[i]), logprobs=logprobs[i], finish_reason=reason
                )
                for i, reason in enumerate(choices.finish_reasons)
            ],
            usage=choices.usage(),
        )

    async def completion_events(
        self, req: CompletionRequest, streams: Choices | DecodeStream, created: int
    ) -> AsyncIterator[str]:
        """Server-sent events of a streamed completion, ending with ``[DONE]``."""
        choices = _as_choices(streams)
        offsets = [0] * len(choices.streams)
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats

        def event(choice_list: list[CompletionChoice], usage: UsageInfo | None) -> str:
            return self._event(CompletionResponse, choices, created, choice_list, usage)

        try:
            if echo := self.echo_text(req):
                yield event(
                    [CompletionChoice(index=i, text=echo) for i in range(len(offsets))], None
                )
            async for i, chunk in choices.merged():
                if not (chunk.text or chunk.logprobs or chunk.finish_reason):
                    continue
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    offsets[i] = _extend_completion_logprobs(logprobs, chunk.logprobs, offsets[i])
                choice = CompletionChoice(
                    index=i, text=chunk.text, logprobs=logprobs, finish_reason=chunk.finish_reason
                )
                yield event([choice], choices.usage() if continuous else None)
            if req.include_usage():
                yield event([], choices.usage())
        except OpenAIError as err:
            yield sse_event(err.body())
        finally:
            await choices.close()
        yield SSE_DONE

    async def chat(
        self, req: ChatCompletionRequest, streams: Choices | DecodeStream, created: int
    ) -> ChatCompletionResponse:
        choices = _as_choices(streams)
        n = len(choices.streams)
        text: list[list[str]] = [[] for _ in range(n)]
        logprobs = [ChatLogprobs(content=[]) if req.logprobs else None for _ in range(n)]
        try:
            async for i, chunk in choices.merged():
                text[i].append(chunk.text)
                if (lp := logprobs[i]) is not None:
                    lp.content.extend(_chat_logprobs(chunk.logprobs))  # type: ignore[union-attr]
        finally:
            await choices.close()
        return ChatCompletionResponse(
            id=choices.request_id,
            created=created,
            model=self.model.name,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatResponseMessage(content="".join(text[i])),
                    logprobs=logprobs[i],
                    finish_reason=reason,
                )
                for i, reason in enumerate(choices.finish_reasons)
            ],
            usage=choices.usage(),
        )

    async def chat_events(
        self, req: ChatCompletionRequest, streams: Choices | DecodeStream, created: int
    ) -> AsyncIterator[str]:
        """Server-sent events of a streamed chat completion, ending with ``[DONE]``."""
        choices = _as_choices(streams)
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats

        def event(choice_list: list[ChatChunkChoice], usage: UsageInfo | None) -> str:
            return self._event(ChatCompletionChunk, choices, created, choice_list, usage)

        try:
            # OpenAI opens every chat stream with the role and empty content, per choice.
            opening = ChatDelta(role="assistant", content="")
            for i in range(len(choices.streams)):
                yield event([ChatChunkChoice(index=i, delta=opening)], None)
            async for i, chunk in choices.merged():
                if not (chunk.text or chunk.logprobs or chunk.finish_reason):
                    continue
                logprobs = (
                    ChatLogprobs(content=_chat_logprobs(chunk.logprobs)) if req.logprobs else None
                )
                choice = ChatChunkChoice(
                    index=i,
                    delta=ChatDelta(content=chunk.text) if chunk.text else ChatDelta(),
                    logprobs=logprobs,
                    finish_reason=chunk.finish_reason,
                )
                yield event([choice], choices.usage() if continuous else None)
            if req.include_usage():
                yield event([], choices.usage())
        except OpenAIError as err:
            yield sse_event(err.body())
        finally:
            await choices.close()
        yield SSE_DONE

    def _event(
        self,
        kind: type[CompletionResponse] | type[ChatCompletionChunk],
        choices: Choices,
        created: int,
        choice_list: list[Any],
        usage: UsageInfo | None,
    ) -> str:
        """One SSE event of a streamed response of ``kind``."""
        payload = kind(
            id=choices.request_id,
            created=created,
            model=self.model.name,
            choices=choice_list,
            usage=usage,
        )
        return sse_event(payload)

    def echo_text(self, req: CompletionRequest) -> str:
        """The prompt as text when the request asks for it to be echoed, else ""."""
        if not req.echo:
            return ""
        prompt = req.single_prompt()
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)


@dataclass(frozen=True)
class _Choice:
    """Choice ``index`` of a request with ``n`` > 1: its root span and close callback."""

    record: RequestTelemetry
    index: int
    closed: Callable[[DecodeStream, BaseException | None], None]


class _SharedRecord:
    """Finishes one root span once all ``n`` choice streams have closed."""

    def __init__(self, record: RequestTelemetry, n: int) -> None:
        self.record = record
        self.choices: Choices | None = None
        self._open = n
        self._error: BaseException | None = None

    def closed(self, _stream: DecodeStream, error: BaseException | None) -> None:
        self._error = self._error or error
        self._open -= 1
        if self._open == 0:
            self.record.finish(self.choices, self._error)


def _structured_output(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """``json_object``/``json_schema`` sampling fields of a chat ``response_format``; an
    invalid schema is a 400 here, before the engine sees it."""
    fmt = getattr(req, "response_format", None)
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.json_schema is None:
        return {"json_object": True}
    schema = json.dumps(fmt.json_schema.schema_)
    try:
        check_json_schema(schema)
    except ValueError as err:
        raise invalid_param("response_format", str(err)) from None
    return {"json_schema": schema}


def _as_choices(streams: Choices | DecodeStream) -> Choices:
    if isinstance(streams, Choices):
        return streams
    return Choices(streams.request.request_id, [streams])


def _extend_completion_logprobs(
    out: CompletionLogprobs, logprobs: list[TokenLogprob] | None, offset: int
) -> int:
    for lp in logprobs or []:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({t.token: t.logprob for t in lp.top_logprobs} or None)
        out.text_offset.append(offset)
        offset += len(lp.token)
    return offset


def _chat_logprobs(logprobs: list[TokenLogprob] | None) -> list[ChatTokenLogprob]:
    return [
        ChatTokenLogprob(
            token=lp.token,
            logprob=lp.logprob,
            bytes=list(lp.token.encode()),
            top_logprobs=[
                TopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
                for t in lp.top_logprobs
            ],
        )
        for lp in logprobs or []
    ]
