"""Tensor parallelism on the transformers-backed path, from the model's own
``base_model_tp_plan``.

transformers states for each architecture how its modules split over ranks (``colwise``:
output features, ``rowwise``: input features then a sum over the ranks,
``embedding_rowwise``: vocabulary rows, ...). Its own implementation of the plan runs on
DTensors over torch's default process group; pdserve keeps an explicit group per replica
(``engine/parallel.py``) and its own collectives, so this module reads the same plan and
applies it with them: each rank holds only its slice of every split weight (read from the
safetensors as a slice, never the whole tensor), row-parallel outputs are all-reduced and
vocabulary-parallel embeddings masked and summed. Attention must be split by heads
(q/k/v ``colwise``, o ``rowwise``), so each rank's paged KV cache holds its own KV heads
(the contiguous ranges of ``TPShard.kv_heads``). Checkpoint tensors that transformers fuses
at load (per-expert MoE weights) are fused here with its own rules
(``weight_conversion``); their parameter must not be split.

``check_plan`` refuses, from the config alone, a model this cannot split; ``load_sharded``
builds one rank's model. This module never allocates the KV cache.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from pdserve.engine.loader import SUPPORTED_ARCHITECTURES, iter_weight_slices
from pdserve.engine.models.llama import _read
from pdserve.engine.models.weight_conversion import CheckpointConversion
from pdserve.engine.parallel import TPGroup, TPShard

# plan style -> whether the output is all-gathered afterwards
_COLWISE = {"colwise": False, "colwise_gather_output": True, "colwise_rep": True}
# plan style -> whether the (replicated) input is split to this rank's columns first
_ROWWISE = {"rowwise": False, "rowwise_split_input": True, "rowwise_rep": True}
_EMBEDDING = "embedding_rowwise"
_REPLICATED = ("replicated_with_grad_allreduce", "replicate")
SUPPORTED_STYLES = frozenset({*_COLWISE, *_ROWWISE, _EMBEDDING, *_REPLICATED})


def _version() -> str:
    import transformers

    return str(transformers.__version__)


def read_plan(hf_config: Any, architecture: str) -> dict[str, str]:
    """The model's ``base_model_tp_plan``; ValueError where it has none."""
    plan = getattr(hf_config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(
            f"architecture {architecture} has no tensor-parallel plan (base_model_tp_plan) in "
            f"transformers {_version()}, so it cannot be split over ranks: use "
            "tensor_parallel_size 1"
        )
    return dict(plan)


def check_plan(hf_config: Any, architecture: str, size: int) -> None:
    """ValueError, before any weight is read, where the plan cannot split this model over
    ``size`` ranks on pdserve's paged KV cache."""
    plan = read_plan(hf_config, architecture)
    unknown = sorted({s for s in plan.values() if s not in SUPPORTED_STYLES})
    if unknown:
        raise ValueError(
            f"architecture {architecture}: its tensor-parallel plan uses {', '.join(unknown)}, "
            f"which pdserve does not apply (it applies {', '.join(sorted(SUPPORTED_STYLES))}): "
            f"{_instead(architecture)}"
        )
    wanted = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
    found = {key.rsplit(".", 1)[-1]: style for key, style in plan.items()}
    if any(found.get(proj) != style for proj, style in wanted.items()):
        raise ValueError(
            f"architecture {architecture}: its tensor-parallel plan does not split attention "
            "by heads (q/k/v_proj colwise, o_proj rowwise), so a rank's KV cache could not "
            f"hold only its own heads: {_instead(architecture)}"
        )
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n % size:
            raise ValueError(
                f"architecture {architecture}: {what} ({n}) is not divisible by "
                f"tensor_parallel_size ({size}); its plan splits whole heads"
            )


def _instead(architecture: str) -> str:
    """What to run instead of this path's tensor parallelism."""
    if architecture in SUPPORTED_ARCHITECTURES:
        return "use model_impl 'native' (pdserve's own class splits it), or tensor_parallel_size 1"
    return "use tensor_parallel_size 1"


class _ColumnParallel(nn.Module):
    """``colwise_gather_output``: this rank's output features, gathered from every rank."""

    def __init__(self, inner: nn.Module, tp: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.inner(x))


class _RowParallel(nn.Module):
    """``rowwise``: this rank's input features (its part of the input, or cut from a
    replicated input), the partial products summed over the ranks."""

    def __init__(self, inner: nn.Module, tp: TPGroup, columns: range | None) -> None:
        super().__init__()
        self.inner = inner
        self.tp = tp
        self.columns = slice(columns.start, columns.stop) if columns is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.columns is not None:
            x = x[..., self.columns]
        return self.tp.all_reduce(self.inner(x))


class _VocabParallelEmbedding(nn.Module):
    """``embedding_rowwise``: a token outside this rank's rows looks up zeros; the sum over
    the ranks keeps the one that holds it. The inner module's own forward runs (Gemma's
    scaled embedding keeps its scale)."""

    def __init__(self, inner: nn.Module, rows: range, tp: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.tp = tp
        self.start, self.stop = rows.start, rows.stop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        inside = (input_ids >= self.start) & (input_ids < self.stop)
        x = self.inner(torch.where(inside, input_ids - self.start, 0))
        return self.tp.all_reduce(x.masked_fill(~inside[..., None], 0))


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters created inside go to the meta device (no memory, no init); buffers (rotary
    frequencies, embedding scales) are computed for real, as transformers computes them.
    ``torch.device("meta")`` alone would leave those buffers empty. The patch is process-wide
    while it lasts, which is safe because a process builds its model on one thread, before
    it serves."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=False)
            module._parameters[name] = meta

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _style_of(plan: dict[str, str], prefix: str) -> dict[str, str]:
    """Module name in the full model -> its plan style (keys are relative to the decoder;
    ``*`` stands for a layer index)."""
    return {
        re.escape(f"{prefix}.{key}").replace(r"\*", r"\d+"): style for key, style in plan.items()
    }


def _split_dim(style: str, param: str) -> int | None:
    """Which dimension of a module's ``param`` the style splits (None: replicated)."""
    if style in _COLWISE or style == _EMBEDDING:
        return 0
    if style in _ROWWISE and param == "weight":
        return 1
    return None


def load_sharded(
    hf_config: Any,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup,
    attn_implementation: str,
) -> Any:
    """This rank's transformers model: built without weights, every parameter allocated at
    its local shape, the rank's slices read from the safetensors, the plan's collectives
    wrapped around the split modules."""
    from transformers import AutoModelForCausalLM

    architecture = str((getattr(hf_config, "architectures", None) or ["?"])[0])
    check_plan(hf_config, architecture, tp.size)
    with _parameters_on_meta():
        hf: Any = AutoModelForCausalLM.from_config(
            hf_config, dtype=dtype, attn_implementation=attn_implementation
        )
    prefix = hf.base_model_prefix
    patterns = _style_of(read_plan(hf_config, architecture), prefix)
    styles: dict[str, str] = {}
    for name, _ in hf.named_modules():
        for pattern, style in patterns.items():
            if re.fullmatch(pattern, name):
                styles[name] = style
    head = next(n for n, m in hf.named_modules() if m is hf.get_output_embeddings())
    styles[head] = _EMBEDDING  # vocab-parallel logits, gathered by compute_logits
    targets = _materialize(hf, styles, tp.shard, device)
    _load(hf, targets, model_dir, tp.shard, architecture)
    _wrap(hf, styles, tp)
    return hf.to(device).eval()


class _Target:
    """Where one checkpoint tensor goes: the local parameter and the slice it reads."""

    def __init__(self, param: torch.Tensor, index: tuple[slice, ...] | None, rows: int) -> None:
        self.param = param
        self.index = index  # None: this rank holds zeros (a row-parallel bias off rank 0)
        self.rows = rows  # rows of ``param`` the read fills (the vocabulary's padding stays 0)
        self.loaded = False

    @property
    def whole(self) -> bool:
        """Whether this rank holds the whole tensor (it is not split)."""
        return self.index == (slice(None),) and self.rows == self.param.shape[0]


def _materialize(
    hf: nn.Module, styles: dict[str, str], shard: TPShard, device: torch.device
) -> dict[str, _Target]:
    """Give every parameter its local shape on ``device`` (zeros); name -> where it loads
    (tied parameters: every name, one target)."""
    targets: dict[str, _Target] = {}
    done: dict[int, _Target] = {}
    for module_name, module in list(hf.named_modules()):
        style = styles.get(module_name, "replicate")
        for pname, meta in list(module._parameters.items()):
            if meta is None:
                continue
            full = f"{module_name}.{pname}" if module_name else pname
            if id(meta) in done:
                module._parameters[pname] = done[id(meta)].param
                targets[full] = done[id(meta)]
                continue
            shape = list(meta.shape)
            index: tuple[slice, ...] | None = (slice(None),)
            rows = shape[0] if shape else 0
            dim = _split_dim(style, pname)
            if style == _EMBEDDING:
                part = shard.vocab(shape[0])
                rows = max(0, min(part.stop, shape[0]) - part.start)  # the rest: padding
                index, shape[0] = (slice(part.start, part.start + rows),), len(part)
            elif dim is not None:
                part = shard.split(shape[dim], f"{full} dimension {dim}")
                index = (slice(None),) * dim + (slice(part.start, part.stop),)
                shape[dim] = len(part)
                rows = shape[0]
            elif style in _ROWWISE and pname == "bias" and shard.rank != 0:
                index = None  # added once to the sum
            local = nn.Parameter(torch.zeros(shape, dtype=meta.dtype, device=device), False)
            module._parameters[pname] = local
            targets[full] = done[id(meta)] = _Target(local, index, rows)
    return targets


def _load(
    hf: Any, targets: dict[str, _Target], model_dir: str | Path, shard: TPShard, arch: str
) -> None:
    """Read this rank's slice of every checkpoint tensor into its parameter; tensors that
    transformers fuses at load (per-expert MoE weights) are read whole and fused, which
    their parameter must allow (it must not be split)."""
    conversion = CheckpointConversion(str(getattr(hf.config, "model_type", "")))
    with torch.no_grad():
        for original, source in iter_weight_slices(model_dir):
            name = conversion.rename(original)
            target = targets.get(name)
            if target is not None:
                part = _read(source, target.index, name) if target.index else None
                _copy(target, part, name, shard)
                continue
            fused = conversion.fused_target(name)
            if fused is None:
                continue  # e.g. rotary frequencies some checkpoints store; derived here
            param, converter, pattern, index = fused
            if param in targets and not targets[param].whole:
                raise ValueError(
                    f"{arch}: {param} is built at load from several checkpoint tensors and "
                    "split by the tensor-parallel plan, which pdserve does not do: use "
                    "tensor_parallel_size 1"
                )
            if param in targets:
                conversion.collect(param, converter, pattern, index, source[:])
        for param, tensor in conversion.build().items():
            _copy(targets[param], tensor, param, shard)
    missing = sorted(n for n, t in targets.items() if not t.loaded)
    if missing:
        raise ValueError(f"{arch}: the checkpoint is missing weights for {', '.join(missing[:8])}")


def _copy(target: _Target, tensor: torch.Tensor | None, name: str, shard: TPShard) -> None:
    """Fill a parameter with what its rank read (None: it holds zeros)."""
    if tensor is not None:
        dest = target.param.data[: target.rows]
        if tensor.shape != dest.shape:
            raise ValueError(
                f"checkpoint tensor {name!r}: read {tuple(tensor.shape)}, expected "
                f"{tuple(dest.shape)} on rank {shard.rank} of {shard.size}"
            )
        dest.copy_(tensor)
    target.loaded = True


def _wrap(hf: nn.Module, styles: dict[str, str], tp: TPGroup) -> None:
    """Put the plan's collectives around the split modules (the lm_head's gather is
    ``compute_logits``'s)."""
    head = hf.get_output_embeddings()  # type: ignore[operator]
    for name, style in styles.items():
        module = hf.get_submodule(name)
        if module is head or style in _REPLICATED or _COLWISE.get(style) is False:
            continue
        wrapper: nn.Module
        if style in _COLWISE:
            wrapper = _ColumnParallel(module, tp)
        elif style in _ROWWISE:
            cols = (
                tp.shard.split(cast(nn.Linear, module).in_features, name)
                if _ROWWISE[style]
                else None
            )
            wrapper = _RowParallel(module, tp, cols)
        else:
            rows = tp.shard.vocab(cast(nn.Embedding, module).num_embeddings)
            wrapper = _VocabParallelEmbedding(module, rows, tp)
        parent, _, child = name.rpartition(".")
        setattr(hf.get_submodule(parent), child, wrapper)
