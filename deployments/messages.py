"""Typed messages between pdserve's deployments (ingress -> decode -> prefill).

Every message crossing a process boundary is a pydantic model here, never a dict with
string keys. This module imports neither Ray nor torch (``pdserve.kvtransfer.types`` is pydantic
only; ``pdserve.engine.outputs`` plain dataclasses), so the ingress can import it cheaply.
The conversions between the engine's outputs and these messages live here too, next to the
models they build (``TokenLogprob.from_engine`` / ``to_engine``, ``GenerateChunk.from_output``).

Contract ingress -> decode: ``DecodeServer.generate(GenerateRequest)`` is a streaming method
yielding ``GenerateChunk``s; call it with ``handle.options(stream=True).generate.remote(req)``.
The last chunk carries ``finish_reason`` (or ``error``). A chunk with ``error`` set and no
tokens before it means the request was rejected (``error.code`` 429/503 with
``retry_after_s`` when shed, 400 when invalid, 500 otherwise).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.deployments.admission.rules import Priority
from pdserve.deployments.kv_events import KVEventBatch
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.outputs import TokenLogprob as EngineLogprob
from pdserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from pdserve.kvtransfer.types import KVTarget, TransferResult

FinishReason = Literal["stop", "length", "abort", "error"]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingOptions(_Message):
    """Sampling parameters on the wire; ``to_params()`` gives the engine's ``SamplingParams``.

    Validated on construction with the engine's own rules (ValueError naming the field).
    """

    max_tokens: int = Field(default=16, description="Most tokens to generate (>= 1).")
    min_tokens: int = Field(default=0, description="Tokens to generate before EOS may stop.")
    temperature: float = Field(default=1.0, description="0 = greedy.")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass in (0, 1].")
    top_k: int = Field(default=0, description="Top-k cut; 0 = off.")
    seed: int | None = Field(default=None, description="Per-request sampling seed.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Stop token ids.")
    ignore_eos: bool = Field(default=False, description="Keep going past EOS.")
    logprobs: int | None = Field(
        default=None, description=f"Top-n logprobs per token (0..{MAX_LOGPROBS}); None = off."
    )
    skip_special_tokens: bool = Field(default=True, description="Drop special tokens in text.")
    presence_penalty: float = Field(default=0.0, description="OpenAI presence penalty [-2, 2].")
    frequency_penalty: float = Field(default=0.0, description="OpenAI frequency penalty [-2, 2].")
    repetition_penalty: float = Field(default=1.0, description="Over prompt + output; 1 = off.")
    logit_bias: dict[int, float] = Field(
        default_factory=dict, description="Token id -> bias added to its logit ([-100, 100])."
    )
    min_p: float = Field(default=0.0, description="Min probability relative to the top token.")
    json_object: bool = Field(default=False, description="Constrain the output to a JSON object.")
    json_schema: str | None = Field(
        default=None, description="Constrain the output to this JSON schema (serialised)."
    )
    num_prior_output_tokens: int = Field(
        default=0,
        description=(
            "Output tokens produced before this request was continued on another replica "
            "(they end its prompt): seeded draws, penalties and the grammar count them as "
            "output. Set by the ingress when it migrates a stream; 0 for a new request."
        ),
    )

    @model_validator(mode="after")
    def _validate_with_engine_rules(self) -> SamplingOptions:
        self.to_params()
        return self

    def to_params(self) -> SamplingParams:
        return SamplingParams(**self.model_dump())

    @classmethod
    def from_params(cls, params: SamplingParams) -> SamplingOptions:
        return cls(
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            logprobs=params.logprobs,
            skip_special_tokens=params.skip_special_tokens,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias=dict(params.logit_bias),
            min_p=params.min_p,
            json_object=params.json_object,
            json_schema=params.json_schema,
            num_prior_output_tokens=params.num_prior_output_tokens,
        )


class GenerateRequest(_Message):
    """One generation request, tokenized by the ingress."""

    request_id: str = Field(min_length=1, description="Unique id (also the engine's id).")
    prompt_token_ids: list[int] = Field(min_length=1, description="Prompt token ids.")
    sampling: SamplingOptions = Field(default_factory=SamplingOptions, description="How to sample.")
    priority: Priority = Field(
        default="interactive",
        description="'batch' is shed first and may queue longer (AdmissionConfig).",
    )
    trace_carrier: dict[str, str] = Field(
        default_factory=dict, description="W3C trace context (traceparent/tracestate)."
    )
    arrival_time: float | None = Field(
        default=None, description="Unix time the ingress received the request (for metrics)."
    )
    admit_by: float | None = Field(
        default=None,
        description=(
            "Unix time by which the ingress wants the admission decision: the decode replica "
            "sends an ack chunk (``GenerateChunk.ack``) as soon as it admits the request, and "
            "drops it without any work past this time (the ingress has answered it 429)."
        ),
    )


class TopLogprob(_Message):
    token_id: int
    token: str
    logprob: float


class TokenLogprob(_Message):
    """Logprob of one generated token and the top alternatives at its position."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)

    @classmethod
    def from_engine(cls, lp: EngineLogprob, tokenizer: Any) -> TokenLogprob:
        """The engine's record with each token's text (``tokenizer`` decodes ids)."""
        return cls(
            token_id=lp.token_id,
            token=_token_text(tokenizer, lp.token_id),
            logprob=lp.logprob,
            top_logprobs=[
                TopLogprob(token_id=t, token=_token_text(tokenizer, t), logprob=v)
                for t, v in (lp.top_logprobs or [])
            ],
        )

    def to_engine(self) -> EngineLogprob:
        """Back to the engine's record (the texts are dropped; the engine keeps ids)."""
        return EngineLogprob(
            token_id=self.token_id,
            logprob=self.logprob,
            top_logprobs=[(t.token_id, t.logprob) for t in self.top_logprobs] or None,
        )


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


class ErrorInfo(_Message):
    """Why a request failed; ``code`` follows HTTP status semantics."""

    code: int = Field(description="HTTP-like status: 400, 429, 500, 503...")
    type: str = Field(description="OpenAI error type, e.g. 'server_error', 'overloaded'.")
    message: str = Field(description="Human-readable cause.")
    retry_after_s: float | None = Field(default=None, description="Retry-After for 429/503.")


class GenerateChunk(_Message):
    """One streamed delta from the decode server."""

    request_id: str
    token_ids: list[int] = Field(default_factory=list, description="New token ids (delta).")
    text: str = Field(default="", description="New text (delta).")
    logprobs: list[TokenLogprob] | None = Field(
        default=None, description="Logprobs of the new tokens when requested."
    )
    finish_reason: FinishReason | None = Field(default=None, description="Set on the last.")
    num_prompt_tokens: int = Field(default=0, description="Prompt length in tokens.")
    num_cached_tokens: int = Field(default=0, description="Prompt tokens served from cache.")
    num_output_tokens: int = Field(default=0, description="Output tokens generated so far.")
    prefill_location: Literal["local", "remote", "fallback"] | None = Field(
        default=None, description="Where the prompt was prefilled (first chunk only)."
    )
    predicted_ttft_s: float | None = Field(
        default=None,
        description=(
            "Admission control's predicted TTFT from arrival (the chunk with the first "
            "token only): the ingress tells the queue the prediction knew of from the one "
            "it did not (admission.StreamLimit)."
        ),
    )
    error: ErrorInfo | None = Field(default=None, description="Set when the request failed.")
    ack: bool = Field(
        default=False,
        description="The admission ack (no tokens): sent first when the request asked for it.",
    )
    replica: str | None = Field(
        default=None,
        description=(
            "The decode replica that sent it (its shed, its ack and its first chunk): the "
            "ingress closes its door only while every replica it knows sheds."
        ),
    )

    @classmethod
    def admitted(cls, request: GenerateRequest, replica: str | None = None) -> GenerateChunk:
        """The ack of an admitted request that asked for one (``admit_by``)."""
        return cls(
            request_id=request.request_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            ack=True,
            replica=replica,
        )

    @classmethod
    def overloaded(
        cls,
        request: GenerateRequest,
        message: str,
        retry_after_s: float,
        replica: str | None = None,
    ) -> GenerateChunk:
        """The one chunk of a shed request: 429 with the drain time as Retry-After, from
        ``replica`` (None: not a decode replica's own shed)."""
        return cls(
            request_id=request.request_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            replica=replica,
            error=ErrorInfo(
                code=429, type="rate_limit_error", message=message, retry_after_s=retry_after_s
            ),
        )

    @classmethod
    def from_output(cls, out: RequestOutput, tokenizer: Any, **extra: Any) -> GenerateChunk:
        """The chunk streaming the engine output ``out``'s new tokens; ``extra`` sets
        further fields (e.g. ``prefill_location`` on the first chunk)."""
        logprobs = (
            [TokenLogprob.from_engine(lp, tokenizer) for lp in out.logprobs]
            if out.logprobs
            else None
        )
        return cls(
            request_id=out.request_id,
            token_ids=list(out.new_token_ids),
            text=out.text_delta,
            logprobs=logprobs,
            finish_reason=out.finish_reason if out.finished else None,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=out.num_output_tokens,
            **extra,
        )


class PrefillRequest(_Message):
    """Decode -> prefill: compute this prompt and push its KV to ``kv_targets``."""

    request_id: str = Field(min_length=1, description="Same id as the decode-side request.")
    prompt_token_ids: list[int] = Field(min_length=1, description="Prompt token ids.")
    sampling: SamplingOptions = Field(description="Sampling of the first token.")
    kv_targets: tuple[KVTarget, ...] = Field(
        min_length=1,
        description="Where the KV goes: one target per rank of the decode replica (its "
        "blocks in that rank's pool, the KV heads that rank holds), rank order.",
    )
    window_kv_targets: tuple[KVTarget, ...] = Field(
        default=(),
        description="Where the window layers' KV goes when the decode replica keeps a "
        "window pool (deployments/window_handoff.py): one target per rank of the decode "
        "replica, as kv_targets, their first_block the first block the first decoded token's "
        "window reaches; empty when it keeps none.",
    )
    trace_carrier: dict[str, str] = Field(default_factory=dict, description="W3C context.")


class PrefillResponse(_Message):
    """Prefill -> decode: the first token, once every layer's KV has landed."""

    request_id: str
    first_token_id: int = Field(description="Token sampled after the prompt.")
    first_logprobs: TokenLogprob | None = Field(
        default=None, description="Logprob record of the first token, if asked."
    )
    transfer: TransferResult = Field(description="Sender's view of the KV push.")
    num_cached_tokens: int = Field(default=0, description="Prefix-cache hits on the prefill side.")
    prefill_tokens_per_s: float = Field(
        default=0.0, ge=0, description="The prefill engine's measured compute rate (0 = none)."
    )
    replica: str = Field(
        default="",
        description="The prefill replica that answered (its Serve tag): the decode replica's "
        "estimate counts the prefill replicas its prompts are spread over.",
    )


class ReplicaStats(_Message):
    """What each replica publishes for routing and autoscaling (record_*_stats)."""

    role: Literal["prefill", "decode"]
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_remote_kv: int = 0
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_usage: float = 0.0
    max_num_seqs: int = 1
    block_size: int = 16
    kv_bytes_per_token: int = 0
    window_kv_bytes_per_token: int = Field(
        default=0,
        ge=0,
        description="The part of kv_bytes_per_token on window layers that keep only the last "
        "kv_window tokens' blocks (a window pool): a hand-off moves those layers' blocks of "
        "the first decoded token's window only. 0: none.",
    )
    kv_window: int = Field(default=0, ge=0, description="Those window layers' window (tokens).")
    prompt_tokens_per_s: float = 0.0
    kv_events: list[KVEventBatch] = Field(
        default_factory=list,
        description="The prefix cache's latest KV-event batches, oldest first (routers "
        "index them: which replica holds which prefix).",
    )
