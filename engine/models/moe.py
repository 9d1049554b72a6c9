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
(all from ``MoEConfig``). This module never allocates the KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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
        self.packed_experts: ops.PreparedExperts | None = None  # set by ops.pack_moe_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = ops.select_experts(self.gate(x), self.router)
        args = (x, self.w13, self.w2, weights, ids, self.b13, self.b2, self.activation)
        out = ops.fused_moe(*args, packed=self.packed_experts)
        return self.tp.all_reduce(out)

    def load_expert(self, expert: int, projection: str, source: Any, name: str) -> str:
        """Copy this rank's share of one checkpoint expert tensor; returns the parameter
        filled (``w13`` or ``w2``). ``source`` is a tensor or a lazy safetensors slice."""
        if projection not in _EXPERT_PROJECTIONS:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        if not 0 <= expert < self.w13.shape[0]:
            raise ValueError(f"checkpoint tensor {name!r}: expert {expert} out of range")
        param, half = _EXPERT_PROJECTIONS[projection]
        cols = slice(self.columns.start, self.columns.stop)
        inter = len(self.columns)
        if half is None:
            dest, tensor = self.w2.data[expert], source[:, cols]
        else:
            dest = self.w13.data[expert, half * inter : (half + 1) * inter]
            tensor = source[cols]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"checkpoint tensor {name!r}: read as {tuple(tensor.shape)}, expected "
                f"{tuple(dest.shape)} on rank {self.tp.rank} of {self.tp.size}"
            )
        dest.copy_(tensor)
        return param

    def load_stacked(self, tensor: str, source: Any, name: str) -> tuple[str, int]:
        """Copy this rank's share of one of gpt-oss's stacked expert tensors; returns the
        parameter filled and the loads it counts for (``w13``: a gate and an up per expert)."""
        cols = slice(self.columns.start, self.columns.stop)
        full = source[:]  # a lazy safetensors slice reads here (the whole tensor)
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

    def _copy(self, param: str, dest: nn.Parameter, tensor: torch.Tensor, name: str) -> str:
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"checkpoint tensor {name!r}: read as {tuple(tensor.shape)}, expected "
                f"{tuple(dest.shape)} on rank {self.tp.rank} of {self.tp.size}"
            )
        dest.data.copy_(tensor)
        return param
