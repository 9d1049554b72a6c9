"""Shared pytest fixtures: the deterministic test models (generated once, then cached).

The cache directory is ``$PDSERVE_MODEL_CACHE`` if set, else ``models/`` at the repository
root (git-ignored). Models are written by ``engine.testmodel`` from a fixed seed and the
shipped corpus, so every machine gets the same files without a download.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Triton decides at import whether it interprets; some test modules import it indirectly
# (transformers does) before tests/kernels/conftest.py runs. Without CUDA the compiled
# kernels are never used, so interpret everywhere from the start.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    from engine.testmodel import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def test_model(model_cache_dir: Path) -> Callable[[str], Path]:
    """Factory: ``test_model("tiny" | "small" | "llama3-gqa" | "qwen2" | "mqa") -> model dir``."""
    from engine.testmodel import ensure_test_model

    return lambda name: ensure_test_model(name, model_cache_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(test_model: Callable[[str], Path]) -> Path:
    """The tiny Llama (GQA, float32, ~1M params) with its locally trained tokenizer."""
    return test_model("tiny")
