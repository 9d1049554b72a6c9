"""CPU paged attention with the variants some models need: a sliding window, logit
softcapping (Gemma 2) and attention sinks (gpt-oss).

SDPA's fused kernels take neither a softcap nor sinks, so these steps run one batched torch
computation per sequence, in float32, over only the keys the sequence can see (its window,
not its whole context). Plain causal attention never comes here: it keeps the fast paths of
``kernels/cpu/batched.py``. Checked against ``kernels/reference.py``.
"""

from __future__ import annotations

import torch

__all__ = ["paged_attention_variants_cpu"]


def paged_attention_variants_cpu(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, M] int32
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [Hq]
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of a mixed batch, each query seeing the last ``sliding_window``
    positions (all without one), logits capped as ``softcap * tanh(logit / softcap)``, and
    ``sinks`` added to each head's softmax denominator."""
    out = torch.empty_like(q)
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    sink = None if sinks is None else sinks.float().view(hkv, group, 1, 1)
    cu = cu_seqlens_q.tolist()
    tables = block_tables.to(torch.int64)
    for s, ctx in enumerate(seq_lens.tolist()):
        start, end = cu[s], cu[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        first = 0 if sliding_window is None else max(0, ctx - q_len - sliding_window + 1)
        # Gather whole blocks from the first visible one; `lo` is where `first` sits in them.
        b0, b1 = first // block_size, (ctx + block_size - 1) // block_size
        lo = first - b0 * block_size
        ids = tables[s, b0:b1]
        k = k_cache[ids].flatten(0, 1)[lo : ctx - b0 * block_size].float()  # [L, Hkv, D]
        v = v_cache[ids].flatten(0, 1)[lo : ctx - b0 * block_size].float()
        qs = q[start:end].float().view(q_len, hkv, group, -1)  # [q, Hkv, G, D]
        scores = torch.einsum("qhgd,khd->hgqk", qs, k) * scale  # [Hkv, G, q, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        k_pos = torch.arange(first, ctx)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sink is not None:
            sink_col = sink.expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v)  # [q, Hkv, G, D]
        out[start:end] = o.reshape(q_len, q.shape[1], -1).to(q.dtype)
    return out
