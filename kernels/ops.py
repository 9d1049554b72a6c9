"""The kernel dispatch layer: the only kernel API the engine and kvtransfer call.

CUDA tensors go to the Triton kernels in ``kernels/triton/`` (imported lazily, on first
CUDA call, so a machine without triton runs the CPU path); CPU tensors go to the batched
torch paths of ``kernels/cpu/batched.py`` or the references in ``kernels/reference.py``.
Shapes and the KV cache layout are those of .plan/INTERFACES.md. This module validates
arguments (ValueError naming the argument) but never allocates caches or keeps state
besides the lazy imports.

It also hands the engine what depends on the backend but is not a kernel: the linears
packed at load time, and the device runtime the model runner owns (``make_runtime``:
threads, pinning and the allocator on CPU; nothing on a GPU), whose hooks the engine calls
without knowing what they do.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import kv_quant, quant_reference, reference
from pdserve.kernels.cpu import batched as cpu
from pdserve.kernels.cpu.attention_variants import paged_attention_variants_cpu
from pdserve.kernels.cpu.cpus import RuntimeInfo, RuntimeSettings
from pdserve.kernels.cpu.linear import can_pack, pack_linears, packed_linear_float32
from pdserve.kernels.cpu.runtime import MMAP_THRESHOLD, CpuRuntime, single_threaded_copies
from pdserve.kernels.kv_quant import is_quantized_kv, kv_qmax
from pdserve.kernels.moe_ops import (
    ClampedSwiGLU,
    PackedExperts,
    PreparedExperts,
    QuantizedExperts,
    RouterConfig,
    add_shared_experts,
    fused_moe,
    pack_moe_experts,
    quantize_experts,
    select_experts,
)
from pdserve.kernels.quant_ops import Activations, is_quantized_linear, make_quantized_linear

__all__ = [
    "Activations",
    "make_quantized_linear",
    "quant_reference",
    "DeviceRuntime",
    "ClampedSwiGLU",
    "PackedExperts",
    "PreparedExperts",
    "QuantizedExperts",
    "RouterConfig",
    "add_shared_experts",
    "RuntimeInfo",
    "RuntimeSettings",
    "apply_rotary",
    "build_rope_cache",
    "fused_moe",
    "can_pack",
    "gather_blocks",
    "is_quantized_kv",
    "kv_qmax",
    "linear_float32",
    "make_runtime",
    "pack_linears",
    "pack_moe_experts",
    "quantize_experts",
    "paged_attention",
    "paged_decode_attention",
    "paged_mla_decode",
    "paged_mla_prefill",
    "prepare_copy_thread",
    "rms_norm",
    "scatter_blocks",
    "select_experts",
    "silu_and_mul",
    "warm_up_mla_decode",
    "write_kv",
]

logger = logging.getLogger(__name__)

_triton_modules: dict[str, ModuleType | None] = {}

# torch.mm(..., out_dtype=float32) on half-precision CUDA tensors (torch >= 2.8).
_HAS_MM_OUT_DTYPE = "dtype" in getattr(torch.ops.aten.mm, "overloads", lambda: [])()
# The float32 weight slice linear_float32 widens at a time: under the CPU runtime's mmap
# threshold, so each slice comes from the heap and reuses the last step's memory instead of
# a fresh mmap that page-faults every page in again, every step (docs/models.md).
_WIDEN_BYTES = MMAP_THRESHOLD // 2


def _triton(name: str, tensor: torch.Tensor) -> ModuleType | None:
    """The Triton module ``kernels/triton/<name>.py`` for a CUDA tensor, else None (torch)."""
    if tensor.device.type != "cuda":
        return None
    if name not in _triton_modules:
        try:
            _triton_modules[name] = importlib.import_module(f"pdserve.kernels.triton.{name}")
        except ImportError as exc:  # triton missing or broken: torch still works on CUDA
            logger.warning("Triton kernels unavailable (%s); using torch on CUDA", exc)
            _triton_modules[name] = None
    return _triton_modules[name]


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: expected [N, B, Hkv, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")


def _check_heads(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, Hq, D], got shape {tuple(q.shape)}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q: head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q: {q.shape[1]} query heads not a multiple of {k_cache.shape[2]}")


def _check_variants(
    q: torch.Tensor, sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None
) -> bool:
    """Validate the attention variants; True when any is set."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(
            f"sliding_window: expected a positive number of tokens, got {sliding_window}"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected a positive logit cap, got {softcap}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks: expected shape ({q.shape[1]},), got {tuple(sinks.shape)}")
    return sliding_window is not None or softcap is not None or sinks is not None


def _check_kv_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> bool:
    """Validate the scales of a quantized cache (required there, refused elsewhere); True
    when the cache is quantized."""
    quantized = kv_quant.is_quantized_kv(k_cache.dtype)
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale: given for a {k_cache.dtype} cache (not quantized)")
        return False
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or tuple(s.shape) != (k_cache.shape[2],) or s.dtype != torch.float32:
            got = None if s is None else f"{tuple(s.shape)} {s.dtype}"
            raise ValueError(
                f"{name}: a {k_cache.dtype} cache needs float32 scales of shape "
                f"({k_cache.shape[2]},), got {got}"
            )
    return True


def _check_varlen(
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
) -> None:
    """Validate a varlen batch's index tensors against its number of sequences."""
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens_q: expected shape ({num_seqs + 1},)")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected [{num_seqs}, M]")


def _check_latent_cache(
    q: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int, kv_scale: torch.Tensor | None
) -> None:
    """Validate an MLA call: one latent head per slot, wider than ``kv_lora_rank``."""
    _check_cache(cache, cache)
    _check_heads(q, cache)
    if cache.shape[2] != 1 or not 0 < kv_lora_rank < q.shape[2]:
        raise ValueError(
            f"cache: expected one latent head wider than kv_lora_rank={kv_lora_rank}, got "
            f"shape {tuple(cache.shape)}"
        )
    _check_kv_scales(cache, kv_scale, kv_scale)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor | None,  # [T, Hkv, D]; None: a one-plane cache (keys only)
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor | None,  # [N, B, Hkv, D]; None with ``value``
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
    k_scale: torch.Tensor | None = None,  # [Hkv] float32: int8 / float8 caches only
    v_scale: torch.Tensor | None = None,  # [Hkv] float32; None for a one-plane cache
) -> None:
    """Write each token's K/V into its cache slot (in place); into an int8 / float8 cache
    quantized with the layer's per-head scales (``kernels.kv_quant``). Without ``value``
    and ``v_cache`` only the keys are stored: an MLA pool's one plane, read as keys and
    values alike."""
    one_plane = value is None
    if one_plane != (v_cache is None):
        raise ValueError("value/v_cache: give both (K and V planes) or neither (one plane)")
    if v_cache is None:
        _check_cache(k_cache, k_cache)
        quantized = _check_kv_scales(k_cache, k_scale, k_scale if v_scale is None else v_scale)
    else:
        _check_cache(k_cache, v_cache)
        quantized = _check_kv_scales(k_cache, k_scale, v_scale)
    if key.shape[1:] != k_cache.shape[2:] or (value is not None and value.shape != key.shape):
        got = "" if value is None else f" / value {tuple(value.shape)}"
        raise ValueError(
            f"key: shape {tuple(key.shape)}{got} do not match "
            f"cache [*, *, {k_cache.shape[2]}, {k_cache.shape[3]}]"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping: expected shape ({key.shape[0]},)")
    mod = _triton("kv", key)
    if mod is not None:
        mod.write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    elif quantized:
        assert k_scale is not None
        # Copied as bytes: torch has no float8 index_copy_ on a CPU.
        u8 = torch.uint8
        kq = kv_quant.quantize_kv(key, k_scale, k_cache.dtype).view(u8)
        if value is None or v_cache is None:
            cpu.write_kv_cpu(kq, None, k_cache.view(u8), None, slot_mapping)
        else:
            assert v_scale is not None
            vq = kv_quant.quantize_kv(value, v_scale, v_cache.dtype).view(u8)
            cpu.write_kv_cpu(kq, vq, k_cache.view(u8), v_cache.view(u8), slot_mapping)
    else:
        cpu.write_kv_cpu(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32, context incl. new tokens
    block_tables: torch.Tensor,  # [S, M] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    k_scale: torch.Tensor | None = None,  # [Hkv] float32: int8 / float8 caches only
    v_scale: torch.Tensor | None = None,  # [Hkv] float32
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention for a mixed prefill/decode batch over paged KV; optionally over the
    last ``sliding_window`` positions only, with logits capped at ``softcap`` (tanh) and
    per-head ``sinks`` in the softmax denominator (see ``reference.paged_attention_ref``).
    An int8 / float8 cache is dequantized with ``k_scale`` / ``v_scale`` as it is read."""
    _check_cache(k_cache, v_cache)
    _check_heads(q, k_cache)
    variants = _check_variants(q, sliding_window, softcap, sinks)
    quantized = _check_kv_scales(k_cache, k_scale, v_scale)
    _check_varlen(cu_seqlens_q, seq_lens, block_tables)
    mod = _triton("prefill", q)
    if mod is not None:
        return mod.paged_attention_triton(
            q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
            sliding_window=sliding_window, softcap=softcap, sinks=sinks,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    if quantized:
        assert k_scale is not None and v_scale is not None
        k_cache, v_cache, block_tables = kv_quant.dequantized_context(
            k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, q.dtype
        )
    if variants:
        return paged_attention_variants_cpu(
            q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
            sliding_window, softcap, sinks,
        )  # fmt: skip
    return cpu.paged_attention_cpu(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)


def paged_decode_attention(
    q: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    k_scale: torch.Tensor | None = None,  # [Hkv] float32: int8 / float8 caches only
    v_scale: torch.Tensor | None = None,  # [Hkv] float32
) -> torch.Tensor:  # [S, Hq, D]
    """One new token per sequence against its whole paged context (or its window; the
    variants and a quantized cache as in ``paged_attention``)."""
    _check_cache(k_cache, v_cache)
    _check_heads(q, k_cache)
    variants = _check_variants(q, sliding_window, softcap, sinks)
    quantized = _check_kv_scales(k_cache, k_scale, v_scale)
    if seq_lens.shape != (q.shape[0],):
        raise ValueError(f"seq_lens: expected shape ({q.shape[0]},)")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables: expected [{q.shape[0]}, M]")
    mod = _triton("decode", q)
    if mod is not None:
        return mod.paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, scale,
            sliding_window=sliding_window, softcap=softcap, sinks=sinks,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    if quantized:
        assert k_scale is not None and v_scale is not None
        k_cache, v_cache, block_tables = kv_quant.dequantized_context(
            k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, q.dtype
        )
    if variants:
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        return paged_attention_variants_cpu(
            q, k_cache, v_cache, cu, seq_lens, block_tables, scale, sliding_window, softcap, sinks
        )
    return cpu.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_mla_decode(
    q: torch.Tensor,  # [S, H, L + R]: absorbed query, then roped query
    cache: torch.Tensor,  # [N, B, 1, L + R]: latent, then rope key
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,  # [1] float32: int8 / float8 caches only
) -> torch.Tensor:  # [S, H, L]
    """Multi-head latent attention decode over a one-plane latent cache: each head's
    softmax-weighted latent (``reference.paged_mla_decode_ref``). CUDA: the MLA kernel
    (``triton/mla_decode.py``), a head block per program; elsewhere, or for widths it does
    not take, the MQA decode path with the cache as keys and values."""
    _check_latent_cache(q, cache, kv_lora_rank, kv_scale)
    if seq_lens.shape != (q.shape[0],):
        raise ValueError(f"seq_lens: expected shape ({q.shape[0]},)")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables: expected [{q.shape[0]}, M]")
    mod = _triton("mla_decode", q)
    if mod is not None and mod.supports(kv_lora_rank, q.shape[2] - kv_lora_rank):
        return mod.paged_mla_decode_triton(
            q, cache, block_tables, seq_lens, scale, kv_lora_rank, kv_scale
        )
    out = paged_decode_attention(
        q, cache, cache, block_tables, seq_lens, scale, k_scale=kv_scale, v_scale=kv_scale
    )
    return out[..., :kv_lora_rank]


def paged_mla_prefill(
    q: torch.Tensor,  # [T, H, L + R]: absorbed query, then roped query
    cache: torch.Tensor,  # [N, B, 1, L + R]: latent, then rope key
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32, context incl. the new tokens
    block_tables: torch.Tensor,  # [S, M] int32
    scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,  # [1] float32: int8 / float8 caches only
) -> torch.Tensor:  # [T, H, L]
    """Multi-head latent attention for a mixed prefill/decode batch over a one-plane latent
    cache: each new token's and head's softmax-weighted latent over its causal context
    (``reference.paged_mla_prefill_ref``). CUDA: the MLA prefill kernel
    (``triton/mla_prefill.py``), a head block per program; elsewhere, or for widths it does
    not take, ``paged_attention`` with the cache as keys and values."""
    _check_latent_cache(q, cache, kv_lora_rank, kv_scale)
    _check_varlen(cu_seqlens_q, seq_lens, block_tables)
    mod = _triton("mla_prefill", q)
    if mod is not None and mod.supports(kv_lora_rank, q.shape[2] - kv_lora_rank):
        return mod.paged_mla_prefill_triton(
            q, cache, cu_seqlens_q, seq_lens, block_tables, scale, kv_lora_rank, kv_scale
        )
    out = paged_attention(
        q, cache, cache, cu_seqlens_q, seq_lens, block_tables, scale,
        k_scale=kv_scale, v_scale=kv_scale,
    )  # fmt: skip
    return out[..., :kv_lora_rank]


def warm_up_mla_decode(
    num_heads: int,
    kv_lora_rank: int,
    slot_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Compile every variant of the MLA decode kernel the engine may pick (CUDA; else 0)."""
    mod = _triton("mla_decode", torch.empty(0, device=device))
    if mod is None or not mod.supports(kv_lora_rank, slot_dim - kv_lora_rank):
        return 0
    return mod.warm_up_mla(num_heads, kv_lora_rank, slot_dim, block_size, dtype, device)


def warm_up_attention(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Compile every decode-attention variant the engine may pick (CUDA; 0 elsewhere)."""
    mod = _triton("decode", torch.empty(0, device=device))
    if mod is None:
        return 0
    return mod.warm_up(num_heads, num_kv_heads, head_dim, block_size, dtype, device)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H], any float dtype (the model's: float32)
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with ``residual`` returns ``(norm(x + residual), x + residual)``, the sum
    taken in float32 and kept in the residual's dtype; the output is computed in float32
    and rounded once to ``out_dtype`` (default x's dtype). See ``reference.rms_norm_ref``."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight: expected shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual: shape {tuple(residual.shape)} != x {tuple(x.shape)}")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype: expected a floating-point dtype, got {out_dtype}")
    mod = _triton("norm", x)
    if mod is not None:
        return mod.rms_norm_triton(x, weight, eps, residual, out_dtype)
    return cpu.rms_norm_cpu(x, weight, eps, residual, out_dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(x[:, :I]) * x[:, I:]``: the activation of a fused gate/up projection, in
    float32 and rounded once."""
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"x: expected [T, 2 * intermediate], got {tuple(x.shape)}")
    if x.device.type == "cpu":
        return cpu.silu_and_mul_cpu(x)
    mod = _triton("activation", x)
    if mod is not None:
        return mod.silu_and_mul_triton(x)
    return reference.silu_and_mul_ref(x)


def linear_float32(
    x: torch.Tensor,  # [M, K] float32
    layer: nn.Module,  # an nn.Linear or what pack_linears made of one
) -> torch.Tensor:  # [M, N] float32
    """``layer(x)`` with float32 sums and a float32 result whatever the weight's dtype: the
    projection to the logits, never rounded to a half-precision dtype (a near-tie between
    two tokens is the model's, not bf16's). A half-precision matmul takes ``x`` rounded
    once to the weight's dtype (the AVX512-BF16 kernel, CUDA); the widening fallback takes
    it exactly."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [M, K], got {tuple(x.shape)}")
    x = x.float()
    if is_quantized_linear(layer):  # EngineConfig.quantize_lm_head: float32 in and out
        return layer(x).float()
    packed = packed_linear_float32(x, layer)
    if packed is not None:
        return packed
    weight, bias = layer.weight, layer.bias
    if not isinstance(weight, torch.Tensor) or not (bias is None or isinstance(bias, torch.Tensor)):
        raise TypeError(f"layer: expected an nn.Linear-like module, got {type(layer).__name__}")
    bias = None if bias is None else bias.float()
    if weight.dtype == torch.float32:
        return F.linear(x, weight, bias)
    global _HAS_MM_OUT_DTYPE
    if weight.is_cuda and _HAS_MM_OUT_DTYPE:
        # A half-precision matmul with float32 sums and result, the weight read as it is.
        try:
            out = torch.mm(x.to(weight.dtype), weight.t(), out_dtype=torch.float32)
            return out if bias is None else out + bias
        except (NotImplementedError, RuntimeError) as exc:  # a build without the kernel
            logger.warning("torch.mm(out_dtype=float32) unavailable (%s); widening instead", exc)
            _HAS_MM_OUT_DTYPE = False
    # Elsewhere the weight is widened a slice at a time (bounded temporary memory).
    rows = max(1, _WIDEN_BYTES // (4 * weight.shape[1]))
    parts = [
        F.linear(x, weight[i : i + rows].float(), None if bias is None else bias[i : i + rows])
        for i in range(0, weight.shape[0], rows)
    ]
    return torch.cat(parts, dim=-1)


def build_rope_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:  # [max_position, head_dim]
    """cos/sin table (cos first half, sin second); built once, so torch on every device."""
    return reference.build_rope_cache_ref(head_dim, max_position, base, rope_scaling, dtype, device)


def apply_rotary(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [P, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of q and k at ``positions`` (returns new tensors)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q/k: expected [T, H, D] each, got {tuple(q.shape)}, {tuple(k.shape)}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions: expected shape ({q.shape[0]},)")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != q.shape[2]:
        raise ValueError(f"cos_sin_cache: expected [P, {q.shape[2]}]")
    mod = _triton("rotary", q)
    if mod is not None:
        return mod.apply_rotary_triton(positions, q, k, cos_sin_cache)
    return cpu.apply_rotary_cpu(positions, q, k, cos_sin_cache)


def _check_blocks(kv: torch.Tensor, block_ids: torch.Tensor) -> None:
    if kv.dim() < 4:
        raise ValueError(f"kv: expected [..., N, B, Hkv, D], got shape {tuple(kv.shape)}")
    if block_ids.dim() != 1:
        raise ValueError("block_ids: expected a 1-D tensor")


def gather_blocks(
    kv: torch.Tensor,  # [..., N, B, Hkv, D]
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [..., n, B, Hkv, D] contiguous
    """Pack the listed blocks into one contiguous buffer (block dim is -4)."""
    _check_blocks(kv, block_ids)
    mod = _triton("kv", kv)
    if mod is not None:
        return mod.gather_blocks_triton(kv, block_ids)
    return reference.gather_blocks_ref(kv, block_ids)


def scatter_blocks(
    buf: torch.Tensor,  # [..., n, B, Hkv, D]
    kv: torch.Tensor,  # [..., N, B, Hkv, D]
    block_ids: torch.Tensor,  # [n] int64
) -> None:
    """Unpack ``buf`` into the listed blocks of ``kv`` (in place)."""
    _check_blocks(kv, block_ids)
    expected = (*kv.shape[:-4], block_ids.shape[0], *kv.shape[-3:])
    if tuple(buf.shape) != expected:
        raise ValueError(f"buf: expected shape {expected}, got {tuple(buf.shape)}")
    mod = _triton("kv", kv)
    if mod is not None:
        mod.scatter_blocks_triton(buf, kv, block_ids)
    else:
        reference.scatter_blocks_ref(buf, kv, block_ids)


# ---- the device runtime -------------------------------------------------------------------


class DeviceRuntime(Protocol):
    """How an engine process computes on its device, behind hooks the engine calls at fixed
    points without knowing what they do (see ``kernels/cpu/runtime.py`` for the CPU's)."""

    def prepare_process(self) -> None:
        """Once, when the model runner starts, before the model loads."""

    def on_engine_thread_start(self) -> None:
        """On the engine's step thread, before its first step."""

    def before_step(self, num_tokens: int) -> None:
        """Before each forward pass of ``num_tokens`` tokens, on the engine's thread."""

    def describe(self) -> RuntimeInfo:
        """Where the engine computes (CPUs it is bound to), for reports."""


class _AcceleratorRuntime:
    """A GPU engine's runtime: torch's CPU threads follow the replica's ``num_cpus``, as on
    every device; the CPU settings (binding, helpers, niceness) do not apply."""

    def __init__(self, device: torch.device, settings: RuntimeSettings | None) -> None:
        self.device = device
        self.settings = settings

    def prepare_process(self) -> None:
        if self.settings is None:
            return
        if self.settings.num_cpus is not None:
            torch.set_num_threads(max(1, int(self.settings.num_cpus)))
        logger.info(
            "device %s: the pool's cpu settings (binding, helper threads, niceness) are ignored",
            self.device.type,
        )

    def on_engine_thread_start(self) -> None:
        pass

    def before_step(self, num_tokens: int) -> None:
        pass

    def describe(self) -> RuntimeInfo:
        return RuntimeInfo()


def make_runtime(device: torch.device, settings: RuntimeSettings | None = None) -> DeviceRuntime:
    """The runtime of an engine on ``device``; ``settings`` None = no replica asked for any
    (a standalone engine: CPU defaults, nothing logged on a GPU). Resolves the CPU settings
    (ValueError naming a bad CPU list) but changes nothing until its hooks run."""
    if device.type == "cpu":
        return CpuRuntime(settings)
    return _AcceleratorRuntime(device, settings)


def prepare_copy_thread() -> None:
    """Call at the top of a thread that copies tensors beside the engine (kvtransfer's I/O
    threads): on CPU its copies then run on it alone instead of opening a parallel team
    that competes with the engine's step for the cores. Changes only the calling thread."""
    single_threaded_copies()
