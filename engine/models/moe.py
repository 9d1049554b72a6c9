"""The mixture-of-experts MLP of the native Mixtral / Qwen3-MoE classes.

A replicated router (``gate``), then every expert's gate/up and down projections run once
per step over the tokens routed to it (``kernels.ops.fused_moe``). The experts are stored
stacked, ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``; under tensor
parallelism each rank holds every expert's share of the intermediate columns (column-
parallel gate/up, row-parallel down, one all-reduce), as a dense MLP is split.

``load_expert`` maps the checkpoint's per-expert tensors
(``experts.<j>.gate_proj|up_proj|down_proj`` in Qwen3-MoE, ``experts.<j>.w1|w3|w2`` in
Mixtral) into the stacked parameters. This module never allocates the KV cache.
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

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] float32
        return x.float() @ self.weight.float().t()


class SparseMoeBlock(nn.Module):
    """Router + stacked experts; ``forward`` is ``[T, H] -> [T, H]`` like a dense MLP."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        assert cfg.moe is not None
        moe = cfg.moe
        self.tp = tp
        self.columns = tp.shard.split(moe.intermediate_size, "moe_intermediate_size")
        inter = len(self.columns)
        self.router = ops.RouterConfig(moe.num_experts, moe.top_k, renormalize=moe.renormalize)
        self.gate = Router(cfg.hidden_size, moe.num_experts)
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = ops.select_experts(self.gate(x), self.router)
        return self.tp.all_reduce(ops.fused_moe(x, self.w13, self.w2, weights, ids))

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
