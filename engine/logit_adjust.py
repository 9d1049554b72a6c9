"""Per-request logit adjustments before sampling: ``logit_bias``, the repetition, frequency
and presence penalties, and ``min_p``.

Order (vLLM's): bias, then penalties on the raw logits; ``min_p`` later, on the
temperature-scaled distribution. Repetition follows transformers'
``RepetitionPenaltyLogitsProcessor`` over prompt and output tokens (a positive logit is
divided by the penalty, a negative one multiplied); frequency and presence follow OpenAI's
formula over the generated tokens only: ``logit -= count * frequency + (count > 0) * presence``.
Rows without adjustments are left untouched (and cost nothing). Never touches the KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.sampling_params import SamplingParams


def adjust_logits(
    logits: torch.Tensor,  # [S, V] float32, modified in place
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]],  # per row: (prompt, output) ids
) -> torch.Tensor:
    """Apply each row's logit bias and penalties; returns ``logits``."""
    vocab = logits.shape[1]
    device = logits.device
    for i, p in enumerate(params):
        if p.logit_bias:
            # Ids past the vocabulary are refused at the API; here they are simply absent.
            ids = [t for t, _ in p.logit_bias if t < vocab]
            bias = [b for t, b in p.logit_bias if t < vocab]
            logits[i, ids] += torch.tensor(bias, device=device)
        if not p.needs_history:
            continue
        prompt, output = histories[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*prompt, *output}), dtype=torch.long, device=device)
            seen = seen[seen < vocab]
            scores = logits[i, seen]
            penalty = p.repetition_penalty
            logits[i, seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
        if (p.frequency_penalty or p.presence_penalty) and output:
            out = torch.tensor(list(output), dtype=torch.long, device=device)
            counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
            logits[i] -= counts * p.frequency_penalty + (counts > 0) * p.presence_penalty
    return logits


def apply_min_p(
    scaled: torch.Tensor,  # [S, V] temperature-scaled logits of sampled rows
    min_ps: Sequence[float],
) -> torch.Tensor:
    """Set to -inf every token whose probability is below ``min_p`` x the top one's."""
    if not any(m > 0.0 for m in min_ps):
        return scaled
    probs = scaled.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(
        list(min_ps), device=scaled.device, dtype=probs.dtype
    ).unsqueeze(1)
    return scaled.masked_fill(probs < threshold, float("-inf"))
