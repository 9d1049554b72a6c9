"""Shared checks of the quantized-checkpoint tests: malformed copies of a checkpoint (its
tensors edited, for tests that a loader names the tensor it cannot read) and the engine
runs each quantized model must pass against its transformers reference."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.transformers_reference import (
    ARRIVALS,
    PREEMPT_ARRIVALS,
    Reference,
    check_native_engine,
    small_pool_config,
)


def edited_checkpoint(
    src: Path, out: Path, edit: Callable[[dict[str, torch.Tensor]], None]
) -> Path:
    """``src`` copied to ``out`` with ``edit`` applied (in place) to its tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def block_dequantized(q: torch.Tensor, block_scale: torch.Tensor, block: int) -> torch.Tensor:
    """Every fp8 value times the scale of the ``block`` x ``block`` tile it falls in (the
    last tiles cut short), float32."""
    tiles = block_scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return q.float() * tiles[: q.shape[0], : q.shape[1]]


def dequantized_copy(model_dir: Path, out: Path, block: int) -> Path:
    """The float checkpoint holding exactly an fp8 block checkpoint's dequantized weights,
    as transformers' oracle for it."""

    def dequantize(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.endswith(".weight_scale_inv")]:
            weight = name.removesuffix("_scale_inv")
            t[weight] = block_dequantized(t[weight], t.pop(name), block)

    out = edited_checkpoint(model_dir, out, dequantize)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def check_default_schedule(model_dir: Path, ref: Reference, num_new: int) -> None:
    """A float32 engine of ``model_dir`` gives ``ref``'s tokens for ARRIVALS."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32"))
    check_native_engine(engine, ref, ARRIVALS, num_new)


def check_small_pool(model_dir: Path, ref: Reference, num_new: int) -> None:
    """32-token chunks and a pool that forces preemption: still ``ref``'s tokens."""
    engine = LLMEngine(small_pool_config(model_dir))
    check_native_engine(engine, ref, PREEMPT_ARRIVALS, num_new)
    assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"


def check_two_ranks(model_dir: Path, ref: Reference, num_new: int) -> None:
    """Heads and expert columns over two tensor-parallel ranks (gloo): ``ref``'s tokens."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=2))
    try:
        check_native_engine(engine, ref, ARRIVALS[:4], num_new)
    finally:
        engine.shutdown()
