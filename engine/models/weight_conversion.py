"""Checkpoint tensors that transformers converts at load (renamed, or fused: Qwen3-MoE's and
Mixtral's per-expert weights stacked into one tensor per layer), for loaders that read the
safetensors themselves (the tensor-parallel one, ``transformers_tp``).

The rules are transformers' own (``conversion_mapping.get_checkpoint_conversion_mapping``);
their operations run on the collected tensors unchanged. This module only matches names and
collects; it never decides how a tensor is split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch


def _pattern(source: str) -> re.Pattern[str]:
    """A conversion pattern (``*`` for an index) as a regex whose group is the index."""
    return re.compile(re.escape(source).replace(r"\*", r"(\d+)"))


@dataclass
class _Fused:
    """The tensors one converted parameter is built from: source pattern -> index -> tensor."""

    converter: Any  # transformers' WeightConverter
    parts: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)


class CheckpointConversion:
    """Maps checkpoint names onto a model's parameter names and builds fused parameters."""

    def __init__(self, model_type: str) -> None:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        rules = get_checkpoint_conversion_mapping(model_type) or []
        self.renamings = [
            (re.compile(src.replace("*", r"\d+")), tgt)
            for rule in rules
            if not isinstance(rule, WeightConverter)
            for src, tgt in zip(rule.source_patterns, rule.target_patterns, strict=True)
        ]
        self.converters = [rule for rule in rules if isinstance(rule, WeightConverter)]
        self.pending: dict[str, _Fused] = {}

    def rename(self, name: str) -> str:
        """The model's name for a checkpoint tensor that is only renamed."""
        for pattern, target in self.renamings:
            name = pattern.sub(target, name)
        return name

    def fused_target(self, name: str) -> tuple[str, Any, str, int] | None:
        """(parameter name, converter, source pattern, index) of a tensor that is fused into
        a parameter; None for any other tensor."""
        for converter in self.converters:
            for source in converter.source_patterns:
                match = _pattern(source).search(name)
                if match is not None and match.end() == len(name):
                    prefix = name[: match.start()]
                    index = int(match.group(1)) if match.groups() else 0
                    return prefix + converter.target_patterns[0], converter, source, index
        return None

    def collect(
        self, target: str, converter: Any, source: str, index: int, t: torch.Tensor
    ) -> None:
        fused = self.pending.setdefault(target, _Fused(converter))
        fused.parts.setdefault(source, {})[index] = t

    def build(self) -> dict[str, torch.Tensor]:
        """Every collected parameter, converted by transformers' operations."""
        built = {}
        for target, fused in self.pending.items():
            conv = fused.converter
            data: dict[str, Any] = {
                src: [parts[i] for i in sorted(parts)] for src, parts in fused.parts.items()
            }
            for op in conv.operations:
                data = op.convert(data, conv.source_patterns, conv.target_patterns)
            (value,) = data.values()
            built[target] = value[0] if isinstance(value, list) else value
        self.pending.clear()
        return built
