"""Conversions between the engine's outputs and the wire messages (logprobs, chunks)."""

from __future__ import annotations

from typing import Any

from pdserve.deployments.messages import GenerateChunk, TokenLogprob, TopLogprob
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.outputs import TokenLogprob as EngineLogprob


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def to_wire_logprob(lp: EngineLogprob, tokenizer: Any) -> TokenLogprob:
    return TokenLogprob(
        token_id=lp.token_id,
        token=token_text(tokenizer, lp.token_id),
        logprob=lp.logprob,
        top_logprobs=[
            TopLogprob(token_id=t, token=token_text(tokenizer, t), logprob=v)
            for t, v in (lp.top_logprobs or [])
        ],
    )


def to_engine_logprob(lp: TokenLogprob | None) -> EngineLogprob | None:
    if lp is None:
        return None
    return EngineLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_logprobs=[(t.token_id, t.logprob) for t in lp.top_logprobs] or None,
    )


def chunk_from_output(out: RequestOutput, tokenizer: Any, **extra: Any) -> GenerateChunk:
    logprobs = [to_wire_logprob(lp, tokenizer) for lp in out.logprobs] if out.logprobs else None
    return GenerateChunk(
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
