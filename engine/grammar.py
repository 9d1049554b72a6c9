"""Grammar-constrained sampling (JSON mode, JSON schema) with xgrammar, the structured-output
library vLLM and SGLang use.

One ``xgrammar.GrammarMatcher`` per structured request, keyed by request id. Before each
pick the matcher masks every token that cannot continue valid output; after it, the
matcher accepts the picked token. A matcher catches up on output tokens it has not seen
(the first token sampled on a prefill replica, tokens kept across a preemption), so the
request's own token history is the source of truth. The mask is applied in torch on any
device. xgrammar is imported on the first structured request only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.sampling_params import SamplingParams

JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass
class _State:
    matcher: Any  # xgrammar.GrammarMatcher
    consumed: int  # output tokens the matcher has accepted


class GrammarBackend:
    """Compiles grammars (cached by schema) and keeps each structured request's matcher."""

    def __init__(self, tokenizer: Any, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._vocab_size = 0
        self._compiled: dict[str, Any] = {}
        self._states: dict[str, _State] = {}

    def mask(
        self,
        logits: torch.Tensor,  # [S, V], modified in place
        rows: Sequence[tuple[str, SamplingParams, Sequence[int]]],  # (id, params, output ids)
    ) -> torch.Tensor:
        import xgrammar as xgr

        bitmask = None
        for i, (request_id, params, output) in enumerate(rows):
            if not params.structured:
                continue
            state = self._state(request_id, params, logits.shape[1])
            for token in output[state.consumed :]:
                state.matcher.accept_token(token)
            state.consumed = len(output)
            if bitmask is None:
                bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
            state.matcher.fill_next_token_bitmask(bitmask, i)
        if bitmask is not None:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        return logits

    def accept(
        self, rows: Sequence[tuple[str, SamplingParams, Sequence[int]]], token_ids: Sequence[int]
    ) -> None:
        for (request_id, params, _), token in zip(rows, token_ids, strict=True):
            state = self._states.get(request_id) if params.structured else None
            if state is not None:
                state.matcher.accept_token(token)
                state.consumed += 1

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def _state(self, request_id: str, params: SamplingParams, vocab_size: int) -> _State:
        state = self._states.get(request_id)
        if state is None:
            import xgrammar as xgr

            # JSON mode is "a JSON object" (OpenAI's json_object), as a schema.
            key = params.json_schema or JSON_OBJECT_SCHEMA
            if key not in self._compiled:
                compiler = self._compiler_for(vocab_size)
                # No free whitespace between JSON tokens: a model may otherwise emit
                # whitespace until max_tokens instead of closing the object.
                self._compiled[key] = compiler.compile_json_schema(key, any_whitespace=False)
            state = self._states[request_id] = _State(xgr.GrammarMatcher(self._compiled[key]), 0)
        return state

    def _compiler_for(self, vocab_size: int) -> Any:
        import xgrammar as xgr

        if self._compiler is None or self._vocab_size != vocab_size:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info)
            self._vocab_size = vocab_size
            self._compiled.clear()
        return self._compiler


def check_json_schema(schema: str) -> None:
    """Raise ``ValueError`` if xgrammar cannot turn ``schema`` into a grammar."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(schema)
    except Exception as err:  # xgrammar raises RuntimeError/ValueError variants
        raise ValueError(f"json_schema: xgrammar cannot compile it: {err}") from None
