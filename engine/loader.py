"""Read a local Hugging Face model directory: config, weights and tokenizer.

Everything comes from the directory given (config.json, generation_config.json,
*.safetensors, tokenizer files); nothing is ever fetched from a hub. This module knows the
Hugging Face file formats and nothing about batching or the KV cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.expert_quant import ExpertQuant, read_expert_quant
from pdserve.engine.gemma_config import GEMMA_ARCHITECTURES, GemmaConfig
from pdserve.engine.kv_layout import KVLayerSpec
from pdserve.engine.quantization import QuantScheme, read_quantization_config
from pdserve.kernels.ops import ClampedSwiGLU, can_pack

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pdserve.engine.deepseek_config import MLAConfig

# Architectures models/llama.py implements (they differ only in config details: q/k norm,
# mixture-of-experts MLPs, attention sinks and per-layer windows); any other decoder-only
# transformers model runs on the transformers-backed path.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma2ForCausalLM",  # models/gemma.py
    "Gemma3ForCausalLM",  # models/gemma.py
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
)
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
MODEL_IMPLS = ("auto", "native", "transformers")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts MLPs of a checkpoint (Mixtral, Qwen3-MoE, gpt-oss)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k weights are divided by their sum
    sparse_layers: frozenset[int]  # layers whose MLP is the MoE (the others are dense)
    # gpt-oss: top-k of the router logits, softmax over those k.
    softmax_after_topk: bool = False
    # gpt-oss: the router and every expert projection carry a bias.
    biases: bool = False
    # The experts' activation; None: SiLU-and-mul.
    activation: ClampedSwiGLU | None = None
    # How the checkpoint stores the experts (MXFP4, fp8 blocks); None: float. They are
    # held dequantized in the engine's dtype.
    quantized: ExpertQuant | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family checkpoint, normalised across config versions."""

    model_name: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else the HF rope parameters (rope_type "linear" or "llama3").
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    # Mistral-style sliding window; the runner caps the context at it so attention is exact.
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # dtype the weights are stored in (checkpoint dtype), before EngineConfig.dtype applies.
    checkpoint_dtype: torch.dtype
    # dtype the engine runs in; set by the runner from EngineConfig.dtype.
    dtype: torch.dtype = torch.float32
    # How the checkpoint's linear layers are quantized (its quantization_config); None: float.
    quantization: QuantScheme | None = None
    # Which model class runs it: "native" (models/llama.py) or "transformers"
    # (models/transformers_backend.py).
    impl: str = "native"
    # Each layer's KV (heads, key/value sizes, window): the transformers path fills it, and
    # native models whose layers differ in window (gpt-oss); empty: every layer alike.
    kv_layers: tuple[KVLayerSpec, ...] = ()
    # RMSNorm over each query and key head before RoPE (Qwen3).
    qk_norm: bool = False
    # Mixture-of-experts MLPs; None: every layer's MLP is dense.
    moe: MoEConfig | None = None
    # Gemma 2 / 3 specifics (engine/gemma_config.py); None for every other architecture.
    gemma: GemmaConfig | None = None
    # Multi-head latent attention (DeepSeek-V2/V3, engine/deepseek_config.py); None: other.
    mla: MLAConfig | None = None
    # A learned logit per query head in every softmax's denominator (gpt-oss).
    attention_sinks: bool = False
    # An fp8 block checkpoint (scale block rows, cols) read by a class without fp8 linears
    # (DeepSeek-V2/V3): every fp8 weight is dequantized as it loads; None: not such a one.
    dequantized_fp8_block: tuple[int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_context(self) -> int:
        """Longest context that is attended exactly (positions and sliding window)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def kv_planes(self) -> int:
        """Planes of the KV pool ``[L, planes, N, B, Hkv, D]``: 2 (keys, values), or 1 for
        MLA, whose value is the first ``kv_lora_rank`` columns of the cached latent slot."""
        return 1 if self.mla is not None else 2

    @property
    def kv_identity(self) -> str:
        """What the KV pool holds, as both ends of a hand-off must agree on: the model, and
        for MLA that its slots hold the latent rather than per-head K/V."""
        return self.model_name if self.mla is None else f"{self.model_name} (MLA latent KV)"


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either transformers 5 ``rope_parameters`` or 4.x keys."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params = dict(params)
    # 4.x checkpoints spell the type "type"; "dynamic", "longrope" etc. are rejected below.
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn" and params.get("factor") is None:
        original = float(params["original_max_position_embeddings"])
        params["factor"] = float(cfg.get("max_position_embeddings", 2048)) / original
    params["rope_type"] = rope_type
    params.pop("type", None)
    return theta, params


def load_model_config(model_dir: str | Path, impl: str = "auto") -> ModelConfig:
    """Parse config.json (+ generation_config.json) of a local HF directory. ``impl``:
    "native" = the architecture must have a native class, "transformers" = run it through
    transformers' modelling code, "auto" = native where a class exists, else transformers."""
    model_dir = Path(model_dir)
    if impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}; got {impl!r}")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model: {model_dir} has no config.json (expected a local HF directory)")
    cfg = _read_json(config_path)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else f"<none; model_type={cfg.get('model_type')!r}>"
    if impl == "native" and arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {arch} has no native implementation; native: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_impl 'auto' or 'transformers' runs "
            "it through transformers)"
        )
    if impl == "transformers" or arch not in SUPPORTED_ARCHITECTURES:
        if not archs:
            raise ValueError(f"architecture {arch} is not supported: config.json names none")
        return _transformers_model_config(model_dir, cfg, arch)
    if arch in GEMMA_ARCHITECTURES:
        from pdserve.engine.gemma_config import gemma_model_config

        return gemma_model_config(model_dir, cfg, arch)
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        from pdserve.engine.deepseek_config import deepseek_model_config

        return deepseek_model_config(model_dir, cfg, arch)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; supported: silu")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of kv heads")
    theta, scaling = _rope(cfg)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(cfg.get("attention_bias", False))
    sliding = cfg.get("sliding_window")
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        sliding = None  # the Qwen configs store a window they do not use
    is_gpt_oss = arch == "GptOssForCausalLM"
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv_layers: tuple[KVLayerSpec, ...] = ()
    if is_gpt_oss:  # windows on some layers only: attended per layer, the context not capped
        kv_layers = _per_layer_windows(cfg, kv_heads, head_dim, sliding)
        sliding = None
    moe = _moe_config(cfg, arch)
    expert_quant = read_expert_quant(cfg, arch) if moe is not None else None
    if moe is not None:
        moe = replace(moe, quantized=expert_quant)
    # MXFP4 covers only the experts; the other linears of such a checkpoint are float.
    mxfp4 = expert_quant is not None and expert_quant.method == "mxfp4"
    quantization = None if mxfp4 else read_quantization_config(cfg)

    eos, bos, ckpt_dtype = _generation_fields(model_dir, cfg)
    return ModelConfig(
        model_name=model_dir.name,
        architecture=arch,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=eos,
        bos_token_id=bos,
        checkpoint_dtype=ckpt_dtype,
        quantization=quantization,
        qk_norm=arch in _QK_NORM_ARCHITECTURES,
        moe=moe,
        kv_layers=kv_layers,
        attention_sinks=is_gpt_oss,
        extra=cfg,
    )


def _per_layer_windows(
    cfg: dict[str, Any], kv_heads: int, head_dim: int, window: int | None
) -> tuple[KVLayerSpec, ...]:
    """Each layer's KV with its window: ``layer_types`` names the sliding layers (gpt-oss
    alternates them, starting with a sliding one, when the config does not say)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
    ]
    if len(types) != n:
        raise ValueError(f"layer_types: {len(types)} entries for {n} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types: unsupported {sorted(unknown)}")
    if "sliding_attention" in types and not window:
        raise ValueError("layer_types names sliding layers but sliding_window is not set")
    return tuple(
        KVLayerSpec(kv_heads, head_dim, head_dim, window if t == "sliding_attention" else None)
        for t in types
    )


def _moe_config(cfg: dict[str, Any], arch: str) -> MoEConfig | None:
    """Mixtral: every layer, renormalised top-k. Qwen3-MoE: the layers that
    ``decoder_sparse_step`` picks minus ``mlp_only_layers``, renormalised if
    ``norm_topk_prob``."""
    if arch not in _MOE_ARCHITECTURES:
        return None
    layers = range(int(cfg["num_hidden_layers"]))
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok", 0))
    if not 0 < top_k <= experts:
        raise ValueError(f"{arch}: num_experts_per_tok ({top_k}) must be in [1, {experts}]")
    if arch == "MixtralForCausalLM":
        return MoEConfig(experts, top_k, int(cfg["intermediate_size"]), True, frozenset(layers))
    if arch == "GptOssForCausalLM":
        act = ClampedSwiGLU(
            float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))
        )
        return MoEConfig(
            experts, top_k, int(cfg["intermediate_size"]), False, frozenset(layers),
            softmax_after_topk=True, biases=True, activation=act,
        )  # fmt: skip
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"{arch}: decoder_sparse_step must be >= 1, got {step}")
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    sparse = frozenset(i for i in layers if i not in dense and (i + 1) % step == 0)
    renorm = bool(cfg.get("norm_topk_prob", False))
    return MoEConfig(experts, top_k, int(cfg["moe_intermediate_size"]), renorm, sparse)


def _generation_fields(
    model_dir: Path, cfg: dict[str, Any]
) -> tuple[tuple[int, ...], int | None, torch.dtype]:
    """(eos ids, bos id, checkpoint dtype) from generation_config.json and config.json."""
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    eos: list[int] = []
    for tid in _as_id_list(gen.get("eos_token_id")) + _as_id_list(cfg.get("eos_token_id")):
        if tid not in eos:
            eos.append(tid)
    ckpt_dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if ckpt_dtype not in _DTYPES:
        raise ValueError(f"checkpoint dtype {ckpt_dtype!r} is not supported; use {list(_DTYPES)}")
    return tuple(eos), gen.get("bos_token_id", cfg.get("bos_token_id")), _DTYPES[ckpt_dtype]


def _transformers_model_config(model_dir: Path, cfg: dict[str, Any], arch: str) -> ModelConfig:
    """The ModelConfig of a model the transformers-backed path runs: refused here (before
    any weight is read) when it cannot work; per-layer KV from the config."""
    from pdserve.engine import transformers_config as tc
    from pdserve.engine.kv_layout import pool_dims

    hf = tc.load_hf_config(model_dir, arch)
    tc.model_class(hf, arch)
    layers = tc.kv_layer_specs(hf)
    kv_heads, slot_dim = pool_dims(layers, arch)
    eos, bos, ckpt_dtype = _generation_fields(model_dir, cfg)
    heads = int(hf.num_attention_heads)
    rope = getattr(hf, "rope_parameters", None) or {}
    return ModelConfig(
        model_name=model_dir.name,
        architecture=arch,
        num_layers=len(layers),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(getattr(hf, "intermediate_size", 0) or 0),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=slot_dim,
        vocab_size=int(hf.vocab_size),
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048)),
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6) or 1e-6),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=None,  # transformers' own rotary embedding runs on this path
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        sliding_window=None,  # windows are attended exactly, per layer (kv_layers)
        eos_token_ids=eos,
        bos_token_id=bos,
        checkpoint_dtype=ckpt_dtype,
        quantization=read_quantization_config(cfg),
        impl="transformers",
        kv_layers=layers,
        extra=cfg,
    )


def resolve_dtype(
    requested: str, checkpoint_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """EngineConfig.dtype -> torch dtype. "auto" is the checkpoint's dtype, except on a CPU
    where it would be slow: float16 always, bfloat16 without native support (AVX512-BF16 /
    AMX), and those run in float32."""
    if requested == "auto":
        if device.type != "cpu" or checkpoint_dtype == torch.float32:
            return checkpoint_dtype
        native = checkpoint_dtype == torch.bfloat16 and can_pack(torch.bfloat16, device)
        return checkpoint_dtype if native else torch.float32
    if requested not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {requested!r}")
    return _DTYPES[requested]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files: those named by the shard index, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index)["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_dir}")
    return files


def iter_weight_slices(model_dir: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield (name, lazy slice) for every tensor: indexing a slice reads only those rows or
    columns from the file, so a tensor-parallel rank loads just its shard."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_slice(name)


def load_tokenizer(model_dir: str | Path) -> Any:
    """The directory's tokenizer through transformers (fast tokenizer when available)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
