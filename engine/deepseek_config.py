"""The ``ModelConfig`` of a DeepSeek-V3 (or V2) checkpoint on the native path: multi-head
latent attention (MLA) dimensions, yarn RoPE with DeepSeek's mscale, and the router with
shared experts (V3: sigmoid-scored, grouped, with a correction bias; V2: softmax-scored
top-k, plain or group-limited, not renormalised).

The KV pool of the native class holds one head per token: the compressed latent
(``kv_lora_rank``) followed by the rope key (``qk_rope_head_dim``), instead of
``num_heads`` expanded keys and values. This module only reads config.json; it never
touches weights or the KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pdserve.engine.kv_layout import KVLayerSpec
from pdserve.engine.loader import ModelConfig, MoEConfig, _generation_fields
from pdserve.engine.quantization import read_quantization_config

_ROPE_TYPES = ("default", "yarn")
_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
# The RMSNorms of the q and kv latents: transformers builds them with its default epsilon,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention and the DeepSeek router of a checkpoint."""

    q_lora_rank: int | None  # None: q is one projection of the hidden state
    kv_lora_rank: int  # width of the cached latent
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # width of the cached rope key
    v_head_dim: int
    rope_interleave: bool  # the rotary pairs are (x0, x1), (x2, x3), ... (transformers' flag)
    softmax_scale: float  # qk_head_dim ** -0.5, times yarn's mscale_all_dim squared
    rope_attention_factor: float  # yarn's cos/sin multiplier; 1.0 without yarn
    # Router: ``scoring`` of the logits (V3: sigmoid plus a selection-only correction bias,
    # V2: softmax), the best ``topk_groups`` of ``num_groups`` expert groups (a group scored
    # by ``group_score``: V3 its best two experts' sum, V2 its best expert), weights scaled
    # by ``routed_scaling``; shared experts on every token.
    scoring: str
    correction_bias: bool
    num_groups: int
    topk_groups: int
    group_score: Literal["top2_sum", "max"]
    routed_scaling: float
    num_shared_experts: int

    @property
    def latent_dim(self) -> int:
        """Head size of the cache slot: latent, then rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"DeepSeek rope type {rope_type!r} is not supported natively; supported: "
            f"{', '.join(_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if "factor" not in params or "original_max_position_embeddings" not in params:
        raise ValueError("yarn rope_scaling needs factor and original_max_position_embeddings")
    return theta, {"rope_type": "yarn", **params}


def _mla(cfg: dict[str, Any], scaling: dict[str, Any] | None, arch: str) -> MLAConfig:
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {rope}")
    scale = (nope + rope) ** -0.5
    attention_factor = 1.0
    if scaling is not None:
        factor = float(scaling["factor"])
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale_all:
            scale *= yarn_mscale(factor, float(mscale_all)) ** 2
        if scaling.get("attention_factor") is not None:
            attention_factor = float(scaling["attention_factor"])
        elif mscale and mscale_all:
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(
                factor, float(mscale_all)
            )
        else:
            attention_factor = yarn_mscale(factor)
    groups, topk_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    v2 = arch == "DeepseekV2ForCausalLM"
    method = cfg.get("topk_method") or "greedy"
    if v2 and method not in _V2_TOPK_METHODS:
        raise ValueError(
            f"{arch}: topk_method {method!r} is not supported natively; supported: "
            f"{', '.join(_V2_TOPK_METHODS)}"
        )
    if v2 and method == "greedy":  # V2's plain greedy ignores n_group / topk_group
        groups = topk_groups = 1
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(cfg["v_head_dim"]),
        # V2 always rotates interleaved pairs (as complex numbers).
        rope_interleave=v2 or bool(cfg.get("rope_interleave", True)),
        softmax_scale=scale,
        rope_attention_factor=attention_factor,
        scoring="softmax" if v2 else "sigmoid",
        correction_bias=not v2,
        num_groups=groups,
        topk_groups=topk_groups,
        group_score="max" if v2 else "top2_sum",
        routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
    )


def deepseek_model_config(model_dir: Path, cfg: dict[str, Any], arch: str) -> ModelConfig:
    """The native ``ModelConfig`` of a DeepSeek-V3 / V2 config.json (ValueError on what the
    native class does not run: quantized checkpoints other than fp8 blocks (those are read
    dequantized), rope types other than yarn, V2
    routing methods other than greedy and group-limited greedy)."""
    scheme = read_quantization_config(cfg)
    fp8_block = None
    if scheme is not None:
        if cfg["quantization_config"].get("quant_method") != "fp8" or scheme.block is None:
            raise ValueError(
                f"quantized {arch} checkpoints: only quant_method fp8 with weight_block_size "
                "is read natively (every linear dequantized at load)"
            )
        fp8_block = scheme.block
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; supported: silu")
    theta, scaling = _rope(cfg)
    mla = _mla(cfg, scaling, arch)
    layers = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("n_routed_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise ValueError(f"{arch}: num_experts_per_tok ({top_k}) must be in [1, {experts}]")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    moe = MoEConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(cfg["moe_intermediate_size"]),
        # V2 never renormalises (its config's norm_topk_prob is unused by the model).
        renormalize=arch != "DeepseekV2ForCausalLM" and bool(cfg.get("norm_topk_prob", True)),
        sparse_layers=frozenset(range(first_dense, layers)),
    )
    heads = int(cfg["num_attention_heads"])
    eos, bos, ckpt_dtype = _generation_fields(model_dir, cfg)
    spec = KVLayerSpec(num_kv_heads=1, key_dim=mla.latent_dim, value_dim=mla.kv_lora_rank)
    return ModelConfig(
        model_name=model_dir.name,
        architecture=arch,
        num_layers=layers,
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=1,
        head_dim=mla.latent_dim,
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=False,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=None,
        eos_token_ids=eos,
        bos_token_id=bos,
        checkpoint_dtype=ckpt_dtype,
        kv_layers=(spec,) * layers,
        moe=moe,
        mla=mla,
        dequantized_fp8_block=fp8_block,
        extra=cfg,
    )
