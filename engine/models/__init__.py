"""Model registry: Hugging Face architecture name -> the class that implements it."""

from __future__ import annotations

from torch import nn

from pdserve.engine.loader import SUPPORTED_ARCHITECTURES, ModelConfig
from pdserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdserve.engine.models.gemma import GemmaForCausalLM
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.parallel import SINGLE, TPGroup

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "GptOssForCausalLM": LlamaForCausalLM,
}
assert set(_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def model_class(architecture: str) -> type[nn.Module]:
    """The class for ``architecture``; ValueError naming the supported ones otherwise."""
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture} is not supported; supported: {', '.join(_REGISTRY)}"
        ) from None


def build_model(cfg: ModelConfig, max_position: int, tp: TPGroup = SINGLE) -> LlamaForCausalLM:
    """The model (this rank's shard of it under tensor parallelism)."""
    cls = model_class(cfg.architecture)
    return cls(cfg, max_position, tp)  # type: ignore[return-value]
