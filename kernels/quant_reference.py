"""Pure-torch references of the quantized linear kernels, and the quantizers themselves.

A quantized weight is held in one layout whatever the checkpoint wrote: the values
``q`` [N, K] (int8 or float8_e4m3fn) and float32 scales [N, G] over ``G`` groups of
``group = ceil(K / G)`` input columns (``G == 1``: one scale per output channel; a
per-tensor scale is repeated over the rows; a 128x128 block scale is repeated over the
block's rows). The float weight is ``q * scale`` broadcast over each group.

The CPU and Triton kernels are tested against these functions; the engine never calls
them on a hot path.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
_TINY = 1e-12  # keeps an all-zero row's scale finite


def group_size(in_features: int, num_groups: int) -> int:
    """Input columns per scale group (the last group may be shorter)."""
    if num_groups < 1 or num_groups > in_features:
        raise ValueError(f"num_groups must be in [1, {in_features}], got {num_groups}")
    return -(-in_features // num_groups)


def expand_scale(
    scale: torch.Tensor,  # [N, G] float32
    in_features: int,
) -> torch.Tensor:  # [N, K] float32
    """Each group's scale repeated over its columns."""
    g = group_size(in_features, scale.shape[1])
    return scale.repeat_interleave(g, dim=1)[:, :in_features]


def dequantize_weight(
    q: torch.Tensor,  # [N, K] int8 | float8_e4m3fn
    scale: torch.Tensor,  # [N, G] float32
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K]
    """The float weight the quantized one stands for."""
    return (q.float() * expand_scale(scale.float(), q.shape[1])).to(dtype)


def quantize_weight(
    w: torch.Tensor,  # [N, K] float
    qdtype: torch.dtype,  # torch.int8 | FP8_DTYPE
    group: int | None = None,  # columns per scale; None = per output channel
) -> tuple[torch.Tensor, torch.Tensor]:  # q [N, K], scale [N, G] float32
    """Symmetric round-to-nearest quantization with absmax scales per channel or group."""
    if qdtype not in (torch.int8, FP8_DTYPE):
        raise ValueError(f"qdtype must be int8 or float8_e4m3fn, got {qdtype}")
    n, k = w.shape
    group = k if group is None else group
    if not 1 <= group <= k:
        raise ValueError(f"group must be in [1, {k}], got {group}")
    w = w.float()
    pad = -k % group
    padded = torch.nn.functional.pad(w, (0, pad)).view(n, -1, group)
    qmax = INT8_MAX if qdtype == torch.int8 else FP8_MAX
    scale = (padded.abs().amax(-1) / qmax).clamp(min=_TINY)  # [N, G]
    scaled = w / expand_scale(scale, k)
    if qdtype == torch.int8:
        q = scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_per_token_int8(
    x: torch.Tensor,  # [M, K] float
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K] int8, scale [M, 1] float32
    """Dynamic symmetric int8 quantization of each row (token) by its absmax."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / INT8_MAX).clamp(min=_TINY)
    q = (x / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_per_token_fp8(
    x: torch.Tensor,  # [M, K] float
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K] float8_e4m3fn, scale [M, 1] float32
    """Dynamic float8 (e4m3) quantization of each row (token) by its absmax."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=_TINY)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def w8a8_linear(
    x: torch.Tensor,  # [M, K] float
    q: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] float32
    """int8 activations (dynamic per token) x int8 weights (per channel), exact int32 sums."""
    if scale.shape[1] != 1:
        raise ValueError(f"w8a8 needs per-channel weight scales [N, 1], got {tuple(scale.shape)}")
    xq, xs = quantize_per_token_int8(x)
    acc = xq.double() @ q.double().t()  # exact: |sum| < 2**53
    out = acc.float() * xs * scale.float().t()
    return out if bias is None else out + bias.float()


def fp8_act_linear(
    x: torch.Tensor,  # [M, K] float
    q: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, G] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] float32
    """fp8 activations (dynamic per token) x fp8 weights, float32 sums."""
    xq, xs = quantize_per_token_fp8(x)
    out = (xq.float() * xs) @ dequantize_weight(q, scale).t()
    return out if bias is None else out + bias.float()


def weight_only_linear(
    x: torch.Tensor,  # [M, K] float
    q: torch.Tensor,  # [N, K] int8 | float8_e4m3fn
    scale: torch.Tensor,  # [N, G] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] float32
    """Activations as given x the dequantized weight, float32 sums."""
    out = x.float() @ dequantize_weight(q, scale).t()
    return out if bias is None else out + bias.float()


def quantize_weight_blocks(
    w: torch.Tensor,  # [N, K] float
    block: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [N, K] float8_e4m3fn, scale [ceil(N/b), ceil(K/b)]
    """float8 quantization with one absmax scale per ``block`` x ``block`` tile, the scales
    as an fp8 checkpoint stores them (``weight_scale_inv``)."""
    n, k = w.shape
    w = w.float()
    tiles = torch.nn.functional.pad(w, (0, -k % block, 0, -n % block))
    tiles = tiles.view(-(-n // block), block, -(-k // block), block)
    scale = (tiles.abs().amax((1, 3)) / FP8_MAX).clamp(min=_TINY)
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
