"""Engine configuration (pydantic, strict): what model, where, and how big the KV pool is.

Loadable from YAML (``EngineConfig.from_yaml``). Unknown keys are rejected, never dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    """Everything an ``LLMEngine`` needs to start."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Path of a local Hugging Face model directory.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description=(
            "Weight/activation dtype; 'auto' = the checkpoint's, except float32 on a CPU "
            "for float16 checkpoints and for bfloat16 ones without native bf16 (AVX512-BF16/AMX)."
        ),
    )
    quantization: Literal["int8", "int8-weight-only", "fp8"] | None = Field(
        default=None,
        description=(
            "Quantize a float checkpoint's decoder linears at load, per output channel: "
            "'int8' = int8 weights and dynamic per-token int8 activations (W8A8), "
            "'int8-weight-only' = int8 weights (W8A16), 'fp8' = float8 e4m3 weights (fp8 "
            "activations on CUDA, weight-only on a CPU). The logits projection stays float. "
            "None = as the checkpoint is; a checkpoint with a quantization_config is read "
            "as quantized whatever this says, and setting it too is an error."
        ),
    )
    quantize_lm_head: bool = Field(
        default=False,
        description=(
            "Int8 weights (per output channel, weight-only) for the logits projection too, "
            "which otherwise stays float: a decode step reads it like any decoder linear. "
            "The float32 hidden states enter in three int8 planes (about float32 rounding), "
            "so only the weight's rounding moves the logits. CPU only for now; not on the "
            "transformers model path."
        ),
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "int8"] = Field(
        default="auto",
        description=(
            "Element type of the KV cache: 'auto' = the model's dtype; 'fp8_e4m3' / 'int8' "
            "= one byte per element (half of bf16: twice the blocks in the same memory and "
            "half the bytes per KV hand-off), with per-layer, per-KV-head scales from the "
            "checkpoint's k_scale/v_scale (fp8) or calibrated at load. Prefill and decode "
            "pools must use the same value."
        ),
    )
    model_impl: Literal["auto", "native", "transformers"] = Field(
        default="auto",
        description=(
            "Which model code runs the checkpoint: 'native' = pdserve's own class (the Llama "
            "family, Qwen3, Qwen3-MoE, Mixtral), 'transformers' = transformers' modelling code "
            "with pdserve's paged attention registered as its attention (any decoder-only "
            "model whose attention "
            "goes through AttentionInterface), 'auto' = native where a class exists, else "
            "transformers."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="'auto' picks cuda when available, else cpu."
    )
    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV block.")
    num_kv_blocks: int | None = Field(
        default=None,
        ge=1,
        description="KV blocks in the pool; None = sized by the model runner's profiler.",
    )
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, description="Token budget of one step (prefill chunks + decodes)."
    )
    max_num_seqs: int = Field(default=64, ge=1, description="Most requests running at once.")
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Longest prompt + output in tokens; None = the model's context, capped at what "
            "the KV pool holds."
        ),
    )
    window_kv_pool: bool = Field(
        default=True,
        description=(
            "Sliding-window layers of a model that mixes them with full-attention layers "
            "(gpt-oss, Gemma 2/3) keep only their window's KV, in a pool of their own. Off, "
            "or with a KV connector that moves one pool (one built without window_pool): "
            "they keep the whole sequence's KV like the other layers."
        ),
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse full KV blocks of identical prompt prefixes."
    )
    seed: int = Field(default=0, description="Seed for unseeded sampling and test weights.")
    cuda_graphs: bool = Field(
        default=True,
        description=(
            "On CUDA, replay decode steps from CUDA graphs captured over batch-size buckets "
            "at start-up (prefill and mixed steps run eagerly); false = every step eager. "
            "Ignored on a CPU and under tensor parallelism (eager there); on the "
            "transformers model path, eager where the model's code cannot be captured."
        ),
    )

    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description=(
            "Ranks the model is split over (Megatron-style: attention heads, MLP columns and "
            "the vocabulary); rank 0 runs the scheduler and samples, every rank holds the KV "
            "heads it computes. NCCL between GPUs, gloo between CPU processes."
        ),
    )
    tp_workers: Literal["auto", "mp", "ray"] = Field(
        default="auto",
        description=(
            "How ranks 1..tp-1 are started: 'mp' = child processes of this one, 'ray' = Ray "
            "actors in the bundles of the caller's placement group (a Serve replica's "
            "placement_group_bundles), 'auto' = ray inside a placement group, else mp."
        ),
    )

    @model_validator(mode="after")
    def _check_cross_fields(self) -> EngineConfig:
        if self.quantize_lm_head and self.device == "cuda":
            raise ValueError("quantize_lm_head runs on the CPU only for now (device='cuda')")
        if self.num_kv_blocks is not None and self.max_model_len is not None:
            need = -(-self.max_model_len // self.block_size)
            if self.num_kv_blocks < need:
                raise ValueError(
                    f"num_kv_blocks ({self.num_kv_blocks}) cannot hold one request of "
                    f"max_model_len ({self.max_model_len}) tokens: need {need} blocks"
                )
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of EngineConfig fields")
        return cls.model_validate(data)
