"""Triton kernels that move KV rows and blocks: cache write, block gather and block scatter.

Imported only for CUDA tensors (by ``pdserve.kernels.ops``) or by the interpreter tests. All offsets
into the cache are computed in int64: a cache of a few GB holds more than 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.kv_quant import is_quantized_kv, kv_qmax

__all__ = ["gather_blocks_triton", "scatter_blocks_triton", "write_kv_triton"]


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [N, B, Hkv, D]
    v_cache_ptr,  # [N, B, Hkv, D]
    slot_ptr,  # [T] int64
    k_scale_ptr,  # [Hkv] float32 (QUANT)
    v_scale_ptr,  # [Hkv] float32 (QUANT)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcn,
    stride_kcb,
    stride_kch,
    stride_vcn,
    stride_vcb,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is int8 / float8: store x / scale, clamped to QMAX
    QMAX: tl.constexpr,
    ROUND: tl.constexpr,  # int8: round half away from zero before the cast
    HAS_VALUE: tl.constexpr,  # False: a one-plane cache (MLA latent), keys only
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    if QUANT:
        k = _quantize(
            k, tl.load(k_scale_ptr + heads, mask=heads < NUM_HEADS, other=1.0), QMAX, ROUND
        )
    k_dst = k_cache_ptr + block * stride_kcn + offset * stride_kcb + heads * stride_kch + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if HAS_VALUE:
        v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        if QUANT:
            v = _quantize(
                v, tl.load(v_scale_ptr + heads, mask=heads < NUM_HEADS, other=1.0), QMAX, ROUND
            )
        v_dst = v_cache_ptr + block * stride_vcn + offset * stride_vcb + heads * stride_vch + dims
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize(x, scale, QMAX: tl.constexpr, ROUND: tl.constexpr):
    y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -QMAX), QMAX)
    if ROUND:
        y = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
    return y


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def write_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor | None,  # [T, Hkv, D]; None: a one-plane cache (keys only)
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor | None,  # [N, B, Hkv, D]; None with ``value``
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
    k_scale: torch.Tensor | None = None,  # [Hkv] float32: int8 / float8 caches only
    v_scale: torch.Tensor | None = None,  # [Hkv] float32
) -> None:
    """Store each token's K/V row at its slot (in place), quantized with the per-head
    scales into an int8 / float8 cache (``kernels.kv_quant``)."""
    has_value = value is not None and v_cache is not None
    if not has_value:  # the value arguments of a one-plane write are never read
        value, v_cache, v_scale = key, k_cache, k_scale
    assert value is not None and v_cache is not None
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head_dim axis must be contiguous")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    slot_mapping = slot_mapping.contiguous()
    quant = is_quantized_kv(k_cache.dtype)
    if quant and (k_scale is None or v_scale is None):
        raise ValueError(f"k_scale/v_scale: a {k_cache.dtype} cache needs its scales")
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if quant else slot_mapping,
        v_scale if quant else slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=quant,
        QMAX=kv_qmax(k_cache.dtype) if quant else 1.0,
        ROUND=k_cache.dtype == torch.int8,
        HAS_VALUE=has_value,
    )


@triton.jit(do_not_specialize=["num_ids"])
def _copy_blocks_kernel(
    src_ptr,  # gather: [P, N, E] cache; scatter: [P, n, E] buffer
    dst_ptr,  # gather: [P, n, E] buffer; scatter: [P, N, E] cache
    block_ids_ptr,  # [n] int64
    num_ids,
    stride_src_p,
    stride_src_n,
    stride_dst_p,
    stride_dst_n,
    block_numel,  # E = B * Hkv * D
    GATHER: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # over P * n
    chunk = tl.program_id(1).to(tl.int64)
    lead = pid // num_ids
    i = pid % num_ids
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    if GATHER:
        src = src_ptr + lead * stride_src_p + block * stride_src_n
        dst = dst_ptr + lead * stride_dst_p + i * stride_dst_n
    else:
        src = src_ptr + lead * stride_src_p + i * stride_src_n
        dst = dst_ptr + lead * stride_dst_p + block * stride_dst_n
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


_COPY_CHUNK = 2048


def _as_blocks(kv: torch.Tensor) -> torch.Tensor | None:
    """``kv [..., N, B, Hkv, D]`` as a ``[P, N, E]`` view, or None when no such view exists."""
    block_numel = kv.shape[-3] * kv.shape[-2] * kv.shape[-1]
    try:
        view = kv.view(-1, kv.shape[-4], block_numel)
    except RuntimeError:
        return None
    return view if view.stride(2) == 1 else None


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool):
    lead, _, block_numel = src.shape
    n = block_ids.shape[0]
    if lead == 0 or n == 0 or block_numel == 0:
        return
    grid = (lead * n, triton.cdiv(block_numel, _COPY_CHUNK))
    _copy_blocks_kernel[grid](
        src,
        dst,
        block_ids,
        n,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        block_numel,
        GATHER=gather,
        CHUNK=_COPY_CHUNK,
    )


def gather_blocks_triton(
    kv: torch.Tensor,  # [..., N, B, Hkv, D]
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [..., n, B, Hkv, D]
    """Pack the listed blocks into one new contiguous buffer."""
    n = block_ids.shape[0]
    out = torch.empty((*kv.shape[:-4], n, *kv.shape[-3:]), dtype=kv.dtype, device=kv.device)
    src = _as_blocks(kv)
    if src is None:  # exotic strides: torch handles them correctly, if slower
        out.copy_(kv.index_select(kv.dim() - 4, block_ids.to(torch.int64)))
        return out
    ids = block_ids.to(device=kv.device, dtype=torch.int64)
    _launch_copy(src, out.view(src.shape[0], n, src.shape[2]), ids, gather=True)
    return out


def scatter_blocks_triton(
    buf: torch.Tensor,  # [..., n, B, Hkv, D]
    kv: torch.Tensor,  # [..., N, B, Hkv, D]
    block_ids: torch.Tensor,  # [n] int64
) -> None:
    """Unpack ``buf`` into the listed blocks of ``kv`` (in place)."""
    dst = _as_blocks(kv)
    ids = block_ids.to(device=kv.device, dtype=torch.int64)
    if dst is None:
        kv.index_copy_(kv.dim() - 4, ids, buf.to(kv.dtype))
        return
    src = buf.to(kv.dtype).contiguous().view(dst.shape[0], ids.shape[0], dst.shape[2])
    _launch_copy(src, dst, ids, gather=False)
