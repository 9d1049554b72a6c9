"""Runs the model for one scheduled step: batch tensors in, sampled tokens out.

The runner owns the weights, the tokenizer and the KV cache tensor. Each step it flattens
the scheduler's chunks into one token batch (positions, cache slots, block tables,
cu_seqlens, context lengths), runs the model, computes logits only for the rows that
sample, and samples them. It never decides what runs (the scheduler does) and never frees
blocks (the KV cache manager does).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from pdserve.engine import memory_profile
from pdserve.engine.config import EngineConfig
from pdserve.engine.expert_quant import dequantize_fp8_weights
from pdserve.engine.grammar import GrammarBackend
from pdserve.engine.kv_connector import KVConnector, moves_window_pool
from pdserve.engine.kv_scales import kv_cache_torch_dtype, resolve_kv_scales
from pdserve.engine.loader import (
    ModelConfig,
    iter_weight_slices,
    load_model_config,
    load_tokenizer,
    resolve_dtype,
)
from pdserve.engine.models import build_model
from pdserve.engine.models.llama import AttentionMetadata, LlamaForCausalLM
from pdserve.engine.models.transformers_backend import TransformersForCausalLM
from pdserve.engine.parallel import SINGLE, TPGroup, check_model
from pdserve.engine.quantization import (
    at_load_scheme,
    pack_quantized,
    quantize_linears,
    quantize_logits,
)
from pdserve.engine.sampler import SampledToken, Sampler, SamplingRow
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.staging import StepStaging
from pdserve.engine.window_kv import NULL_BLOCK, WindowLayout, plan_window_layout
from pdserve.kernels import ops
from pdserve.kernels.ops import (
    DeviceRuntime,
    RuntimeSettings,
    make_runtime,
    pack_linears,
    pack_moe_experts,
)

logger = logging.getLogger(__name__)

KVCacheAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]

# Unless num_kv_blocks is configured, a CPU pool takes at most this share of the memory
# available at start-up, and at most the cap: CPU nodes share RAM (and /dev/shm) with other
# replicas and Ray's object store.
_CPU_KV_MEMORY_FRACTION = 0.2
_CPU_KV_MEMORY_CAP = 2 << 30
_GPU_MEMORY_UTILIZATION = 0.85


def default_kv_cache_allocator(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class BatchInputs:
    """One step's flattened batch, on the model's device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [R] int64: index in T of the last token of each sampling chunk
    sample_request_ids: list[str]  # [R]
    sampling: list[SamplingRow]  # [R]


def resolve_device(requested: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank ``rank``: on CUDA, GPU ``rank`` where this
    process sees several (child processes of one replica), else its only one (a Ray actor
    sees just the GPU of its placement-group bundle)."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but CUDA is not available")
        count = torch.cuda.device_count()
        return torch.device("cuda", rank if count > rank else 0)
    return torch.device(requested)


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def check_transformers_path(cfg: ModelConfig, config: EngineConfig, tp_size: int) -> None:
    """What the transformers-backed path cannot do, refused before any weight loads: a
    tensor-parallel split its ``base_model_tp_plan`` does not give, quantized weights."""
    if cfg.impl != "transformers":
        return
    if tp_size > 1:
        from pdserve.engine.models.transformers_tp import check_plan
        from pdserve.engine.transformers_config import load_hf_config

        hf_config = load_hf_config(config.model, cfg.architecture)
        check_plan(hf_config, cfg.architecture, tp_size)
    if config.quantization is not None or cfg.quantization is not None:
        raise ValueError(
            f"architecture {cfg.architecture} runs on the transformers path, which serves "
            "float checkpoints only: leave quantization unset and use a float checkpoint"
        )
    if config.quantize_lm_head:
        raise ValueError(
            f"architecture {cfg.architecture} runs on the transformers path: "
            "quantize_lm_head is for the native models only"
        )


class ModelRunner:
    """Loads a local HF model and executes ``SchedulerOutput`` steps on it."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        kv_cache_allocator: KVCacheAllocator | None = None,
        kv_connector: KVConnector | None = None,
        runtime_settings: RuntimeSettings | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        self.config = config
        self.tp = tp
        self.device = resolve_device(config.device, tp.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Threads, pinning and allocator of the device: the engine calls its hooks.
        self.runtime: DeviceRuntime = make_runtime(self.device, runtime_settings)
        self.runtime.prepare_process()
        model_config = load_model_config(config.model, config.model_impl)
        check_transformers_path(model_config, config, tp.size)
        if config.quantization is not None and model_config.quantization is not None:
            raise ValueError(
                f"quantization={config.quantization!r}: the checkpoint is already quantized "
                f"({model_config.quantization.describe()}); leave quantization unset"
            )
        dtype = resolve_dtype(config.dtype, model_config.checkpoint_dtype, self.device)
        self.model_config: ModelConfig = replace(model_config, dtype=dtype)
        check_model(self.model_config, tp.size)
        # The KV heads this rank holds (all of them without tensor parallelism).
        self.kv_heads = tp.shard.kv_heads(self.model_config.num_kv_heads)
        limit = self.model_config.max_context
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds what the model attends "
                f"exactly ({limit}: max_position_embeddings / sliding_window)"
            )
        self.max_model_len = config.max_model_len or limit
        self.tokenizer = load_tokenizer(config.model)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int) and tok_eos not in self.model_config.eos_token_ids:
            # Checkpoints without generation_config.json still stop at the tokenizer's eos.
            eos = (*self.model_config.eos_token_ids, tok_eos)
            self.model_config = replace(self.model_config, eos_token_ids=eos)
        self.model = self._load_model()
        self.sampler = Sampler(
            self.model_config.eos_token_ids,
            seed=config.seed,
            grammar=GrammarBackend(self.tokenizer, self.model_config.eos_token_ids),
        )
        self.kv_cache_allocator = kv_cache_allocator or default_kv_cache_allocator
        self.kv_connector = kv_connector
        self.kv_cache: torch.Tensor | None = None
        self.decode_graphs: Any = None  # cuda_graphs.DecodeGraphs, captured by warm_up()
        self.staging = StepStaging(self.device)  # pinned host buffers of the step inputs
        # The pool's element type and, for int8 / float8, its [L, 2, Hkv] scales (fixed for
        # the engine's life: read from the checkpoint or calibrated now, engine/kv_scales.py).
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
        self.kv_scales: torch.Tensor | None = None
        self.window_layout: WindowLayout | None = None  # decided below, once scales are
        self.window_kv_cache: torch.Tensor | None = None
        self.kv_scales = resolve_kv_scales(self, self.kv_dtype)
        # Window layers' KV in a pool of their own (engine/window_kv.py), or None: every
        # layer in kv_cache. kv_cache then holds the full-attention layers only.
        self.window_layout = self._plan_window_layout()

    def _plan_window_layout(self) -> WindowLayout | None:
        """The window pool where the model mixes window and full layers and nothing needs
        one pool of every layer (a KV connector that moves one pool). Under tensor
        parallelism each rank's window pool holds its own KV heads, as its ``kv_cache``
        does; an int8 / float8 pool's scales stay indexed by decoder layer."""
        config = self.config
        if not config.window_kv_pool or not moves_window_pool(self.kv_connector):
            return None
        return plan_window_layout(
            self.model_config.kv_layers,
            config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )

    def _load_model(self) -> LlamaForCausalLM | TransformersForCausalLM:
        cfg = self.model_config
        if cfg.impl == "transformers":
            hf_model = TransformersForCausalLM.load(cfg, self.config.model, self.device, self.tp)
            pack_linears(hf_model)
            return hf_model.eval()
        # Build on the meta device, then materialise on the target: no double allocation.
        with torch.device("meta"):
            model = build_model(cfg, self.max_model_len, self.tp).to(cfg.dtype)
        model = model.to_empty(device=self.device)
        if cfg.tie_word_embeddings:  # to_empty() unties shared parameters
            model.lm_head.weight = model.model.embed_tokens.weight
        weights = iter_weight_slices(self.config.model)
        if cfg.dequantized_fp8_block is not None:
            weights = dequantize_fp8_weights(weights, cfg.dequantized_fp8_block)
        with torch.no_grad():
            model.load_weights(weights)
            # Quantized linears: the checkpoint's packed for their kernels, or a float
            # checkpoint's quantized now (EngineConfig.quantization).
            pack_quantized(model, cfg.dtype)
            if self.config.quantization is not None:
                quantize_linears(model, at_load_scheme(self.config.quantization), cfg.dtype)
            if self.config.quantize_lm_head:
                quantize_logits(model)
        # CPU: oneDNN-packed bf16 weights (native bf16), or bf16-held weights of a bf16
        # checkpoint served in float32 (AVX2); elsewhere the nn.Linear layers stay.
        pack_linears(model)
        # The stacked MoE experts on CPU: int8 under at-load int8 quantization, else packed
        # as the linears are (bf16).
        pack_moe_experts(model, self.config.quantization)
        return model.eval()

    # ---- KV cache -------------------------------------------------------------------------

    @property
    def num_pool_layers(self) -> int:
        """Layers whose KV is in ``kv_cache``: all, less those of a window pool."""
        window = self.window_layout
        return self.model_config.num_layers - (len(window.layers) if window else 0)

    @property
    def block_bytes(self) -> int:
        """Bytes one KV block takes on this rank across the pool's layers (every plane)."""
        return self.num_pool_layers * self._layer_block_bytes()

    def _layer_block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        heads = len(self.kv_heads)
        c = self.model_config
        return c.kv_planes * self.config.block_size * heads * c.head_dim * elem

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """This rank's pool: ``[L, P, N, B, Hkv_rank, D]`` (L: ``num_pool_layers``; P the
        model's ``kv_planes``, 2: keys and values, 1: an MLA latent that is both)."""
        return self._pool_shape(self.num_pool_layers, num_blocks)

    def pool_kv_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``kv_scales`` split by pool: the rows of ``kv_cache``'s layers and of the window
        pool's (None without a window pool), what each pool is registered with."""
        window, scales = self.window_layout, self.kv_scales
        if window is None or scales is None:
            return scales, None
        full = window.full_layers(self.model_config.num_layers)
        return scales[list(full)].contiguous(), scales[list(window.layers)].contiguous()

    def window_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The window pool: ``[L_window, P, N_window, B, Hkv_rank, D]``."""
        assert self.window_layout is not None
        return self._pool_shape(len(self.window_layout.layers), num_blocks)

    def _pool_shape(self, num_layers: int, num_blocks: int) -> tuple[int, ...]:
        heads = len(self.kv_heads)
        block = self.config.block_size
        c = self.model_config
        return (num_layers, c.kv_planes, num_blocks, block, heads, c.head_dim)

    def layer_kv_caches(self) -> torch.Tensor | list[torch.Tensor]:
        """What the model indexes by layer: ``kv_cache`` itself, or with a window pool
        each layer's ``[2, N, B, Hkv, D]`` slice of the pool that holds it."""
        window = self.window_layout
        if window is None:
            assert self.kv_cache is not None
            return self.kv_cache
        assert self.kv_cache is not None and self.window_kv_cache is not None
        full = iter(self.kv_cache)
        windowed = iter(self.window_kv_cache)
        members = set(window.layers)
        return [
            next(windowed) if i in members else next(full)
            for i in range(self.model_config.num_layers)
        ]

    def profile_num_blocks(self) -> int:
        """How many KV blocks to allocate when ``num_kv_blocks`` is not configured.

        Never more than the running batch can use (max_num_seqs full-length requests);
        limited by a share of free host memory on CPU, or on CUDA by free GPU memory after
        the weights and the activations of the largest step, measured by a profiling
        forward pass at the configured batch (``memory_profile``).
        """
        per_seq = math.ceil(self.max_model_len / self.config.block_size)
        useful = per_seq * self.config.max_num_seqs
        if self.device.type == "cuda":
            act = memory_profile.cuda_step_peak_bytes(self)
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - _GPU_MEMORY_UTILIZATION) * total - act
            logger.info("KV pool: step peak %.1f MiB, %.1f MiB free", act / 2**20, free / 2**20)
        else:
            budget = min(_available_memory_bytes() * _CPU_KV_MEMORY_FRACTION, _CPU_KV_MEMORY_CAP)
            budget /= self.tp.size  # the ranks of a CPU replica share the host's memory
        budget -= self.window_pool_bytes  # the window pool first: its size is fixed
        affordable = int(budget // self.block_bytes)
        if affordable < per_seq:
            raise ValueError(
                f"KV cache: memory for {affordable} blocks cannot hold one request of "
                f"max_model_len={self.max_model_len}; lower max_model_len or set num_kv_blocks"
            )
        return min(useful, affordable)

    @property
    def window_pool_bytes(self) -> int:
        """Bytes of the window pool (0 without one)."""
        window = self.window_layout
        if window is None:
            return 0
        return len(window.layers) * window.num_blocks * self._layer_block_bytes()

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Allocate the pool (layout ``kv_cache_shape``) through the allocator, and
        the window pool where there is one."""
        self.kv_cache = self._allocate(self.kv_cache_shape(num_blocks))
        if self.window_layout is not None:
            shape = self.window_cache_shape(self.window_layout.num_blocks)
            self.window_kv_cache = self._allocate(shape)
            # Out-of-window table entries point at the null block: finite, whatever the
            # allocator returned (the kernels mask it, and 0 * NaN would not be 0).
            self.window_kv_cache[:, :, NULL_BLOCK].zero_()
        return self.kv_cache

    def _allocate(self, shape: tuple[int, ...]) -> torch.Tensor:
        cache = self.kv_cache_allocator(shape, self.kv_dtype, self.device)
        if tuple(cache.shape) != shape or not cache.is_contiguous():
            raise ValueError(f"kv_cache_allocator returned {tuple(cache.shape)}, expected {shape}")
        return cache

    def warm_up(self) -> int:
        """On a GPU, before the replica reports ready: compile every kernel variant a
        step may need (each decode-attention split bucket, a full prefill step, a full
        decode batch) so nothing is JIT-compiled while serving. Returns the calls made
        (0 on a CPU, where nothing is compiled)."""
        if self.device.type != "cuda":
            return 0
        c = self.model_config
        heads = c.num_heads // self.tp.size
        block = self.config.block_size
        if c.mla is not None:  # decode goes to the MLA kernel (the models' own choice)
            rank = c.mla.kv_lora_rank
            calls = ops.warm_up_mla_decode(heads, rank, c.head_dim, block, c.dtype, self.device)
        else:
            kv_heads = len(self.kv_heads)
            calls = ops.warm_up_attention(heads, kv_heads, c.head_dim, block, c.dtype, self.device)
        memory_profile.run_profile_step(self)  # prefill / mixed path
        memory_profile.run_profile_step(self, self.config.max_num_seqs)  # a decode batch
        memory_profile.run_profile_step(self, 1)  # a single decode
        torch.cuda.synchronize(self.device)
        captured = 0
        # Tensor parallel steps run eagerly: capturing c10d's NCCL collectives in a graph
        # is not supported the way vLLM's own communicator is.
        if self.config.cuda_graphs and self.tp.size == 1:
            from pdserve.engine.cuda_graphs import capture_decode_graphs

            self.decode_graphs = capture_decode_graphs(self)
            if self.decode_graphs is not None:
                captured = len(self.decode_graphs.graphs)
        return calls + 3 + captured

    # ---- one step -------------------------------------------------------------------------

    def prepare_inputs(self, out: SchedulerOutput) -> BatchInputs:
        """Flatten the chunks into batch tensors (built as Python lists, copied once)."""
        block_size = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        windowed = self.window_layout is not None
        window_slots: list[int] = []
        window_tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        sampling: list[SamplingRow] = []
        for chunk in out.chunks:
            n = len(chunk.token_ids)
            start = chunk.start_position
            end = start + n
            if n == 0 or len(chunk.block_ids) * block_size < end:
                raise ValueError(
                    f"request {chunk.request_id}: {n} tokens at {start} do not fit its "
                    f"{len(chunk.block_ids)} blocks"
                )
            if end > self.max_model_len:
                raise ValueError(f"request {chunk.request_id}: {end} tokens > max_model_len")
            input_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            table = chunk.block_ids
            _append_slots(slots, table, start, end, block_size)
            if windowed:
                # A profiling step's chunks have none: their throwaway pools are alike.
                window_table = chunk.window_block_ids or table
                if len(window_table) != len(table):
                    raise ValueError(
                        f"request {chunk.request_id}: window table of {len(window_table)} "
                        f"blocks next to {len(table)}"
                    )
                _append_slots(window_slots, window_table, start, end, block_size)
                window_tables.append(window_table)
            cu.append(cu[-1] + n)
            seq_lens.append(end)
            tables.append(table)
            if chunk.sample:
                sample_rows.append(cu[-1] - 1)
                sample_ids.append(chunk.request_id)
                prompt_ids, output_ids = chunk.history or ((), ())
                sampling.append(
                    SamplingRow(
                        chunk.sampling_params,
                        chunk.num_output_tokens,
                        prompt_ids,
                        output_ids,
                        request_id=chunk.request_id,
                    )
                )
        width = max(len(t) for t in tables)
        # Padding entries are never read (seq_lens bounds every sequence); 0 is a valid id.
        padded = [t + [0] * (width - len(t)) for t in tables]
        padded += [t + [0] * (width - len(t)) for t in window_tables]
        if self.device.type == "cuda":
            # Pinned staging: one asynchronous host-to-device copy per dtype.
            ids_t, pos_t, slots_t, rows_t, wslots_t = self.staging.to_device(
                [input_ids, positions, slots, sample_rows, window_slots], torch.int64
            )
            cu_t, lens_t, all_tables_t = self.staging.to_device(
                [cu, seq_lens, [b for t in padded for b in t]], torch.int32
            )
            all_tables_t = all_tables_t.view(len(padded), width)
        else:
            i64 = (input_ids, positions, slots, sample_rows, window_slots)
            ids_t, pos_t, slots_t, rows_t, wslots_t = (
                torch.tensor(v, dtype=torch.int64) for v in i64
            )
            cu_t, lens_t, all_tables_t = (
                torch.tensor(v, dtype=torch.int32) for v in (cu, seq_lens, padded)
            )
        num_seqs = len(tables)
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            cu_seqlens_q=cu_t,
            seq_lens=lens_t,
            block_tables=all_tables_t[:num_seqs],
            decode_only=len(input_ids) == len(out.chunks),
            kv_scales=self.kv_scales,
            window_slot_mapping=wslots_t if windowed else None,
            window_block_tables=all_tables_t[num_seqs:] if windowed else None,
        )
        return BatchInputs(
            input_ids=ids_t,
            positions=pos_t,
            meta=meta,
            sample_rows=rows_t,
            sample_request_ids=sample_ids,
            sampling=sampling,
        )

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput) -> tuple[BatchInputs, torch.Tensor]:
        """Run the forward pass; returns the batch and float32 logits ``[R, V]`` of the
        sampling rows (in ``batch.sample_request_ids`` order). Writes the KV cache."""
        if self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must be called before executing steps")
        batch = self.prepare_inputs(out)
        connector = self.kv_connector
        if connector is not None:
            connector.begin_step(list(out.kv_sends))
        graphs = self.decode_graphs
        if (
            graphs is not None
            and connector is None
            and batch.meta.decode_only
            and graphs.fits(len(out.chunks), batch.meta.block_tables.shape[1])
        ):
            logits = graphs.run(batch.input_ids, batch.positions, batch.meta)
            return batch, logits.index_select(0, batch.sample_rows)
        caches = self.layer_kv_caches()
        hidden = self.model(batch.input_ids, batch.positions, caches, batch.meta, connector)
        logits = self.model.compute_logits(hidden[batch.sample_rows]).float()
        return batch, logits

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one step; returns the sampled token of every chunk with ``sample=True``.

        With a KV connector, ``begin_step(out.kv_sends)`` is called before the forward pass
        and ``layer_computed`` after each layer; the engine calls ``end_step``.
        """
        self.sampler.forget(out.finished_request_ids)
        if not out.chunks:
            return {}
        self.runtime.before_step(out.num_batched_tokens)
        batch, logits = self.compute_logits(out)
        tokens = self.sampler(logits, batch.sampling)
        return dict(zip(batch.sample_request_ids, tokens, strict=True))


def _append_slots(
    slots: list[int], table: list[int], start: int, end: int, block_size: int
) -> None:
    """The cache slots of positions ``[start, end)`` under ``table``: one range per block
    touched (not one expression per token), so a prefill chunk of thousands of tokens
    costs a few block-sized extends."""
    pos = start
    while pos < end:
        base = table[pos // block_size] * block_size
        stop = min(end, (pos // block_size + 1) * block_size)
        slots.extend(range(base + pos % block_size, base + (stop - 1) % block_size + 1))
        pos = stop
