"""The OpenAI-compatible HTTP schema: request models, response/chunk models and the error body.

Requests are validated strictly: wrong JSON types, out-of-range values and lone UTF-16
surrogates raise ``OpenAIError`` (HTTP 400 with ``{"error": {message, type, param, code}}``),
never get coerced. Unknown top-level and message fields are ignored and named back to the
client (``ignored_fields``, sent as a ``Warning`` header), as vLLM does, so that clients
replaying another server's messages keep working; unknown fields that would change the output
(``OUTPUT_CHANGING_FIELDS``) are a 400, never silently dropped. Fields that OpenAI defines
but pdserve does not implement (tools, best_of > n...) are accepted only at their no-op
value.
This module imports neither Ray nor torch nor the engine: it is pure schema.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_LOGPROBS = 20  # the engine's limit (pdserve.engine.sampling_params.MAX_LOGPROBS)
MAX_STOP_STRINGS = 16
MAX_NAMED_IGNORED_FIELDS = 20
MAX_CHOICES = 16  # n: each choice is a decode request of its own

# Fields other OpenAI-compatible servers (OpenAI, vLLM) accept that pdserve does not
# implement and that would change the output: ignoring them would return an answer the
# client did not ask for, so they are a 400.
OUTPUT_CHANGING_FIELDS = frozenset(
    {
        "functions",
        "function_call",
        "audio",
        "prediction",
        "web_search_options",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "logits_processors",
        "bad_words",
        "allowed_token_ids",
        "prompt_logprobs",
        "include_stop_str_in_output",
        "use_beam_search",
        "length_penalty",
        "truncate_prompt_tokens",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "documents",
    }
)


class OpenAIError(Exception):
    """A request failure that maps onto an HTTP status and the OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        # Whole seconds (RFC 9110 delay-seconds), rounded up: never sooner than the drain.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s - 1e-9)))}


def invalid_param(param: str, message: str) -> OpenAIError:
    return OpenAIError(message, param=param, code="invalid_value")


def from_validation_error(err: ValidationError) -> OpenAIError:
    """The first pydantic problem as a 400 naming the offending field path."""
    first = err.errors()[0]
    # Union members show up in the location as type tags ("str", "list[int]"); drop them.
    path = [str(p) for p in first["loc"] if not _is_type_tag(p)]
    param = ".".join(path) or None
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif first["type"] == "missing":
        message = f"Missing required parameter: {param}"
    else:
        # pydantic prefixes custom errors with "Value error, "; strip it for clients.
        detail = str(first["msg"]).removeprefix("Value error, ")
        if param is None and ": " in detail:
            # A cross-field rule names its field first ("best_of: ...").
            head, _, rest = detail.partition(": ")
            if head.isidentifier():
                param, detail = head, rest
        message = f"Invalid value for '{param}': {detail}"
    return OpenAIError(message, param=param, code="invalid_value")


def _is_type_tag(loc_part: object) -> bool:
    return isinstance(loc_part, str) and (
        "[" in loc_part or loc_part in {"str", "int", "float", "bool", "list", "dict", "none"}
    )


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying why it is not one."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise OpenAIError(
            f"We could not parse the JSON body of your request: {err}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise OpenAIError("The request body must be a JSON object.", code="invalid_json")
    path = _lone_surrogate_path(data, "")
    if path is not None:
        # JSON allows "\\ud800", but such a string is not Unicode: it cannot be tokenized or
        # echoed back in a UTF-8 response, so it is refused here, before anything uses it.
        raise OpenAIError(
            f"Invalid value for '{path or 'body'}': a lone UTF-16 surrogate is not valid text",
            param=path or None,
            code="invalid_value",
        )
    return data


def _lone_surrogate_path(value: Any, path: str) -> str | None:
    """The dotted path of the first string (key or value) holding a lone surrogate."""
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if _has_surrogate(key):
                return path  # "" (the body) for a top-level key
            found = _lone_surrogate_path(item, sub)
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate_path(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------- requests


class _Request(BaseModel):
    # strict: "10" is not an int and 1 is not a bool; ints are still accepted for floats.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    # Unknown fields validate_request dropped, as "field" or "messages.0.field".
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    def ignored_fields(self) -> tuple[str, ...]:
        return self._ignored


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 and 0 both mean "off" (vLLM)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # OpenAI clients may send null for any optional field: null means "the default".
    n: int | None = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    user: str | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    # JSON object keys are strings: token ids as decimal strings, as OpenAI sends them.
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids and any(t < 0 for t in ids):
            raise ValueError("token ids must be >= 0")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit() or not key.isascii():
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {value!r} for {key}")
        return bias

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid_param(
                "stream_options", "stream_options is only allowed when stream is true"
            )


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_best_of_and_echo(self) -> CompletionRequest:
        # best_of > n would rank candidates by cumulative logprob server-side; pdserve
        # returns every sample it draws, so only best_of == n (or unset) is well defined.
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of: only best_of equal to n (or unset) is supported")
        # echo with logprobs needs the prompt's logprobs, which the engine does not compute.
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: echo together with logprobs is not supported")
        return self

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    @field_validator("prompt")
    @classmethod
    def _one_prompt(
        cls, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if isinstance(prompt[0], (str, list)) and len(prompt) != 1:
                raise ValueError("batched prompts are not supported; send one prompt")
            if isinstance(prompt[0], list) and not prompt[0]:
                raise ValueError("prompt must not be empty")
        elif not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    def single_prompt(self) -> str | list[int]:
        """The one prompt, unwrapped from a one-element batch."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            return prompt[0]
        return prompt


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # History fields other servers' replies carry; they describe past turns, so replaying
    # them is harmless (the chat template sees the content only).
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JSONSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: kept under an alias.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (grammar-constrained)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None  # pdserve generates text only

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if tools:
            raise ValueError("tool calling is not supported")
        return tools

    def output_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    def num_logprobs(self) -> int | None:
        """Top-n logprobs to ask the engine for (None = no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_param("top_logprobs", "top_logprobs requires logprobs to be true")
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Request):
    """POST /tokenize with chat messages (vLLM's shape): the chat template is applied."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]


def validate_request(model: type[_Request], data: dict[str, Any]) -> Any:
    """``model.model_validate(data)`` with pydantic errors turned into a 400; unknown fields
    are dropped (and listed in ``ignored_fields()``) unless they would change the output."""
    data, ignored = _drop_unknown(model, data, "")
    messages = data.get("messages")
    if isinstance(messages, list):
        kept = []
        for i, message in enumerate(messages):
            if isinstance(message, dict):
                message, dropped = _drop_unknown(ChatMessage, message, f"messages.{i}.")
                ignored.extend(dropped)
            kept.append(message)
        data = {**data, "messages": kept}
    try:
        req = model.model_validate(data)
    except ValidationError as err:
        raise from_validation_error(err) from None
    req._ignored = tuple(ignored)
    return req


def _drop_unknown(
    model: type[_Request], data: dict[str, Any], prefix: str
) -> tuple[dict[str, Any], list[str]]:
    unknown = [key for key in data if key not in model.model_fields]
    for key in unknown:
        # Message fields describe past turns; only top-level fields steer the output.
        if not prefix and key in OUTPUT_CHANGING_FIELDS:
            raise OpenAIError(
                f"Unsupported request argument: {prefix}{key} (pdserve does not implement it, "
                "and ignoring it would change the output)",
                param=f"{prefix}{key}",
                code="unsupported_parameter",
            )
    if not unknown:
        return data, []
    return {k: v for k, v in data.items() if k not in unknown}, [prefix + k for k in unknown]


def ignored_fields_header(fields: tuple[str, ...]) -> dict[str, str]:
    """The ``Warning`` header (RFC 7234 code 299, persistent) naming ignored fields."""
    if not fields:
        return {}
    # Field names are client text: JSON-escape them so the header stays printable ASCII.
    names = ", ".join(json.dumps(f)[1:-1] for f in fields[:MAX_NAMED_IGNORED_FIELDS])
    more = len(fields) - MAX_NAMED_IGNORED_FIELDS
    if more > 0:
        names += f" and {more} more"
    return {"Warning": f'299 pdserve "Unrecognized request arguments ignored: {names}"'}


# ----------------------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(_Response):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatDelta(_Response):
    """A streamed message delta; unset fields are left out, as OpenAI sends them."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event line pair: ``data: <json>\\n\\n``."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
