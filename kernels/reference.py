"""Pure-torch reference implementations of every kernel in pdserve.

These are the test oracle for the Triton kernels and the fallback CPU path. They favour
obviousness over speed: per-sequence loops, float32 math, dense softmax. They must never be
"optimised" in ways that make them harder to check by eye; fast CPU paths live in
``kernels/cpu/batched.py``.

KV cache layout (see .plan/INTERFACES.md): ``k_cache``/``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; ``slot = block_id * block_size + offset``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "apply_rotary_ref",
    "build_rope_cache_ref",
    "gather_blocks_ref",
    "paged_attention_ref",
    "paged_decode_attention_ref",
    "rms_norm_ref",
    "scatter_blocks_ref",
    "silu_and_mul_ref",
    "write_kv_ref",
    "paged_mla_decode_ref",
    "paged_mla_prefill_ref",
]


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor | None,  # [T, Hkv, D]; None: a one-plane cache (keys only)
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor | None,  # [N, B, Hkv, D]; None with ``value``
    slot_mapping: torch.Tensor,  # [T] int64; < 0 means padding (skipped)
) -> None:
    """Store each token's K/V row at its slot (in place)."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    if value is not None and v_cache is not None:
        v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def _gather_context(
    cache: torch.Tensor,  # [N, B, Hkv, D]
    block_table: torch.Tensor,  # [M]
    length: int,
) -> torch.Tensor:  # [length, Hkv, D]
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    ids = block_table[:num_blocks].to(device=cache.device, dtype=torch.int64)
    return cache[ids].reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32, total context incl. the new tokens
    block_tables: torch.Tensor,  # [S, M] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of a variable-length batch of new tokens over paged KV.

    Query j of sequence s sits at position ``seq_lens[s] - q_len_s + j`` and attends to every
    position <= it (with ``sliding_window`` W: only the last W positions, itself included).
    Query head h reads KV head ``h // (Hq // Hkv)``. ``softcap`` c caps the scaled logits
    as ``c * tanh(logit / c)`` (Gemma 2); ``sinks`` adds one logit per query head to the
    softmax's denominator only (gpt-oss attention sinks).
    """
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for s, ctx in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = _gather_context(k_cache, block_tables[s], ctx).float()  # [L, Hkv, D]
        v = _gather_context(v_cache, block_tables[s], ctx).float()
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[start:end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [Hq, q_len, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, L]
        if sliding_window is not None:
            visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().to(q.device)[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [S, Hq, D]
    """One query token per sequence (the last position) against its whole context (or its
    window); ``softcap`` and ``sinks`` as in ``paged_attention_ref``."""
    num_seqs = q.shape[0]
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)
    return paged_attention_ref(
        q, k_cache, v_cache, cu, seq_lens, block_tables, scale, sliding_window, softcap, sinks
    )


def paged_mla_decode_ref(
    q: torch.Tensor,  # [S, H, L + R]: absorbed query, then roped query
    cache: torch.Tensor,  # [N, B, 1, L + R]: latent, then rope key
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [S, H, L]
    """MLA decode: every head scores the whole slot (``q . [c, k_pe]``) and takes the
    softmax-weighted latent ``c`` (the slot's first ``kv_lora_rank`` columns)."""
    out = paged_decode_attention_ref(q, cache, cache, block_tables, seq_lens, scale)
    return out[..., :kv_lora_rank].contiguous()


def paged_mla_prefill_ref(
    q: torch.Tensor,  # [T, H, L + R]: absorbed query, then roped query
    cache: torch.Tensor,  # [N, B, 1, L + R]: latent, then rope key
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32, context incl. the new tokens
    block_tables: torch.Tensor,  # [S, M] int32
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [T, H, L]
    """MLA prefill: each new token, per head, scores the slots of its causal context
    (``q . [c, k_pe]``, as ``paged_attention_ref`` places the new tokens) and takes the
    softmax-weighted latent ``c``."""
    out = paged_attention_ref(q, cache, cache, cu_seqlens_q, seq_lens, block_tables, scale)
    return out[..., :kv_lora_rank].contiguous()


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over a residual stream; with ``residual``: returns ``(norm(s), s)`` where
    ``s = x + residual``.

    The sum is taken in float32 and stored in the residual's dtype (the model keeps the
    stream in float32, so a bf16 layer output is added without rounding the stream); the
    statistics are float32, and ``weight * s / rms(s)`` is computed in float32 and rounded
    once to ``out_dtype`` (default: x's dtype). In float32 this is HF Llama's RMSNorm; in
    bf16 it leaves out HF's two extra roundings (of the sum, and of the normalised value
    before the weight multiply).
    """
    out_dtype = out_dtype or x.dtype
    s = x if residual is None else (x.float() + residual.float()).to(residual.dtype)
    sf = s.float()
    variance = sf.pow(2).mean(dim=-1, keepdim=True)
    out = (weight.float() * (sf * torch.rsqrt(variance + eps))).to(out_dtype)
    return out if residual is None else (out, s)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """``silu(gate) * up`` of a fused gate/up projection in float32, rounded once."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _rope_inv_freq(
    head_dim: int, base: float, rope_scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2], factor on cos and sin) of a RoPE variant, HF semantics."""
    # Same expression as HF's _compute_default_rope_parameters so float32 results match bitwise.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = None
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq, 1.0
    assert rope_scaling is not None  # rope_type came from it
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, head_dim, base, rope_scaling)
    raise ValueError(
        f"rope_scaling.rope_type: unsupported {rope_type!r} (default, linear, llama3, yarn)"
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(
    inv_freq: torch.Tensor, head_dim: int, base: float, p: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that rotate fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), those rotating more than ``beta_fast`` times
    kept, a linear ramp between; cos and sin are scaled by the attention factor."""
    factor = float(p["factor"])
    original = float(p["original_max_position_embeddings"])
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(float(p.get("beta_fast") or 32))
    high = correction_dim(float(p.get("beta_slow") or 1))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    # HF's expression (1 / (factor * base^e), not inv_freq / factor): float32 results match.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    interpolation = 1.0 / (factor * base**exponents)
    inv = interpolation * (1 - extrapolation) + inv_freq * extrapolation
    return inv, float(attention_factor)


def build_rope_cache_ref(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:  # [max_position, head_dim]: cos in the first half, sin in the second
    """cos/sin table for neox-style (rotate_half) rotary embedding, HF semantics."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: must be a positive even number, got {head_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position: must be positive, got {max_position}")
    inv_freq, attention_factor = _rope_inv_freq(head_dim, base, rope_scaling)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)  # [P, D/2]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    if attention_factor != 1.0:
        cache = cache * attention_factor
    return cache.to(dtype=dtype, device=device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def apply_rotary_ref(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [P, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions (new tensors; math in float32)."""
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache[positions.to(cos_sin_cache.device, torch.int64)].float()  # [T, D]
    cos = rows[:, None, :half]
    sin = rows[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def gather_blocks_ref(
    kv: torch.Tensor,  # [..., N, B, Hkv, D]
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [..., n, B, Hkv, D] contiguous
    """Pack the listed blocks (block dim is -4) into one contiguous buffer."""
    return kv.index_select(kv.dim() - 4, block_ids.to(kv.device, torch.int64)).contiguous()


def scatter_blocks_ref(
    buf: torch.Tensor,  # [..., n, B, Hkv, D]
    kv: torch.Tensor,  # [..., N, B, Hkv, D]
    block_ids: torch.Tensor,  # [n] int64
) -> None:
    """Unpack ``buf`` into the listed blocks of ``kv`` (in place)."""
    kv.index_copy_(kv.dim() - 4, block_ids.to(kv.device, torch.int64), buf.to(kv.dtype))
