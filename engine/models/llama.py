"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, gpt-oss) in one
file, over a paged KV cache.

The model works on a *flattened* batch: the new tokens of every scheduled request are
concatenated into one ``[T]`` vector (prefill chunks and decode tokens mixed), and
``AttentionMetadata`` says where each request's tokens sit, which cache slots they write
and which blocks hold their context. Attention, KV writes, RMSNorm and RoPE go through
``pdserve.kernels.ops`` (Triton on CUDA, torch on CPU). The variants differ only in config:
GQA/MQA head counts, qkv bias (Qwen2), q/k RMSNorm per head (Qwen3), tied embeddings, RoPE
scaling (llama3, linear, yarn), mixture-of-experts MLPs (``models/moe.py``: Mixtral,
Qwen3-MoE, gpt-oss), and gpt-oss's attention: biases on q/k/v/o, a learned sink logit per
head, and a sliding window on the layers ``ModelConfig.kv_layers`` gives one.

Parameter names follow the Hugging Face checkpoints except that q/k/v and gate/up are fused
into one matmul each; ``load_weights`` maps the checkpoint names. This module never
allocates the KV cache and never samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pdserve.engine.loader import ModelConfig
from pdserve.engine.models.moe import SparseMoeBlock
from pdserve.engine.parallel import SINGLE, TPGroup
from pdserve.engine.quantization import QUANT_KINDS, make_linear, read_quant_tensor
from pdserve.kernels import ops

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pdserve.engine.kv_connector import KVConnector


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the flattened tokens of one step live (all tensors on the model's device)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    cu_seqlens_q: torch.Tensor  # [S+1] int32: token offsets of each sequence in the batch
    seq_lens: torch.Tensor  # [S] int32: context length of each sequence incl. new tokens
    block_tables: torch.Tensor  # [S, M] int32: block ids of each sequence (padded)
    decode_only: bool  # every sequence has exactly one new token: use the decode kernel
    # [L, 2, Hkv] float32: per-layer K and V scales of an int8 / float8 pool; None: float
    kv_scales: torch.Tensor | None = None
    # Where the window layers' KV has a pool of its own (engine/window_kv.py): their slots
    # [T] int64 and block tables [S, M] int32 in it (out-of-window entries: the null block).
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None


# The residual stream's dtype in every model dtype: each layer's bf16 output is added to it
# without rounding the running sum (kernels.ops.rms_norm fuses the add).
RESIDUAL_DTYPE = torch.float32


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, self.weight, self.eps, residual, out_dtype)


class Attention(nn.Module):
    """This rank's heads: column-parallel QKV, row-parallel O (then an all-reduce)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = len(tp.shard.split(cfg.num_heads, "num_attention_heads"))
        self.num_kv_heads = len(tp.shard.kv_heads(cfg.num_kv_heads))
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # Attends the last this many positions (a per-layer window, kv_layers); None: all.
        self.sliding_window = cfg.kv_layers[layer_idx].sliding_window if cfg.kv_layers else None
        self.softcap: float | None = None  # tanh cap of the attention logits; None: none
        prefix, quant = f"model.layers.{layer_idx}.self_attn", cfg.quantization
        self.qkv_proj = make_linear(
            cfg.hidden_size,
            self.q_size + 2 * self.kv_size,
            cfg.qkv_bias,
            quant,
            (f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"),
        )
        self.o_proj = make_linear(
            self.q_size, cfg.hidden_size, cfg.o_bias, quant, (f"{prefix}.o_proj",)
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # This rank's heads' sink logits (gpt-oss).
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,  # [2, N, B, Hkv, D]: this layer's slice of the pool
        cos_sin: torch.Tensor,  # [P, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = _norm_heads(self.q_norm, q)
            k = _norm_heads(self.k_norm, k)
        q, k = ops.apply_rotary(positions, q, k, cos_sin)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        ks = vs = None
        if meta.kv_scales is not None:
            ks, vs = meta.kv_scales[self.layer_idx]
        slots, tables = meta.slot_mapping, meta.block_tables
        if self.sliding_window is not None and meta.window_block_tables is not None:
            assert meta.window_slot_mapping is not None
            slots, tables = meta.window_slot_mapping, meta.window_block_tables
        ops.write_kv(k, v, k_cache, v_cache, slots, ks, vs)
        if meta.decode_only:
            out = ops.paged_decode_attention(
                q, k_cache, v_cache, tables, meta.seq_lens, self.scale,
                sliding_window=self.sliding_window, softcap=self.softcap, sinks=self.sinks,
                k_scale=ks, v_scale=vs,
            )  # fmt: skip
        else:
            out = ops.paged_attention(
                q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, tables,
                self.scale, sliding_window=self.sliding_window, softcap=self.softcap,
                sinks=self.sinks, k_scale=ks, v_scale=vs,
            )  # fmt: skip
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.q_size)))


def _norm_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> same
    out = norm(x.reshape(-1, x.shape[-1]))
    assert isinstance(out, torch.Tensor)
    return out.view(x.shape)


class MLP(nn.Module):
    """This rank's intermediate columns: column-parallel gate/up, row-parallel down."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        inter = len(tp.shard.split(cfg.intermediate_size, "intermediate_size"))
        prefix, quant = f"model.layers.{layer_idx}.mlp", cfg.quantization
        self.gate_up_proj = make_linear(
            cfg.hidden_size,
            2 * inter,
            cfg.mlp_bias,
            quant,
            (f"{prefix}.gate_proj", f"{prefix}.up_proj"),
        )
        self.down_proj = make_linear(
            inter, cfg.hidden_size, cfg.mlp_bias, quant, (f"{prefix}.down_proj",)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(ops.silu_and_mul(self.gate_up_proj(x))))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token outside them contributes zeros, and the
    all-reduce sums the one rank that holds it."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        rows = tp.shard.vocab(vocab_size)
        self.start, self.stop = rows.start, rows.stop
        self.weight = nn.Parameter(torch.empty(len(rows), hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        local = (input_ids - self.start).masked_fill(outside, 0)
        x = nn.functional.embedding(local, self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock
        if cfg.moe is not None and layer_idx in cfg.moe.sparse_layers:
            self.mlp = SparseMoeBlock(cfg, tp)
        else:
            self.mlp = MLP(cfg, layer_idx, tp)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm_into_stream(self.input_layernorm, x, residual)
        x = self.self_attn(positions, x, kv_cache, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def norm_into_stream(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; the first layer's ``x`` starts the stream.

    The residual stream is carried separately, in float32, so each norm fuses the residual
    add and the stream is never rounded to the model dtype."""
    if residual is None:
        out = norm(x)
        assert isinstance(out, torch.Tensor)
        return out, x.to(RESIDUAL_DTYPE)
    summed = norm(x, residual)
    assert isinstance(summed, tuple)
    return summed


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; a family with its own layer and norm classes
    (Gemma) passes them."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        layer: Callable[[ModelConfig, int, TPGroup], nn.Module] = DecoderLayer,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(layer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral / gpt-oss decoder over a paged KV
    cache."""

    def __init__(self, cfg: ModelConfig, max_position: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = self.build_decoder(cfg, tp)
        # Vocab-parallel: this rank's rows of the (padded) vocabulary.
        self.lm_head = nn.Linear(cfg.hidden_size, len(tp.shard.vocab(cfg.vocab_size)), bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_position = max_position
        # Built lazily on the model's device; float32 for accuracy in every model dtype.
        self._cos_sin: torch.Tensor | None = None

    def build_decoder(self, cfg: ModelConfig, tp: TPGroup) -> LlamaModel:
        """The embedding, decoder layers and final norm (a family's own layers override)."""
        return LlamaModel(cfg, tp)

    def cos_sin_cache(self) -> torch.Tensor:
        device = self.model.embed_tokens.weight.device
        if self._cos_sin is None or self._cos_sin.device != device:
            cfg = self.config
            self._cos_sin = ops.build_rope_cache(
                cfg.head_dim,
                self.max_position,
                cfg.rope_theta,
                cfg.rope_scaling,
                torch.float32,
                device,
            )
        return self._cos_sin

    def layer_rope_tables(self) -> list[torch.Tensor]:
        """Each layer's cos/sin table (one shared table here)."""
        return [self.cos_sin_cache()] * len(self.model.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor | Sequence[torch.Tensor],  # [L, 2, N, B, Hkv, D]
        meta: AttentionMetadata,
        kv_connector: KVConnector | None = None,
    ) -> torch.Tensor:  # [T, hidden] float32: final-norm hidden states
        """Run the decoder; writes every token's K/V into ``kv_cache`` at its slot. The
        final norm's output stays float32: it only feeds the logits. ``kv_cache`` may also
        be each layer's ``[2, N, B, Hkv, D]`` (window layers in a pool of their own)."""
        rope = self.layer_rope_tables()
        x = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(positions, x, residual, kv_cache[i], rope[i], meta)
            if kv_connector is not None:
                # Layer i's K/V are in the cache now: the connector may start sending them
                # (with a window pool, from the layer's own tensor: WindowKVConnector).
                layer_kv = kv_cache if isinstance(kv_cache, torch.Tensor) else kv_cache[i]
                kv_connector.layer_computed(i, layer_kv)
        x, _ = self.model.norm(x, residual, out_dtype=torch.float32)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, V]
        """Float32 logits from the float32 hidden states (float32 sums, never rounded to the
        model dtype). Every rank gets the full logits (an all-gather of the vocabulary
        shards; rank 0 samples); every rank must call this in the same step."""
        logits = ops.linear_float32(hidden, self.lm_head)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[..., : self.config.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (HF names) into this rank's fused parameters; strict about
        names and shapes.

        ``weights`` yields (name, tensor) or (name, lazy safetensors slice): only this
        rank's rows/columns are read from a slice, so a rank never materialises the others'
        shards (``pdserve.engine.loader.iter_weight_slices``)."""
        cfg, shard = self.config, self.tp.shard
        d = cfg.head_dim
        heads = shard.split(cfg.num_heads, "num_attention_heads")
        kv_heads = shard.kv_heads(cfg.num_kv_heads)
        inter = shard.split(cfg.intermediate_size, "intermediate_size")
        vocab = shard.vocab(cfg.vocab_size)
        q, kv, n_inter = len(heads) * d, len(kv_heads) * d, len(inter)
        q_rows = slice(heads.start * d, heads.stop * d)
        kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
        inter_rows = slice(inter.start, inter.stop)
        vocab_rows = slice(min(vocab.start, cfg.vocab_size), min(vocab.stop, cfg.vocab_size))
        n_vocab = vocab_rows.stop - vocab_rows.start
        # checkpoint suffix -> (parameter suffix, destination rows, source rows, source cols)
        every = slice(None)
        plan = {
            "q_proj": ("qkv_proj", slice(0, q), q_rows, every),
            "k_proj": ("qkv_proj", slice(q, q + kv), kv_rows, every),
            "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv), kv_rows, every),
            "o_proj": ("o_proj", every, every, q_rows),
            "gate_proj": ("gate_up_proj", slice(0, n_inter), inter_rows, every),
            "up_proj": ("gate_up_proj", slice(n_inter, 2 * n_inter), inter_rows, every),
            "down_proj": ("down_proj", every, every, inter_rows),
            "embed_tokens": ("embed_tokens", slice(0, n_vocab), vocab_rows, every),
            "lm_head": ("lm_head", slice(0, n_vocab), vocab_rows, every),
        }
        params = dict(self.named_parameters())
        if cfg.tie_word_embeddings:
            params.pop("lm_head.weight", None)  # shares embed_tokens.weight
        expected: dict[str, int] = {}  # parameter -> rows still to fill (to detect gaps)
        for name, p in params.items():
            # Stacked experts count loads, not rows: w13 takes a gate and an up per expert.
            expected[name] = 2 * p.shape[0] if name.endswith(".w13") else p.shape[0]
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                pad = len(vocab) - n_vocab  # padding rows: zeros, never a token
                p.data[p.shape[0] - pad :].zero_()
                expected[name] -= pad
        for name, source in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # derived from the config, some old checkpoints store it
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for it
            name = name.replace(".mlp.router.", ".mlp.gate.")  # gpt-oss's name for it
            if ".mlp.experts." in name:
                param, filled = self._load_expert(name, source)
                expected[param] -= filled
                continue
            prefix, module, kind = (["", *name.rsplit(".", 2)])[-3:]
            if module == "self_attn" and kind in ("k_scale", "v_scale"):
                continue  # the KV cache's scales: engine/kv_scales.py reads them
            target, rows = name, every
            index: tuple[slice, ...] | None = (every,)  # None: the rank takes zeros
            src_rows = src_cols = every
            # Quantized checkpoints: the packed weight fills `weight`, both scale spellings
            # fill `weight_scale` (see engine/quantization.py).
            param_kind = {"weight_packed": "weight", "weight_scale_inv": "weight_scale"}.get(
                kind, kind
            )
            if module in plan:
                fused, rows, src_rows, src_cols = plan[module]
                target = f"{prefix}.{fused}.{param_kind}" if prefix else f"{fused}.{param_kind}"
            if kind in QUANT_KINDS:
                if cfg.quantization is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} is quantized but config.json has no "
                        "quantization_config"
                    )
                if target not in params:
                    if kind in ("weight_shape", "input_scale"):
                        continue  # the shape is the module's; activations are dynamic
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                dest = params[target].data[rows]
                weight = params.get(target.rpartition(".")[0] + ".weight")
                tensor = read_quant_tensor(
                    kind, source, src_rows, src_cols, dest, cfg.quantization, name,
                    in_features=None if weight is None else weight.shape[1],
                )  # fmt: skip
                if tensor is None:
                    continue
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r}: read as {tuple(tensor.shape)}, expected "
                        f"{tuple(dest.shape)} on rank {shard.rank} of {shard.size}"
                    )
                dest.copy_(tensor)
                expected[target] -= dest.shape[0]
                continue
            if module == "self_attn" and kind == "sinks":
                index = (slice(heads.start, heads.stop),)  # this rank's heads
            if module in plan:
                if kind == "bias" and src_cols is not every:
                    # Row-parallel bias: added once (rank 0) to the all-reduced sum.
                    index = (every,) if shard.rank == 0 else None
                else:
                    index = (src_rows,) if src_cols is every else (src_rows, src_cols)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
            dest = params[target].data[rows]
            if index is None:
                dest.zero_()
            else:
                tensor = _read(source, index, name)
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r}: shape {_shape(source)}, expected "
                        f"{tuple(dest.shape)} on rank {shard.rank} of {shard.size}"
                    )
                dest.copy_(tensor)
            expected[target] -= dest.shape[0]
        for block in self.modules():
            if isinstance(block, SparseMoeBlock):
                block.check_loaded()
        missing = sorted(n for n, left in expected.items() if left > 0)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")

    def _load_expert(self, name: str, source: Any) -> tuple[str, int]:
        """``model.layers.<i>.mlp.experts.<j>.<projection>.weight`` (one expert; an fp8 one
        also ``.weight_scale_inv``) or
        ``model.layers.<i>.mlp.experts.<tensor>`` (all experts stacked, gpt-oss) into layer
        i's stacked experts; returns the parameter filled and how many loads that counts."""
        block, _, rest = name.partition(".experts.")
        parts = rest.split(".")
        try:
            module = self.get_submodule(block)
        except AttributeError:
            module = None
        per_expert = len(parts) == 3 and parts[2] in ("weight", "weight_scale_inv")
        if not isinstance(module, SparseMoeBlock) or not (per_expert or len(parts) == 1):
            raise ValueError(
                f"checkpoint tensor {name!r} has no place in {self.config.architecture}"
            )
        if per_expert:
            param, filled = module.load_expert(int(parts[0]), parts[1], source, name, parts[2])
            return f"{block}.{param}", filled
        param, filled = module.load_stacked(parts[0], source, name)
        return f"{block}.{param}", filled


def _shape(source: Any) -> tuple[int, ...]:
    return tuple(source.get_shape() if hasattr(source, "get_shape") else source.shape)


def _read(source: Any, index: tuple[slice, ...], name: str) -> torch.Tensor:
    """``source[index]`` from a tensor or a lazy safetensors slice (reads only those bytes)."""
    shape = _shape(source)
    if len(index) > len(shape):
        raise ValueError(f"checkpoint tensor {name!r}: shape {shape} has too few dimensions")
    for dim, sl in enumerate(index):
        if sl.stop is not None and sl.stop > shape[dim]:
            raise ValueError(
                f"checkpoint tensor {name!r}: shape {shape}, too small for rows/columns "
                f"[{sl.start}, {sl.stop}) of dimension {dim}"
            )
    return source[index]
