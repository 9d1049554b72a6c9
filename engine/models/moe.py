"""The mixture-of-experts MLP of the native Mixtral / Qwen3-MoE / gpt-oss classes.

A replicated router (``gate``), then every expert's gate/up and down projections run once
per step over the tokens routed to it (``kernels.ops.fused_moe``). The experts are stored
stacked, ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``; under tensor
parallelism each rank holds every expert's share of the intermediate columns (column-
parallel gate/up, row-parallel down, one all-reduce), as a dense MLP is split.

``load_expert`` maps the checkpoint's per-expert tensors
(``experts.<j>.gate_proj|up_proj|down_proj`` in Qwen3-MoE, ``experts.<j>.w1|w3|w2`` in
Mixtral) into the stacked parameters; ``load_stacked`` maps gpt-oss's already stacked ones
(``experts.gate_up_proj [E, H, 2I]`` with gate and up columns interleaved, ``down_proj
[E, I, H]`` and their biases), de-interleaving and transposing them. gpt-oss also biases its
router and picks top-k logits before the softmax, and its experts apply a clamped SwiGLU
(all from ``MoEConfig``).

Quantized experts (``MoEConfig.quantized``) are dequantized as they load: gpt-oss's MXFP4
``<tensor>_blocks`` / ``<tensor>_scales`` one expert at a time, an fp8 expert's ``weight``
with its block ``weight_scale_inv`` (``engine/expert_quant.py``). The two halves of a pair
may come in either order; one left without its partner is an error at the end of loading
(``check_loaded``). This module never allocates the KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.engine.expert_quant import dequantize_fp8_blocks, dequantize_mxfp4, is_one_byte
from pdserve.engine.loader import ModelConfig
from pdserve.engine.parallel import TPGroup
from pdserve.kernels import ops

# checkpoint projection -> (stacked parameter, which half of w13: 0 gate, 1 up, None: w2)
_EXPERT_PROJECTIONS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("w13", 0),
    "w1": ("w13", 0),
    "up_proj": ("w13", 1),
    "w3": ("w13", 1),
    "down_proj": ("w2", None),
    "w2": ("w2", None),
}
# A quantized tensor's two halves: MXFP4 blocks and scales, an fp8 weight and its scales.
_PARTNER = {"blocks": "scales", "scales": "blocks", "weight": "weight_scale_inv",
            "weight_scale_inv": "weight"}  # fmt: skip


class Router(nn.Module):
    """The router's ``[E, H]`` weight (``gate.weight`` in the checkpoint). Not an
    ``nn.Linear``, so the CPU linear packing leaves it alone: the logits are computed in
    float32, where a near-tie between two experts is not decided by rounding."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] float32
        logits = x.float() @ self.weight.float().t()
        return logits if self.bias is None else logits + self.bias.float()


class SparseMoeBlock(nn.Module):
    """Router + stacked experts; ``forward`` is ``[T, H] -> [T, H]`` like a dense MLP."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        assert cfg.moe is not None
        moe = cfg.moe
        self.tp = tp
        self.columns = tp.shard.split(moe.intermediate_size, "moe_intermediate_size")
        inter = len(self.columns)
        self.router = ops.RouterConfig(
            moe.num_experts,
            moe.top_k,
            renormalize=moe.renormalize,
            softmax_after_topk=moe.softmax_after_topk,
        )
        self.activation = moe.activation
        self.gate = Router(cfg.hidden_size, moe.num_experts, bias=moe.biases)
        e, h = moe.num_experts, cfg.hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.w2 = nn.Parameter(torch.empty(e, h, inter))
        # Each expert's gate then up bias (this rank's columns), and its down bias (rank 0
        # holds it, the others zeros: it is added once to the all-reduced sum).
        self.b13 = nn.Parameter(torch.empty(e, 2 * inter)) if moe.biases else None
        self.b2 = nn.Parameter(torch.empty(e, h)) if moe.biases else None
        self.quantized = moe.quantized
        # One half of a quantized pair until its partner loads: key -> (part, name, tensor).
        self._pending: dict[str, tuple[str, str, torch.Tensor]] = {}
        self.packed_experts: ops.PreparedExperts | None = None  # set by ops.pack_moe_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = ops.select_experts(self.gate(x), self.router)
        args = (x, self.w13, self.w2, weights, ids, self.b13, self.b2, self.activation)
        out = ops.fused_moe(*args, packed=self.packed_experts)
        return self.tp.all_reduce(out)

    def load_expert(
        self, expert: int, projection: str, source: Any, name: str, kind: str = "weight"
    ) -> tuple[str, int]:
        """Copy this rank's share of one checkpoint expert tensor (``kind``: its ``weight``,
        or an fp8 one's ``weight_scale_inv``); returns the parameter filled (``w13`` or
        ``w2``) and how many projections that completes. ``source`` is a tensor or a lazy
        safetensors slice."""
        if projection not in _EXPERT_PROJECTIONS:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        if not 0 <= expert < self.w13.shape[0]:
            raise ValueError(f"checkpoint tensor {name!r}: expert {expert} out of range")
        param, half = _EXPERT_PROJECTIONS[projection]
        tensor = source  # a float weight: only this rank's rows or columns are read below
        if kind == "weight_scale_inv" or is_one_byte(source):
            # fp8: read whole, dequantized with its block scales, then sliced
            pair = self._pair(f"{expert}.{projection}", kind, name, source[:])
            if pair is None:
                return param, 0
            (weight_name, weight), (_, scale) = pair["weight"], pair["weight_scale_inv"]
            if self.quantized is None or self.quantized.block is None:
                raise ValueError(
                    f"checkpoint tensor {weight_name!r} is fp8 with block scales, but "
                    "config.json's quantization_config is not fp8 with a weight_block_size"
                )
            tensor = dequantize_fp8_blocks(
                weight, scale, self.quantized.block, self.w13.dtype, weight_name
            )
        cols = slice(self.columns.start, self.columns.stop)
        inter = len(self.columns)
        if half is None:
            dest, tensor = self.w2.data[expert], tensor[:, cols]
        else:
            dest = self.w13.data[expert, half * inter : (half + 1) * inter]
            tensor = tensor[cols]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"checkpoint tensor {name!r}: read as {tuple(tensor.shape)}, expected "
                f"{tuple(dest.shape)} on rank {self.tp.rank} of {self.tp.size}"
            )
        dest.copy_(tensor)
        return param, 1

    def _pair(
        self, key: str, part: str, name: str, tensor: torch.Tensor
    ) -> dict[str, tuple[str, torch.Tensor]] | None:
        """Both halves of a quantized tensor once the second arrives (part -> (name,
        tensor)); None while the first waits."""
        other = self._pending.pop(key, None)
        if other is None:
            self._pending[key] = (part, name, tensor)
            return None
        if other[0] != _PARTNER[part]:
            raise ValueError(f"checkpoint tensors {other[1]!r} and {name!r} repeat one half")
        return {part: (name, tensor), other[0]: (other[1], other[2])}

    def check_loaded(self) -> None:
        """Raise for a quantized tensor whose partner never came."""
        for part, name, _ in self._pending.values():
            raise ValueError(
                f"checkpoint tensor {name!r} has no {_PARTNER[part]!r} beside it; the "
                "quantized experts need both"
            )

    def load_stacked(self, tensor: str, source: Any, name: str) -> tuple[str, int]:
        """Copy this rank's share of one of gpt-oss's stacked expert tensors; returns the
        parameter filled and the loads it counts for (``w13``: a gate and an up per expert)."""
        cols = slice(self.columns.start, self.columns.stop)
        full = source[:]  # a lazy safetensors slice reads here (the whole tensor)
        proj, _, part = tensor.rpartition("_")
        if part in ("blocks", "scales") and proj in ("gate_up_proj", "down_proj"):
            return self._load_mxfp4(proj, part, full, name)
        if tensor == "gate_up_proj":  # [E, H, 2I] -> [E, 2I', H]
            gate_up = torch.cat([full[..., 0::2][..., cols], full[..., 1::2][..., cols]], -1)
            return self._copy("w13", self.w13, gate_up.transpose(1, 2), name), 2 * len(full)
        if tensor == "down_proj":  # [E, I, H] -> [E, H, I']
            return self._copy("w2", self.w2, full[:, cols].transpose(1, 2), name), len(full)
        if tensor == "gate_up_proj_bias" and self.b13 is not None:  # [E, 2I] -> [E, 2I']
            bias = torch.cat([full[:, 0::2][:, cols], full[:, 1::2][:, cols]], -1)
            return self._copy("b13", self.b13, bias, name), len(full)
        if tensor == "down_proj_bias" and self.b2 is not None:  # [E, H]
            bias = full if self.tp.rank == 0 else torch.zeros_like(full)
            return self._copy("b2", self.b2, bias, name), len(full)
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")

    def _load_mxfp4(self, proj: str, part: str, tensor: torch.Tensor, name: str) -> tuple[str, int]:
        """One half of gpt-oss's MXFP4 ``gate_up_proj`` (``[E, 2I, H / 32, 16]`` blocks,
        rows of gate and up interleaved) or ``down_proj`` (``[E, H, I / 32, 16]``); once
        both halves are in, every expert is dequantized into this rank's columns, one
        expert at a time (no full-precision copy of the whole tensor)."""
        param = "w13" if proj == "gate_up_proj" else "w2"
        if self.quantized is None or self.quantized.method != "mxfp4":
            raise ValueError(
                f"checkpoint tensor {name!r} is MXFP4, but config.json's quantization_config "
                "is not quant_method mxfp4"
            )
        pair = self._pair(proj, part, name, tensor)
        if pair is None:
            return param, 0
        (blocks_name, blocks), (_, scales) = pair["blocks"], pair["scales"]
        dest = self.w13 if param == "w13" else self.w2
        if blocks.dim() != 4 or blocks.shape[0] != dest.shape[0]:
            raise ValueError(
                f"checkpoint tensor {blocks_name!r}: MXFP4 blocks {tuple(blocks.shape)}, "
                f"expected [{dest.shape[0]} experts, rows, blocks, 16]"
            )
        cols = slice(self.columns.start, self.columns.stop)
        for e in range(blocks.shape[0]):
            w = dequantize_mxfp4(blocks[e], scales[e], dest.dtype, blocks_name)
            if param == "w13":  # rows [2I, H] -> gate rows then up rows of this rank
                w = torch.cat([w[0::2][cols], w[1::2][cols]])
            else:  # [H, I] -> this rank's columns
                w = w[:, cols]
            self._copy(param, dest, w, blocks_name, expert=e)
        return param, (2 if param == "w13" else 1) * blocks.shape[0]

    def _copy(
        self, param: str, dest: nn.Parameter, tensor: torch.Tensor, name: str,
        expert: int | None = None,
    ) -> str:  # fmt: skip
        """``tensor`` into ``dest`` (or its ``expert``), shapes checked."""
        target = dest.data if expert is None else dest.data[expert]
        if tuple(tensor.shape) != tuple(target.shape):
            where = "" if expert is None else f" expert {expert}"
            raise ValueError(
                f"checkpoint tensor {name!r}{where}: read as {tuple(tensor.shape)}, expected "
                f"{tuple(target.shape)} on rank {self.tp.rank} of {self.tp.size}"
            )
        target.copy_(tensor)
        return param
