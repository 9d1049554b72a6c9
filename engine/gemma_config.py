"""The config of a Gemma 2 / Gemma 3 (text) checkpoint, for the native class
(``models/gemma.py``).

config.json is read through transformers' own config class, so every spelling of it
(``rope_local_base_freq`` / ``sliding_window_pattern`` in older Gemma 3 files,
``layer_types`` and per-layer ``rope_parameters`` in newer ones, Gemma 2's defaults) gives
the layer layout transformers itself would run. What pdserve cannot serve natively
(another activation, bidirectional attention, a RoPE type the kernels lack) is refused
here, before any weight is read. This module never builds a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine.kv_layout import KVLayerSpec

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pdserve.engine.loader import ModelConfig

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_ACTIVATIONS = ("gelu_pytorch_tanh",)


@dataclass(frozen=True)
class GemmaConfig:
    """What Gemma adds to the Llama-family config (``ModelConfig`` holds the rest; its
    ``rope_theta`` / ``rope_scaling`` are the full-attention layers' RoPE, its ``kv_layers``
    each layer's window)."""

    query_scale: float  # query_pre_attn_scalar ** -0.5, not head_dim ** -0.5
    attn_logit_softcap: float | None  # tanh cap of the attention logits (Gemma 2)
    final_logit_softcap: float | None  # tanh cap of the output logits
    # Which layers are "sliding_attention" (they take the sliding RoPE below).
    sliding_layers: tuple[bool, ...]
    # RoPE of the sliding-window layers (Gemma 3: rope_local_base_freq, never scaled).
    sliding_rope_theta: float
    sliding_rope_scaling: dict[str, Any] | None


def gemma_model_config(model_dir: Path, cfg: dict[str, Any], arch: str) -> ModelConfig:
    """The ModelConfig of a Gemma 2 / Gemma 3 text checkpoint (``cfg``: its config.json)."""
    from pdserve.engine.loader import ModelConfig, _generation_fields, _rope
    from pdserve.engine.quantization import read_quantization_config
    from pdserve.engine.transformers_config import load_hf_config

    hf = load_hf_config(model_dir, arch)
    act = getattr(hf, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"{arch}: hidden_activation {act!r} is not supported; supported: "
                         f"{', '.join(_ACTIVATIONS)}")  # fmt: skip
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"{arch}: bidirectional attention (embedding models) is not supported")
    layer_types = list(hf.layer_types)
    kinds = set(layer_types) - {"sliding_attention", "full_attention"}
    if kinds:
        raise ValueError(f"{arch}: layer types {sorted(kinds)} are not supported")
    rope = hf.rope_parameters
    if "full_attention" in rope:  # Gemma 3: one set of RoPE parameters per layer type
        full, sliding = rope["full_attention"], rope["sliding_attention"]
    else:
        full = sliding = rope
    theta, scaling = _rope({"rope_parameters": full})
    sliding_theta, sliding_scaling = _rope({"rope_parameters": sliding})
    heads = int(hf.num_attention_heads)
    kv_heads = int(hf.num_key_value_heads or heads)
    head_dim = int(getattr(hf, "head_dim", None) or int(hf.hidden_size) // heads)
    window = int(hf.sliding_window) if hf.sliding_window else None
    layers = tuple(
        KVLayerSpec(kv_heads, head_dim, head_dim, window if kind == "sliding_attention" else None)
        for kind in layer_types
    )
    eos, bos, ckpt_dtype = _generation_fields(model_dir, cfg)
    bias = bool(getattr(hf, "attention_bias", False))
    gemma = GemmaConfig(
        query_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        attn_logit_softcap=_cap(getattr(hf, "attn_logit_softcapping", None)),
        final_logit_softcap=_cap(getattr(hf, "final_logit_softcapping", None)),
        sliding_layers=tuple(kind == "sliding_attention" for kind in layer_types),
        sliding_rope_theta=sliding_theta,
        sliding_rope_scaling=sliding_scaling,
    )
    return ModelConfig(
        model_name=model_dir.name,
        architecture=arch,
        num_layers=int(hf.num_hidden_layers),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(hf.vocab_size),
        max_position_embeddings=int(hf.max_position_embeddings),
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        sliding_window=None,  # windows are per layer (kv_layers) and attended exactly
        eos_token_ids=eos,
        bos_token_id=bos,
        checkpoint_dtype=ckpt_dtype,
        quantization=read_quantization_config(cfg),
        kv_layers=layers,
        qk_norm=arch == "Gemma3ForCausalLM",
        gemma=gemma,
        extra=cfg,
    )


def _cap(value: Any) -> float | None:
    return float(value) if value else None
