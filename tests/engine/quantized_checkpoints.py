"""Shared checks of the quantized-checkpoint tests: malformed copies of a checkpoint (its
tensors edited, for tests that a loader names the tensor it cannot read) and the engine
runs each quantized model must pass against its transformers reference."""

from __future__ import annotations

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
