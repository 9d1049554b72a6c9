"""DeepSeek-V3 over a paged KV cache that holds the compressed latent: multi-head latent
attention (MLA) in its absorbed form, dense first layers, then sigmoid-routed experts with
shared experts.

Each token caches one "head" of ``kv_lora_rank + qk_rope_head_dim`` values: the normed
latent ``c`` and the roped key ``k_pe``. Attention never expands them into per-head keys
and values: ``q_nope`` is absorbed through each head's ``W_UK`` (``q_nope @ W_UK`` has
``kv_lora_rank`` columns), concatenated with the roped ``q_pe`` and scored against the
cached ``[c, k_pe]`` (one KV head; the MLA prefill and decode kernels), so
``q_nope . (W_UK c) + q_pe . k_pe`` is exactly the expanded model's score. The value of a
slot is the same ``[c, k_pe]``: the pool holds one plane (``ModelConfig.kv_planes``),
passed to the kernels as both the key and the value cache (see docs/models.md for the
bytes); the first ``kv_lora_rank`` columns of the attention output are each head's weighted
latent, taken through ``W_UV`` and ``o_proj``. The same form serves prefill and decode.

The MoE layers reuse the fused experts: the shared experts are stacked after the routed
ones and every token is sent to them with weight 1 (``ops.add_shared_experts``). This
module never allocates the KV cache and never samples.

Tensor parallelism splits the attention heads (``q_b_proj`` / ``q_proj`` and ``kv_b_proj``
by heads, ``o_proj`` by its input columns, then an all-reduce), the dense MLPs and the
vocabulary as the Llama class does; the latent projection (``q_a_proj``,
``kv_a_proj_with_mqa`` and their norms) is replicated, so every rank computes and caches the
same latent (one KV head: rank 0's copy is canonical). The routers are replicated; every
expert, routed or shared, is split by its intermediate columns as the Llama family's MoE.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pdserve.engine.deepseek_config import LATENT_NORM_EPS, MLAConfig
from pdserve.engine.loader import ModelConfig
from pdserve.engine.models.llama import (
    MLP,
    AttentionMetadata,
    DecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    RMSNorm,
    _read,
)
from pdserve.engine.models.moe import Router
from pdserve.engine.parallel import SINGLE, TPGroup
from pdserve.kernels import ops


def _mla(cfg: ModelConfig) -> MLAConfig:
    if cfg.mla is None:
        raise ValueError(f"{cfg.architecture}: config has no multi-head latent attention")
    return cfg.mla


class MLAttention(nn.Module):
    """Absorbed multi-head latent attention over a one-head latent cache."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        mla = _mla(cfg)
        self.mla = mla
        self.layer_idx = layer_idx
        self.tp = tp
        self.heads = tp.shard.split(cfg.num_heads, "num_attention_heads")  # this rank's
        self.num_heads = len(self.heads)
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        h, q_out = cfg.hidden_size, self.num_heads * self.qk_head_dim
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        self.q_proj: nn.Linear | None = None
        if mla.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.latent_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        # kv_b_proj split per head into its key and value up-projections (plain parameters,
        # so the CPU linear packing leaves them as the batched matmuls read them).
        self.w_uk = nn.Parameter(
            torch.empty(self.num_heads, mla.qk_nope_head_dim, mla.kv_lora_rank)
        )
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, mla.v_head_dim, mla.kv_lora_rank))
        self.o_proj = nn.Linear(self.num_heads * mla.v_head_dim, h, bias=cfg.o_bias)

    def shard_rows(self, module: str) -> tuple[slice, int] | None:
        """The checkpoint tensor ``self_attn.<module>.weight``'s slice for this rank's heads
        and the dimension it cuts (0 rows, 1 columns); None: the tensor is replicated."""
        mla, heads = self.mla, self.heads
        per_head = {
            "q_proj": (self.qk_head_dim, 0),
            "q_b_proj": (self.qk_head_dim, 0),
            "kv_b_proj": (mla.qk_nope_head_dim + mla.v_head_dim, 0),
            "o_proj": (mla.v_head_dim, 1),
        }.get(module)
        if per_head is None:
            return None
        width, dim = per_head
        return slice(heads.start * width, heads.stop * width), dim

    def load_kv_b(self, weight: torch.Tensor) -> None:
        """This rank's heads of ``kv_b_proj.weight`` (``[h * (nope + v), kv_lora_rank]``)
        into ``w_uk`` / ``w_uv``."""
        mla = self.mla
        per_head = weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, -1)
        self.w_uk.data.copy_(per_head[:, : mla.qk_nope_head_dim])
        self.w_uv.data.copy_(per_head[:, mla.qk_nope_head_dim :])

    def _query(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, H, qk_head_dim]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.qk_head_dim)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,  # [1, N, B, 1, kv_lora_rank + rope]: this layer's slice
        cos_sin: torch.Tensor,  # [P, rope]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        mla, t = self.mla, x.shape[0]
        q = self._query(x)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe.view(t, 1, mla.qk_rope_head_dim)
        if mla.rope_interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = ops.apply_rotary(positions, q_pe.contiguous(), k_pe.contiguous(), cos_sin)
        # Absorb W_UK: [H, T, nope] @ [H, nope, L] -> [T, H, L].
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        query = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, L + rope]
        slot = torch.cat([latent.view(t, 1, mla.kv_lora_rank), k_pe], dim=-1)  # [T, 1, L+rope]
        cache = kv_cache[0]  # the one plane: each slot's latent is its key and its value
        scale = None if meta.kv_scales is None else meta.kv_scales[self.layer_idx, 0]
        ops.write_kv(slot, None, cache, None, meta.slot_mapping, scale)
        if meta.decode_only:  # [T, H, L]: every head in one call
            out = ops.paged_mla_decode(
                query, cache, meta.block_tables, meta.seq_lens, mla.softmax_scale,
                mla.kv_lora_rank, scale,
            )  # fmt: skip
        else:  # [T, H, L]: a mixed batch's new tokens, causal over the paged context
            out = ops.paged_mla_prefill(
                query, cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                mla.softmax_scale, mla.kv_lora_rank, scale,
            )  # fmt: skip
        # Each head's weighted latent through its W_UV: [H, T, L] @ [H, L, v] -> [T, H, v].
        o_latent = out.transpose(0, 1)
        o = torch.bmm(o_latent, self.w_uv.transpose(1, 2)).transpose(0, 1)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.num_heads * mla.v_head_dim)))


def _deinterleave(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> same, contiguous
    """Interleaved rotary pairs (x0, x1), (x2, x3), ... reordered as [evens, odds]: the
    neox rotation of that order is the interleaved rotation (and q and k get the same
    order, so their scores are unchanged), as transformers' interleaved rope outputs."""
    t, h, d = x.shape
    return x.reshape(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)


class DeepseekMoE(nn.Module):
    """DeepSeek's router (V3: sigmoid-scored, grouped, with a score-correction bias; V2:
    softmax-scored, greedy or group-limited), the routed experts stacked with the shared
    ones after them (``w13 [E + S, 2I, H]``, ``w2 [E + S, H, I]``). Under tensor
    parallelism each rank holds every expert's share of the intermediate columns (``I`` is
    the rank's), as the Llama family's MoE is split, and the output is all-reduced."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        mla, moe = _mla(cfg), cfg.moe
        assert moe is not None
        self.tp = tp
        self.expert_size = moe.intermediate_size  # one expert's columns in the checkpoint
        self.columns = tp.shard.split(moe.intermediate_size, "moe_intermediate_size")
        self.num_experts = moe.num_experts
        self.num_shared = mla.num_shared_experts
        self.router = ops.RouterConfig(
            moe.num_experts,
            moe.top_k,
            scoring="softmax" if mla.scoring == "softmax" else "sigmoid",
            renormalize=moe.renormalize,
            num_groups=mla.num_groups,
            topk_groups=mla.topk_groups,
            routed_scaling=mla.routed_scaling,
            group_score=mla.group_score,
        )
        self.gate = Router(cfg.hidden_size, moe.num_experts)
        # V3's selection-only bias (kept float32 whatever the model dtype: it decides
        # near-ties between experts); V2 has none.
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(moe.num_experts)) if mla.correction_bias else None
        )
        experts, inter = moe.num_experts + self.num_shared, len(self.columns)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(experts, cfg.hidden_size, inter))
        self.packed_experts: ops.PreparedExperts | None = None  # set by ops.pack_moe_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        bias = self.e_score_correction_bias
        weights, ids = ops.select_experts(
            self.gate(x), self.router, None if bias is None else bias.float()
        )
        if self.num_shared:
            weights, ids = ops.add_shared_experts(weights, ids, self.num_experts, self.num_shared)
        out = ops.fused_moe(x, self.w13, self.w2, weights, ids, packed=self.packed_experts)
        return self.tp.all_reduce(out)

    def load(self, rest: str, source: Any, name: str) -> str:
        """One checkpoint tensor under ``mlp.`` (``gate.*``, ``experts.<j>.*``,
        ``shared_experts.*``); returns the parameter filled."""
        parts = rest.split(".")
        if rest == "gate.weight":
            self.gate.weight.data.copy_(_tensor(source, self.gate.weight.shape, name))
            return "gate.weight"
        if rest == "gate.e_score_correction_bias" and self.e_score_correction_bias is not None:
            bias = self.e_score_correction_bias
            bias.data.copy_(_tensor(source, bias.shape, name))
            return "e_score_correction_bias"
        if parts[0] == "experts" and len(parts) == 4 and parts[3] == "weight":
            expert = int(parts[1])
            if not 0 <= expert < self.num_experts:
                raise ValueError(f"checkpoint tensor {name!r}: expert {expert} out of range")
            return self._load_projection(expert, parts[2], source, 0, name)
        if parts[0] == "shared_experts" and len(parts) == 3 and parts[2] == "weight":
            # S shared experts are one MLP of S * I columns: expert E + j takes the j-th I.
            for j in range(self.num_shared):
                offset = j * self.expert_size
                filled = self._load_projection(self.num_experts + j, parts[1], source, offset, name)
            return filled
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")

    def _load_projection(
        self, expert: int, projection: str, source: Any, offset: int, name: str
    ) -> str:
        """This rank's columns of one expert's projection, the expert's columns starting at
        ``offset`` of ``source`` (rows of gate/up, columns of down)."""
        inter = self.w2.shape[2]
        cols = slice(offset + self.columns.start, offset + self.columns.stop)
        if projection == "gate_proj":
            dest, param = self.w13.data[expert, :inter], "w13"
        elif projection == "up_proj":
            dest, param = self.w13.data[expert, inter:], "w13"
        elif projection == "down_proj":
            dest, param = self.w2.data[expert], "w2"
        else:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        index = (slice(None), cols) if projection == "down_proj" else (cols,)
        dest.copy_(_tensor(_read(source, index, name), dest.shape, name))
        return param


def build_rope_cache(
    rope_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    attention_factor: float,
    device: torch.device,
) -> torch.Tensor:  # [max_position, rope_dim] float32: cos, then sin
    """The rope table, yarn's frequencies and magnitude factor included (transformers'
    ``_compute_yarn_parameters`` with DeepSeek's ``original_max_position_embeddings``)."""
    if rope_scaling is None:
        return ops.build_rope_cache(rope_dim, max_position, base, None, torch.float32, device)
    factor = float(rope_scaling["factor"])
    original = float(rope_scaling["original_max_position_embeddings"])
    beta_fast = float(rope_scaling.get("beta_fast") or 32)
    beta_slow = float(rope_scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (rope_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rope_dim, 2).to(dtype=torch.float) / rope_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
    table = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
    return table.to(device)


def _full(source: Any) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source[:]


def _tensor(source: Any, shape: torch.Size | tuple[int, ...], name: str) -> torch.Tensor:
    tensor = _full(source)
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(
            f"checkpoint tensor {name!r}: shape {tuple(tensor.shape)}, expected {tuple(shape)}"
        )
    return tensor


class DeepseekDecoderLayer(DecoderLayer):
    """The Llama layer's step (norms, attention, MLP) over MLA and the DeepSeek MoE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_idx, tp)  # type: ignore[assignment]
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | DeepseekMoE  # type: ignore[assignment]
        if cfg.moe is not None and layer_idx in cfg.moe.sparse_layers:
            self.mlp = DeepseekMoE(cfg, tp)
        else:
            self.mlp = MLP(cfg, layer_idx, tp)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 (and V2) with a latent KV cache; the step (``forward``), the logits and
    the vocabulary split are the Llama class's, the layers, rope table and weight loading
    are its own."""

    def build_decoder(self, cfg: ModelConfig, tp: TPGroup) -> LlamaModel:
        return LlamaModel(cfg, tp, DeepseekDecoderLayer)

    def cos_sin_cache(self) -> torch.Tensor:
        device = self.model.embed_tokens.weight.device
        if self._cos_sin is None or self._cos_sin.device != device:
            cfg, mla = self.config, _mla(self.config)
            self._cos_sin = build_rope_cache(
                mla.qk_rope_head_dim,
                self.max_position,
                cfg.rope_theta,
                cfg.rope_scaling,
                mla.rope_attention_factor,
                device,
            )
        return self._cos_sin

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy this rank's share of the checkpoint tensors (HF names) into the parameters;
        strict about names and shapes. Layers past ``num_hidden_layers`` (the
        multi-token-prediction head of the released checkpoint) are skipped: greedy
        decoding does not use them. A lazy safetensors slice is read only where this rank's
        share lies (``_shard_index``)."""
        cfg = self.config
        params = dict(self.named_parameters())
        if cfg.tie_word_embeddings:
            params.pop("lm_head.weight", None)
        vocab = self.tp.shard.vocab(cfg.vocab_size)
        n_vocab = max(0, min(vocab.stop, cfg.vocab_size) - vocab.start)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in params:  # the last rank's padding rows: zeros, never a token
                params[name].data[n_vocab:].zero_()
        # parameter -> loads still due (a fused gate/up takes two halves)
        left: dict[str, float] = {name: 1 for name in params}
        for name, p in params.items():
            if name.endswith((".w13", ".w2")):  # one load per expert and projection
                left[name] = p.shape[0] * (2 if name.endswith(".w13") else 1)
        for name, source in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= cfg.num_layers:
                continue
            prefix, sep, rest = name.partition(".mlp.")
            layer = self._layer_module(prefix) if sep else None
            if layer is not None and isinstance(layer.mlp, DeepseekMoE):
                filled = f"{prefix}.mlp.{layer.mlp.load(rest, source, name)}"
                shared = layer.mlp.num_shared if rest.startswith("shared_experts.") else 1
                left[filled] -= shared
                continue
            index = self._shard_index(name)
            if name.endswith("self_attn.kv_b_proj.weight"):
                attn = self.get_submodule(name.removesuffix(".kv_b_proj.weight"))
                assert isinstance(attn, MLAttention) and index is not None
                attn.load_kv_b(_read(source, index, name))
                left[name.replace("kv_b_proj.weight", "w_uk")] -= 1
                left[name.replace("kv_b_proj.weight", "w_uv")] -= 1
                continue
            target, dest = name, None
            if sep and rest.endswith(("gate_proj.weight", "up_proj.weight")):
                target = f"{prefix}.mlp.gate_up_proj.weight"
                half = 0 if rest.startswith("gate_proj") else 1
                dest = params[target].data.chunk(2, dim=0)[half]
            elif target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                dest = params[target].data[:n_vocab]
            else:
                dest = params[target].data
            if index is None:  # a row-parallel bias: added once, by rank 0
                dest.zero_()
            else:
                dest.copy_(_tensor(_read(source, index, name), dest.shape, name))
            left[target] -= 0.5 if target.endswith("gate_up_proj.weight") else 1
        missing = sorted(n for n, count in left.items() if count > 0)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")

    def _shard_index(self, name: str) -> tuple[slice, ...] | None:
        """The part of checkpoint tensor ``name`` this rank holds (every row and column on
        one rank); None: the rank holds zeros (``o_proj``'s bias on ranks > 0)."""
        shard, every = self.tp.shard, slice(None)
        module, kind = name.split(".")[-2:]
        if module in ("embed_tokens", "lm_head"):
            vocab = shard.vocab(self.config.vocab_size)
            return (slice(vocab.start, min(vocab.stop, self.config.vocab_size)),)
        if ".self_attn." in name:
            attn = self.get_submodule(name.rsplit(".", 2)[0])
            assert isinstance(attn, MLAttention)
            cut = attn.shard_rows(module)
            if cut is None or shard.size == 1:
                return (every,)
            rows, dim = cut
            if dim == 0:
                return (rows,)
            if kind == "bias":  # row-parallel: added once, to the all-reduced sum
                return (every,) if shard.rank == 0 else None
            return (every, rows)
        if ".mlp." in name and module in ("gate_proj", "up_proj", "down_proj"):
            inter = shard.split(self.config.intermediate_size, "intermediate_size")
            cols = slice(inter.start, inter.stop)
            return (every, cols) if module == "down_proj" else (cols,)
        return (every,)

    def _layer_module(self, prefix: str) -> DeepseekDecoderLayer | None:
        try:
            module = self.get_submodule(prefix)
        except AttributeError:
            return None
        return module if isinstance(module, DeepseekDecoderLayer) else None
