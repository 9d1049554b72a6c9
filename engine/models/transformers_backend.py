"""Any decoder-only transformers model over pdserve's paged KV cache.

transformers' own modelling code runs the model (embeddings, norms, rotary, MLP/MoE); only
attention is pdserve's: the model is built with ``attn_implementation="pdserve"``, an
attention function registered in transformers' ``AttentionInterface`` (and a mask function
in ``AttentionMaskInterface`` that returns None, so no dense mask is ever built). The
flattened batch goes in as one row (``input_ids [1, T]``, ``position_ids [1, T]``) and
pdserve's ``AttentionMetadata`` rides down the model's ``**kwargs`` to every attention
call, which writes its K/V into the paged cache and runs pdserve's paged kernels with the
module's own scaling, sliding window, logit softcap and sinks.

It implements the same model protocol as ``models/llama.py`` (forward over a flattened
batch, ``compute_logits``), so the runner, scheduler and kvtransfer cannot tell them apart.
This module never allocates the KV cache and never samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.loader import ModelConfig
from pdserve.engine.models.llama import AttentionMetadata
from pdserve.engine.models.transformers_fused import fuse_modules
from pdserve.engine.parallel import SINGLE, TPGroup
from pdserve.kernels import ops

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pdserve.engine.kv_connector import KVConnector

ATTN_IMPLEMENTATION = "pdserve"
_CONTEXT_KWARG = "pdserve_paged"


@dataclass(frozen=True)
class PagedStep:
    """What every attention call of one forward pass needs besides q, k and v."""

    # [L, 2, N, B, Hkv, D], or each layer's [2, N, B, Hkv, D] (window layers in a pool of
    # their own, engine/window_kv.py: ``window_layers`` then names them)
    kv_cache: torch.Tensor | Sequence[torch.Tensor]
    meta: AttentionMetadata
    kv_connector: KVConnector | None
    window_layers: frozenset[int] = frozenset()


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [1, Hq, T, Dk]
    key: torch.Tensor,  # [1, Hkv, T, Dk]
    value: torch.Tensor,  # [1, Hkv, T, Dv]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # [1, T, Hq, Dv]
    """transformers' attention call, on pdserve's paged cache: write this layer's K/V at
    the step's slots, then attend over each sequence's paged context."""
    step = kwargs.get(_CONTEXT_KWARG)
    if not isinstance(step, PagedStep):
        raise RuntimeError(
            f"{type(module).__name__}: the pdserve attention runs only inside pdserve's "
            "forward (no paged-KV step was passed down)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"query: expected one flattened row, got batch {query.shape[0]}")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    value_dim = v.shape[-1]
    cache = step.kv_cache[layer]
    k_cache, v_cache = cache[0], cache[1]
    meta = step.meta
    slots, tables = meta.slot_mapping, meta.block_tables
    if layer in step.window_layers:  # the window pool's slots and table
        if not sliding_window:
            raise RuntimeError(
                f"layer {layer}: kept in the window pool, but transformers attends it "
                "without a sliding window"
            )
        assert meta.window_slot_mapping is not None and meta.window_block_tables is not None
        slots, tables = meta.window_slot_mapping, meta.window_block_tables
    slot_dim = k_cache.shape[-1]
    # Narrower heads are zero-padded to the slot: padded query/key columns add nothing to
    # the logits, padded value columns give zero outputs that are cut off below.
    if q.shape[-1] < slot_dim:
        q, k = (F.pad(x, (0, slot_dim - x.shape[-1])) for x in (q, k))
    if value_dim < slot_dim:
        v = F.pad(v, (0, slot_dim - value_dim))
    ks = vs = None
    if meta.kv_scales is not None:
        ks, vs = meta.kv_scales[layer]
    ops.write_kv(k, v, k_cache, v_cache, slots, ks, vs)
    if step.kv_connector is not None:
        # This layer's K/V are in the cache now: the connector may start sending them
        # (with a window pool, from the layer's own tensor: WindowKVConnector).
        whole = step.kv_cache if isinstance(step.kv_cache, torch.Tensor) else cache
        step.kv_connector.layer_computed(layer, whole)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    window = int(sliding_window) if sliding_window else None
    cap = float(softcap) if softcap else None
    if meta.decode_only:
        out = ops.paged_decode_attention(
            q, k_cache, v_cache, tables, meta.seq_lens, scale, window, cap, s_aux, ks, vs,
        )  # fmt: skip
    else:
        out = ops.paged_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, tables, scale,
            window, cap, s_aux, ks, vs,
        )  # fmt: skip
    return out[None, :, :, :value_dim], None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Masks are the paged kernels' business (causality, windows, sequence bounds)."""
    return None


def register_attention() -> None:
    """Register pdserve's attention and (empty) mask with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM whose attention runs on pdserve's paged KV cache."""

    def __init__(self, cfg: ModelConfig, hf_model: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.hf: Any = hf_model  # a PreTrainedModel (this rank's shard of it under TP)
        self.tp = tp
        fuse_modules(hf_model)
        hf_config = hf_model.config
        # What the checkpoint's own forward applies to the lm_head output.
        self.final_softcap = getattr(hf_config, "final_logit_softcapping", None)
        self.logits_divisor = getattr(hf_config, "logits_scaling", None)  # Granite
        self.logit_scale = getattr(hf_model, "logit_scale", None)  # Cohere
        # The layers a window pool holds (engine/window_kv.plan_window_layout's choice).
        self.window_layers = frozenset(
            i for i, spec in enumerate(cfg.kv_layers) if spec.sliding_window is not None
        )

    # Looked up on each use, not held: a second reference would make pack_linears pack the
    # lm_head twice, and it replaces modules inside the transformers model.
    @property
    def base(self) -> nn.Module:
        """The decoder without its lm_head (``model.model`` for most architectures)."""
        base: nn.Module = getattr(self.hf, self.hf.base_model_prefix)
        return base

    @property
    def lm_head(self) -> nn.Module:
        head: nn.Module = self.hf.get_output_embeddings()
        return head

    @classmethod
    def load(
        cls, cfg: ModelConfig, model_dir: str | Path, device: torch.device, tp: TPGroup = SINGLE
    ) -> TransformersForCausalLM:
        """Build the model from config.json and the safetensors (read lazily by transformers)
        on ``device`` in ``cfg.dtype``, with pdserve's attention; under tensor parallelism
        this rank's shard of it, split by the model's ``base_model_tp_plan``
        (``transformers_tp``)."""
        from transformers import AutoModelForCausalLM

        register_attention()
        if tp.size > 1:
            from pdserve.engine.models.transformers_tp import load_sharded
            from pdserve.engine.transformers_config import load_hf_config

            hf_config = load_hf_config(model_dir, cfg.architecture)
            sharded = load_sharded(hf_config, model_dir, cfg.dtype, device, tp, ATTN_IMPLEMENTATION)
            return cls(cfg, sharded, tp)
        hf_model: Any = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            local_files_only=True,
            dtype=cfg.dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
        )
        # A device_map would need accelerate; the weights load on the CPU and move once.
        return cls(cfg, hf_model.to(device).eval())

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor | Sequence[torch.Tensor],  # [L, 2, N, B, Hkv, D]
        meta: AttentionMetadata,
        kv_connector: KVConnector | None = None,
    ) -> torch.Tensor:  # [T, hidden]: final-norm hidden states
        """Run the decoder over the flattened batch; writes every token's K/V into
        ``kv_cache`` at its slot. ``kv_cache`` may also be each layer's ``[2, N, B, Hkv,
        D]``: with the step's window slots and tables, the window layers use those."""
        windowed = meta.window_block_tables is not None
        step = PagedStep(
            kv_cache, meta, kv_connector, self.window_layers if windowed else frozenset()
        )
        out = self.base(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            **{_CONTEXT_KWARG: step},
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, V]
        """Float32 logits, with the scaling and softcapping the checkpoint's own forward
        applies after its lm_head. Under tensor parallelism every rank computes its
        vocabulary rows and gets all of them (every rank must call this in the same step)."""
        logits = self.tp.all_gather_last(ops.linear_float32(hidden, self.lm_head))
        if self.logit_scale is not None:
            logits = logits * float(self.logit_scale)
        if self.logits_divisor is not None:
            logits = logits / float(self.logits_divisor)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits[..., : self.config.vocab_size]
