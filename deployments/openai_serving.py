"""OpenAI request handling without Ray: tokenize, build ``GenerateRequest``s, turn the decode
server's ``GenerateChunk`` stream into OpenAI responses and server-sent events.

``OpenAIServing`` is given a tokenizer, what it serves (``ModelInfo``) and a ``GenerateFn``
(in Serve: a streaming call on the decode deployment handle), so it runs and is tested the
same inside and outside Serve. Every client-visible failure is an ``OpenAIError``; nothing
here may let a bad request reach the decode pool.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.deployments.decode_stream import DecodeStream
from pdserve.deployments.ingress_telemetry import IngressTelemetry
from pdserve.deployments.messages import (
    GenerateChunk,
    GenerateRequest,
    SamplingOptions,
    SLOClass,
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
        slo_class: SLOClass = "interactive",
    ) -> DecodeStream:
        """Open the root span, tokenize, and start generating.

        Raises ``OpenAIError`` for a bad request or one the decode pool rejects up front;
        the returned stream must be consumed or closed.
        """
        chat = isinstance(req, ChatCompletionRequest)
        request_id = request_id or random_id("chatcmpl" if chat else "cmpl")
        record = self.telemetry.begin(
            "chat" if chat else "text_completion",
            request_id,
            max_tokens=req.output_limit() if chat else req.max_tokens,
            temperature=req.temperature,
        )
        stream: DecodeStream | None = None
        try:
            if chat:
                gen = self.chat_request(
                    req, request_id=request_id, slo_class=slo_class, trace_carrier=record.carrier
                )
            else:
                gen = self.completion_request(
                    req, request_id=request_id, slo_class=slo_class, trace_carrier=record.carrier
                )
            stream = DecodeStream(gen, self._generate(gen), on_close=record.finish)
            await stream.open()
        except BaseException as err:
            if stream is not None:
                await stream.close(err)
            else:
                record.finish(None, err)
            raise
        return stream

    # ------------------------------------------------------------------ preparing requests
    def completion_request(
        self,
        req: CompletionRequest,
        *,
        request_id: str,
        slo_class: SLOClass = "interactive",
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
            request_id, prompt_ids, req, req.max_tokens, req.logprobs, slo_class, trace_carrier
        )

    def chat_request(
        self,
        req: ChatCompletionRequest,
        *,
        request_id: str,
        slo_class: SLOClass = "interactive",
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
            request_id, prompt_ids, req, req.output_limit(), logprobs, slo_class, trace_carrier
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
        slo_class: SLOClass,
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
            )
        except ValueError as err:  # the engine's own rules (e.g. min_tokens > max_tokens)
            message = str(err.errors()[0]["msg"]) if hasattr(err, "errors") else str(err)
            raise OpenAIError(message.removeprefix("Value error, "), code="invalid_value") from None
        return GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            slo_class=slo_class,
            trace_carrier=dict(trace_carrier or {}),
            arrival_time=time.time(),
        )

    # ------------------------------------------------------------------ running requests
    async def completion(
        self, req: CompletionRequest, stream: DecodeStream, created: int
    ) -> CompletionResponse:
        text: list[str] = []
        logprobs = CompletionLogprobs() if req.logprobs is not None else None
        offset = 0
        try:
            async for chunk in stream:
                text.append(chunk.text)
                if logprobs is not None:
                    offset = _extend_completion_logprobs(logprobs, chunk.logprobs, offset)
        finally:
            await stream.close()
        choice = CompletionChoice(
            text="".join(text), logprobs=logprobs, finish_reason=stream.finish_reason
        )
        return CompletionResponse(
            id=stream.request.request_id,
            created=created,
            model=self.model.name,
            choices=[choice],
            usage=stream.usage(),
        )

    async def completion_events(
        self, req: CompletionRequest, stream: DecodeStream, created: int
    ) -> AsyncIterator[str]:
        """Server-sent events of a streamed completion, ending with ``[DONE]``."""
        rid, offset = stream.request.request_id, 0
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        try:
            async for chunk in stream:
                if not (chunk.text or chunk.logprobs or chunk.finish_reason):
                    continue
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    offset = _extend_completion_logprobs(logprobs, chunk.logprobs, offset)
                choice = CompletionChoice(
                    text=chunk.text, logprobs=logprobs, finish_reason=chunk.finish_reason
                )
                yield sse_event(
                    CompletionResponse(
                        id=rid,
                        created=created,
                        model=self.model.name,
                        choices=[choice],
                        usage=stream.usage() if continuous else None,
                    )
                )
            if req.include_usage():
                yield sse_event(
                    CompletionResponse(
                        id=rid,
                        created=created,
                        model=self.model.name,
                        choices=[],
                        usage=stream.usage(),
                    )
                )
        except OpenAIError as err:
            yield sse_event(err.body())
        finally:
            await stream.close()
        yield SSE_DONE

    async def chat(
        self, req: ChatCompletionRequest, stream: DecodeStream, created: int
    ) -> ChatCompletionResponse:
        text: list[str] = []
        logprobs = ChatLogprobs(content=[]) if req.logprobs else None
        try:
            async for chunk in stream:
                text.append(chunk.text)
                if logprobs is not None:
                    logprobs.content.extend(_chat_logprobs(chunk.logprobs))  # type: ignore[union-attr]
        finally:
            await stream.close()
        choice = ChatChoice(
            message=ChatResponseMessage(content="".join(text)),
            logprobs=logprobs,
            finish_reason=stream.finish_reason,
        )
        return ChatCompletionResponse(
            id=stream.request.request_id,
            created=created,
            model=self.model.name,
            choices=[choice],
            usage=stream.usage(),
        )

    async def chat_events(
        self, req: ChatCompletionRequest, stream: DecodeStream, created: int
    ) -> AsyncIterator[str]:
        """Server-sent events of a streamed chat completion, ending with ``[DONE]``."""
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats

        def event(choices: list[ChatChunkChoice], usage: UsageInfo | None) -> str:
            return sse_event(
                ChatCompletionChunk(
                    id=stream.request.request_id,
                    created=created,
                    model=self.model.name,
                    choices=choices,
                    usage=usage,
                )
            )

        try:
            # OpenAI opens every chat stream with the role and empty content.
            yield event([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))], None)
            async for chunk in stream:
                if not (chunk.text or chunk.logprobs or chunk.finish_reason):
                    continue
                logprobs = (
                    ChatLogprobs(content=_chat_logprobs(chunk.logprobs)) if (req.logprobs) else None
                )
                choice = ChatChunkChoice(
                    delta=ChatDelta(content=chunk.text) if chunk.text else ChatDelta(),
                    logprobs=logprobs,
                    finish_reason=chunk.finish_reason,
                )
                yield event([choice], stream.usage() if continuous else None)
            if req.include_usage():
                yield event([], stream.usage())
        except OpenAIError as err:
            yield sse_event(err.body())
        finally:
            await stream.close()
        yield SSE_DONE


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
