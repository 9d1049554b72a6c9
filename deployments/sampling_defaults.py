"""The model's own sampling defaults, from its ``generation_config.json``.

Model authors ship the temperature, top-p/top-k, min-p and repetition penalty their model
was tuned for; like vLLM (``--generation-config auto``), pdserve uses them for every field
a request leaves unset, and OpenAI's defaults (temperature 1, no cuts, no penalty) for the
rest. Unknown or malformed values are an error at startup, naming the file and field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults for unset request fields (OpenAI's when the model sets none)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> SamplingDefaults:
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        data: dict[str, Any] = json.loads(path.read_text())
        values: dict[str, Any] = {}
        for name in _FIELDS:
            value = data.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{path}: {name} must be a number, got {value!r}")
            values[name] = int(value) if name == "top_k" else float(value)
        if values.get("top_k", 0) < 0:
            values["top_k"] = 0  # transformers' "off"
        return cls(**values)
