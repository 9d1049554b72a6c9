"""Quantized mixture-of-experts weights in a checkpoint, dequantized at load into the
engine's dtype for the fused-MoE layout (``engine/models/moe.py``).

Two formats:
- ``quant_method: mxfp4`` (gpt-oss): each expert tensor ships as ``<proj>_blocks`` (uint8,
  ``[E, rows, cols / 32, 16]``: 32 e2m1 values per block, two per byte, the low nibble
  first) and ``<proj>_scales`` (uint8 ``[E, rows, cols / 32]``: an e8m0 exponent per block,
  bias 127). Only the experts are MXFP4; attention and router stay float.
- ``quant_method: fp8`` with ``weight_block_size`` (Qwen3-MoE-FP8, DeepSeek-V3): each
  expert's projection is an e4m3 ``weight`` with a ``weight_scale_inv`` per block of rows x
  columns (it multiplies); the other linears load through ``engine/quantization.py``.

The fused-MoE kernels take float experts, so the experts are held dequantized (exact for
MXFP4: an e2m1 value times a power of two fits bfloat16). This module only converts
tensors; it never decides which rank holds which columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

MXFP4_BLOCK = 32  # values per e8m0 scale
_E8M0_BIAS = 127
# e2m1: sign bit, two exponent bits, one mantissa bit; index = the 4-bit code.
_E2M1 = torch.tensor(
    (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
)
# A packed byte's two values, the low nibble first: one lookup per byte.
_BYTE_PAIRS = torch.stack((_E2M1[torch.arange(256) & 0x0F], _E2M1[torch.arange(256) >> 4]), -1)


@dataclass(frozen=True)
class ExpertQuant:
    """How a checkpoint stores its experts."""

    method: Literal["mxfp4", "fp8"]
    block: tuple[int, int] | None = None  # fp8: scale block (rows, cols)

    def describe(self) -> str:
        if self.block is None:
            return self.method
        return f"{self.method} {self.block[0]}x{self.block[1]} blocks"


def read_expert_quant(hf_config: dict[str, Any], arch: str) -> ExpertQuant | None:
    """The experts' format from ``quantization_config`` (None: float experts). Raises for
    a method the MoE path cannot read."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":
        if arch != "GptOssForCausalLM":
            raise ValueError(f"quant_method 'mxfp4' is read for gpt-oss experts only, not {arch}")
        return ExpertQuant("mxfp4")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError(
                f"{arch}: fp8 experts are read with a weight_block_size [rows, cols] only "
                f"(block-wise weight_scale_inv), got weight_block_size={block!r}"
            )
        return ExpertQuant("fp8", (int(block[0]), int(block[1])))
    raise ValueError(
        f"quantized {arch} experts: quant_method {method!r} is not supported natively; "
        "supported: mxfp4 (gpt-oss), fp8 with weight_block_size"
    )


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., rows, cols / 32, 16] uint8
    scales: torch.Tensor,  # [..., rows, cols / 32] uint8
    dtype: torch.dtype,
    name: str,
) -> torch.Tensor:  # [..., rows, cols] in dtype
    """MXFP4 values times their block's power of two, ``name`` naming the tensor in errors."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"checkpoint tensor {name!r}: MXFP4 blocks and scales must be uint8, got "
            f"{blocks.dtype} / {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(
            f"checkpoint tensor {name!r}: MXFP4 blocks must be [..., {MXFP4_BLOCK // 2}] bytes "
            f"(32 values per block), got {tuple(blocks.shape)}"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"checkpoint tensor {name!r}: scales {tuple(scales.shape)} do not match blocks "
            f"{tuple(blocks.shape)} (one scale per block of 32)"
        )
    # bfloat16 and float32 hold every e2m1 value times a power of two exactly: work in them.
    work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    values = nn.functional.embedding(blocks.int(), _BYTE_PAIRS.to(work))  # [..., G, 16, 2]
    scale = torch.exp2(scales.to(work) - _E8M0_BIAS)  # [..., rows, G]
    out = values.flatten(-2).mul_(scale.unsqueeze(-1))  # [..., rows, G, 32]
    return out.flatten(-2).to(dtype)


def dequantize_fp8_blocks(
    weight: torch.Tensor,  # [rows, cols] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(rows / br), ceil(cols / bc)]
    block: tuple[int, int],
    dtype: torch.dtype,
    name: str,
) -> torch.Tensor:  # [rows, cols] in dtype
    """An fp8 weight times its block scales."""
    if weight.dim() != 2 or weight.element_size() != 1 or not weight.dtype.is_floating_point:
        raise ValueError(
            f"checkpoint tensor {name!r}: want a 2-D float8 weight, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"checkpoint tensor {name!r}: weight_scale_inv {tuple(scale_inv.shape)}, expected "
            f"{want} for a {tuple(weight.shape)} weight in {block[0]}x{block[1]} blocks"
        )
    if rows % block[0] == 0 and cols % block[1] == 0:  # whole blocks: a broadcast multiply
        tiles = weight.to(torch.float32).view(want[0], block[0], want[1], block[1])
        tiles.mul_(scale_inv.float()[:, None, :, None])
        return tiles.view(rows, cols).to(dtype)
    full = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    full = full.repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * full).to(dtype)


def dequantize_fp8_weights(
    weights: Iterable[tuple[str, Any]], block: tuple[int, int]
) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with every fp8 ``<m>.weight`` and its ``<m>.weight_scale_inv``
    replaced by the float32 ``<m>.weight`` they stand for (for a native class with no fp8
    linears: DeepSeek-V2/V3); everything else passes through as it came. A half whose
    partner never comes is an error naming it."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}
    for name, source in weights:
        module, _, kind = name.rpartition(".")
        if kind == "weight_scale_inv" or (kind == "weight" and is_one_byte(source)):
            other = pending.pop(module, None)
            if other is None:
                pending[module] = (name, source[:])
                continue
            halves = {kind: (name, source[:]), other[0].rpartition(".")[2]: other}
            if len(halves) != 2:
                raise ValueError(f"checkpoint tensors {other[0]!r} and {name!r} repeat one half")
            weight_name, weight = halves["weight"]
            scale = halves["weight_scale_inv"][1]
            yield (
                weight_name,
                dequantize_fp8_blocks(weight, scale, block, torch.float32, weight_name),
            )
        else:
            yield name, source
    for name, _ in pending.values():
        partner = "weight_scale_inv" if name.endswith(".weight") else "weight"
        raise ValueError(f"checkpoint tensor {name!r} has no {partner!r} beside it")


def is_one_byte(source: Any) -> bool:
    """Whether a tensor or lazy safetensors slice holds one-byte (fp8) values."""
    if isinstance(source, torch.Tensor):
        return source.element_size() == 1
    return str(source.get_dtype()) in ("F8_E4M3", "F8_E5M2")
