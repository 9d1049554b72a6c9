"""What the transformers-backed model path can serve, read from a checkpoint's config.

A decoder-only model whose attention goes through transformers' ``AttentionInterface`` can
run on pdserve's paged KV cache (``models/transformers_backend.py``). This module decides
that from config.json alone, before any weight is read: encoder-decoders, hybrid and
linear-attention models (Mamba layers, Qwen3-Next) and models whose attention bypasses the
interface are refused with a ValueError naming the architecture and the reason. It also
describes each layer's KV (``KVLayerSpec``). It never builds a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.engine.kv_layout import KVLayerSpec

# Layer kinds that hold a KV cache pdserve can page; anything else (linear attention,
# Mamba, chunked attention) is refused.
_ATTENTION_LAYERS = ("full_attention", "sliding_attention")


def load_hf_config(model_dir: str | Path, architecture: str) -> Any:
    """The checkpoint's transformers config (local files only, never remote code)."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"architecture {architecture} is not supported: transformers "
            f"{transformers.__version__} cannot read its config ({first_line})"
        ) from None


def model_class(hf_config: Any, architecture: str) -> Any:
    """The transformers class for ``architecture``; ValueError if it cannot be served."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(
            f"architecture {architecture} is an encoder-decoder model; pdserve serves "
            "decoder-only models"
        )
    kinds = sorted({k for k in layer_types(hf_config) if k not in _ATTENTION_LAYERS})
    if kinds or getattr(hf_config, "model_type", "") in ("mamba", "mamba2"):
        raise ValueError(
            f"architecture {architecture} has hybrid or linear-attention layers "
            f"({', '.join(kinds) or 'mamba'}); pdserve's paged KV cache holds attention "
            "layers only"
        )
    cls = getattr(transformers, architecture, None)
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if cls is None or architecture not in causal:
        raise ValueError(
            f"architecture {architecture} is not a causal language model in transformers "
            f"{transformers.__version__}"
        )
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(
            f"architecture {architecture}: its attention does not go through transformers' "
            "AttentionInterface (_supports_attention_backend is False), so it cannot run on "
            "pdserve's paged attention"
        )
    return cls


def layer_types(hf_config: Any) -> list[str]:
    """Each decoder layer's kind ("full_attention", "sliding_attention", ...)."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return list(types)
    # Older configs: a window on every layer (Mistral) or none.
    kind = "sliding_attention" if getattr(hf_config, "sliding_window", None) else "full_attention"
    return [kind] * int(hf_config.num_hidden_layers)


def kv_layer_specs(hf_config: Any) -> tuple[KVLayerSpec, ...]:
    """Each layer's KV: heads, key/value head sizes (DeepSeek's MLA: 192/128) and window."""
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads)
    key_dim = int(getattr(hf_config, "qk_head_dim", None) or head_dim)
    value_dim = int(getattr(hf_config, "v_head_dim", None) or head_dim)
    window = getattr(hf_config, "sliding_window", None)
    specs = []
    for kind in layer_types(hf_config):
        sliding = int(window) if kind == "sliding_attention" and window else None
        specs.append(KVLayerSpec(kv_heads, key_dim, value_dim, sliding))
    return tuple(specs)
