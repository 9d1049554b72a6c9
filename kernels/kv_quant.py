"""A quantized KV cache (int8 or float8 e4m3): the torch references and the CPU path.

A quantized pool holds ``round(x / scale)`` per layer, K or V, and KV head: ``scale`` is a
float32 ``[Hkv]`` vector of each layer's K and of its V. Values are clamped to the type's
range (+-127 for int8, +-448 for e4m3); int8 rounds half away from zero, e4m3 to nearest
even (the hardware's conversion). The Triton kernels do the same (``kernels/triton/kv.py``
on write; ``decode.py`` / ``prefill.py`` fold the K scale into the softmax scale and the V
scale into the output); on a CPU the blocks a step reads are dequantized into the query's
dtype and the float kernels run on them. This module never allocates a pool.
"""

from __future__ import annotations

import torch

from pdserve.kernels import reference
from pdserve.kernels.cpu.batched import _per_step

__all__ = [
    "QUANTIZED_KV_DTYPES",
    "dequantize_kv",
    "dequantized_context",
    "is_quantized_kv",
    "kv_qmax",
    "paged_attention_quant_ref",
    "quantize_kv",
    "write_kv_quant_ref",
]

QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)


def is_quantized_kv(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_KV_DTYPES


def kv_qmax(dtype: torch.dtype) -> float:
    """Largest magnitude a quantized KV element holds."""
    if dtype == torch.int8:
        return 127.0
    if dtype == torch.float8_e4m3fn:
        return float(torch.finfo(torch.float8_e4m3fn).max)
    raise ValueError(f"dtype: {dtype} is not a quantized KV dtype (int8, float8_e4m3fn)")


def quantize_kv(
    x: torch.Tensor,  # [T, Hkv, D]
    scale: torch.Tensor,  # [Hkv] float32
    dtype: torch.dtype,
) -> torch.Tensor:  # [T, Hkv, D] in dtype
    """``x / scale`` per head, clamped to the type's range, rounded, stored as ``dtype``."""
    qmax = kv_qmax(dtype)
    y = (x.float() / scale.to(x.device, torch.float32)[:, None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = y.sign() * (y.abs() + 0.5).floor()  # half away from zero, as the Triton kernel
    return y.to(dtype)


def dequantize_kv(
    xq: torch.Tensor,  # [..., Hkv, D] quantized
    scale: torch.Tensor,  # [Hkv] float32
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., Hkv, D] in dtype
    return (xq.float() * scale.to(xq.device, torch.float32)[:, None]).to(dtype)


def write_kv_quant_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D] int8 / float8_e4m3fn
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
    k_scale: torch.Tensor,  # [Hkv] float32
    v_scale: torch.Tensor,  # [Hkv] float32
) -> None:
    """Quantize each token's K/V with its layer's scales and store it at its slot."""
    kq = quantize_kv(key, k_scale, k_cache.dtype)
    vq = quantize_kv(value, v_scale, v_cache.dtype)
    reference.write_kv_ref(kq, vq, k_cache, v_cache, slot_mapping)


def dequantized_context(
    k_cache: torch.Tensor,  # [N, B, Hkv, D] quantized
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    k_scale: torch.Tensor,  # [Hkv] float32
    v_scale: torch.Tensor,  # [Hkv] float32
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [n, B, Hkv, D] x2, [S, M'] int32
    """The blocks the sequences read, dequantized into ``dtype`` caches of their own, and
    the block tables renumbered into them (the CPU attention's input)."""
    num_blocks, block_size = k_cache.shape[:2]
    ids, tables = _per_step(
        f"kvquant/{num_blocks}/{block_size}",
        (block_tables, seq_lens),
        lambda: _renumbered(block_tables, seq_lens, block_size),
    )
    k = dequantize_kv(k_cache.index_select(0, ids), k_scale, dtype)
    v = dequantize_kv(v_cache.index_select(0, ids), v_scale, dtype)
    return k, v, tables


def _renumbered(
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [n] int64 block ids, [S, M'] int32 tables
    """The distinct blocks the sequences read, and their tables as indices into them (the
    same for every layer of a step, so computed once per step)."""
    width = max(1, -(-int(seq_lens.max()) // block_size)) if seq_lens.numel() else 1
    # Entries past a sequence's blocks are never read: any valid id will do.
    tables = block_tables[:, :width].to(torch.int64).clamp(min=0)
    ids, inverse = torch.unique(tables, return_inverse=True)
    return ids, inverse.to(torch.int32).view(tables.shape)


def paged_attention_quant_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D] quantized
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, M] int32
    scale: float,
    k_scale: torch.Tensor,  # [Hkv] float32
    v_scale: torch.Tensor,  # [Hkv] float32
) -> torch.Tensor:  # [T, Hq, D]
    """``reference.paged_attention_ref`` over the whole pool dequantized in float32."""
    k = dequantize_kv(k_cache, k_scale, torch.float32)
    v = dequantize_kv(v_cache, v_scale, torch.float32)
    out = reference.paged_attention_ref(
        q.float(), k, v, cu_seqlens_q, seq_lens, block_tables, scale
    )
    return out.to(q.dtype)
