"""Gemma 2 and Gemma 3 (text) over the paged KV cache: the Llama family's layers
(``models/llama.py``) with Gemma's differences.

- The embedding is scaled by ``sqrt(hidden_size)``, rounded to the model dtype first (as
  transformers does); the output embedding is usually tied to it.
- RMSNorm multiplies by ``1 + weight``: the fused norm kernel takes that sum as a float32
  weight, so the norm math is transformers' (``x * rsqrt(...) * (1 + w)`` in float32).
- Four norms a layer: before and after attention, before and after the MLP; the residual
  add stays fused into the next "before" norm, as in Llama.
- A GeGLU MLP (``gelu_pytorch_tanh(gate) * up``), in torch: no fused kernel has it.
- Queries scaled by ``query_pre_attn_scalar ** -0.5``; attention logits tanh-capped
  (Gemma 2) and the output logits too; the paged kernels do the cap and the window.
- Sliding-window layers alternate with full ones (``ModelConfig.kv_layers``); Gemma 3
  rotates the sliding layers with their own RoPE base and normalises q/k per head.

Tensor parallelism splits it as the Llama family (heads, MLP columns, vocabulary): every
Gemma-specific piece is per head or per hidden vector and is replicated. This module never
allocates the KV cache and never samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.loader import ModelConfig
from pdserve.engine.models.llama import (
    MLP,
    Attention,
    AttentionMetadata,
    LlamaForCausalLM,
    LlamaModel,
    RMSNorm,
    norm_into_stream,
)
from pdserve.engine.parallel import SINGLE, TPGroup
from pdserve.kernels import ops


class GemmaRMSNorm(RMSNorm):
    """RMSNorm by ``1 + weight`` (the checkpoint stores the offset from one)."""

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # Float32 whatever the model dtype: transformers adds the one in float32 too.
        scale = 1.0 + self.weight.float()
        return ops.rms_norm(x, scale, self.eps, residual, out_dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``gelu_pytorch_tanh(gate) * up`` of a fused gate/up projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x))))


class GemmaAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__(cfg, layer_idx, tp)
        assert cfg.gemma is not None
        self.scale = cfg.gemma.query_scale
        self.softcap = cfg.gemma.attn_logit_softcap
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = GemmaAttention(cfg, layer_idx, tp)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = GemmaMLP(cfg, layer_idx, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        assert cfg.gemma is not None
        self.sliding = cfg.gemma.sliding_layers[layer_idx]  # takes the sliding layers' RoPE

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As in Llama, the float32 residual stream is added inside the next "before" norm;
        # the "after" norms normalise a block's output before it joins the stream.
        x, residual = norm_into_stream(self.input_layernorm, x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, cos_sin, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 (text) decoder over a paged KV cache."""

    def __init__(self, cfg: ModelConfig, max_position: int, tp: TPGroup = SINGLE) -> None:
        if cfg.gemma is None:
            raise ValueError(f"{cfg.architecture}: not a Gemma config (ModelConfig.gemma unset)")
        super().__init__(cfg, max_position, tp)
        self._sliding_cos_sin: torch.Tensor | None = None
        # transformers rounds the embedding scale to the weights' dtype before multiplying.
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=cfg.dtype, device="cpu"))

    def build_decoder(self, cfg: ModelConfig, tp: TPGroup) -> LlamaModel:
        return LlamaModel(cfg, tp, GemmaDecoderLayer, GemmaRMSNorm)

    def sliding_cos_sin_cache(self) -> torch.Tensor:
        """The RoPE table of the sliding-window layers (Gemma 3's local base)."""
        gemma = self.config.gemma
        assert gemma is not None
        same = (gemma.sliding_rope_theta, gemma.sliding_rope_scaling) == (
            self.config.rope_theta,
            self.config.rope_scaling,
        )
        if same:  # Gemma 2: one RoPE for every layer
            return self.cos_sin_cache()
        device = self.model.embed_tokens.weight.device
        if self._sliding_cos_sin is None or self._sliding_cos_sin.device != device:
            self._sliding_cos_sin = ops.build_rope_cache(
                self.config.head_dim,
                self.max_position,
                gemma.sliding_rope_theta,
                gemma.sliding_rope_scaling,
                torch.float32,
                device,
            )
        return self._sliding_cos_sin

    def layer_rope_tables(self) -> list[torch.Tensor]:
        full, sliding = self.cos_sin_cache(), self.sliding_cos_sin_cache()
        return [sliding if layer.sliding else full for layer in self.model.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.model.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, V]
        logits = super().compute_logits(hidden)
        cap = self.config.gemma.final_logit_softcap if self.config.gemma else None
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
