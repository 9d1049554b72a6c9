"""Malformed copies of a test checkpoint: the same files with its tensors edited, for tests
that a loader names the tensor it cannot read."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch


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
