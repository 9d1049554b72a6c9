"""CUDA graphs for decode steps over batch-size buckets (as vLLM and nano-vllm do).

A decode step launches a few hundred small kernels; replaying them from a captured graph
removes the CPU launch cost that dominates small batches. One graph per bucket (1, 2, 4, 8,
16, then steps of 16 up to ``max_num_seqs``), captured largest first into one memory pool,
all reading persistent input buffers that each step updates in place: a batch of ``n``
sequences runs the smallest bucket ``>= n``, its padding rows write nowhere (slot -1) and
attend to one token of block 0 (the null block of a window pool, whose slots and tables
have buffers of their own: engine/window_kv.py). The block table has the width of the
longest request, so the decode kernel's split count is fixed per graph. Prefill and mixed
steps run eagerly, as do steps with a KV connector (its per-layer callbacks are host code).

Both model paths are captured. transformers' modelling code skips its host-side checks
while a CUDA stream captures (``is_tracing``); a model whose code still reads a tensor on
the host (a per-expert loop over the experts a batch hit, say) cannot be captured, and on
the transformers path its decode steps then run eagerly, with a warning at start-up.

The runner owns one ``DecodeGraphs``; this module never decides whether graphs are used
(``EngineConfig.cuda_graphs``) and never runs on a CPU.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from pdserve.engine.models.llama import AttentionMetadata

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... (multiples of 16), ending at ``max_num_seqs``."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``n`` sequences (None: larger than every bucket)."""
    return next((b for b in buckets if b >= n), None)


class DecodeGraphs:
    """Captured decode steps, one per batch bucket, over persistent input buffers."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        cfg = runner.config
        dev = runner.device
        self.buckets = batch_buckets(cfg.max_num_seqs)
        top = self.buckets[-1]
        self.width = math.ceil(runner.max_model_len / cfg.block_size)
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self.slots = torch.full((top,), -1, dtype=torch.int64, device=dev)
        # The window layers' slots and tables, where they have a pool of their own.
        self.window_slots: torch.Tensor | None = None
        self.window_tables: torch.Tensor | None = None
        if runner.window_layout is not None:
            self.window_slots = torch.full((top,), -1, dtype=torch.int64, device=dev)
            self.window_tables = torch.zeros(top, self.width, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(top, self.width, dtype=torch.int32, device=dev)
        self.cu = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output buffer [b, V] fp32

    def _forward(self, b: int) -> torch.Tensor:
        runner = self.runner
        meta = AttentionMetadata(
            slot_mapping=self.slots[:b],
            cu_seqlens_q=self.cu[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.tables[:b],
            decode_only=True,
            kv_scales=runner.kv_scales,
            window_slot_mapping=None if self.window_slots is None else self.window_slots[:b],
            window_block_tables=None if self.window_tables is None else self.window_tables[:b],
        )
        caches = runner.layer_kv_caches()
        hidden = runner.model(self.input_ids[:b], self.positions[:b], caches, meta)
        return runner.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every bucket (largest first, one shared pool); returns how many. The
        buffers hold padding meanwhile: nothing is written to the KV pool."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.runner.device)
        for b in sorted(self.buckets, reverse=True):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile and allocate outside the capture
                self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.runner.device)
        return len(self.graphs)

    def fits(self, num_seqs: int, table_width: int) -> bool:
        return bucket_for(num_seqs, self.buckets) is not None and table_width <= self.width

    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        meta: AttentionMetadata,  # a decode-only batch of n sequences
    ) -> torch.Tensor:  # [n, V] fp32: valid until the next replay
        n = input_ids.shape[0]
        b = bucket_for(n, self.buckets)
        assert b is not None and b in self.graphs
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if self.window_slots is not None and self.window_tables is not None:
            assert meta.window_slot_mapping is not None and meta.window_block_tables is not None
            self.window_slots[:n].copy_(meta.window_slot_mapping, non_blocking=True)
            self.window_tables[:n, :width].copy_(meta.window_block_tables, non_blocking=True)
            if b > n:  # block 0 of the window pool: its null block
                self.window_slots[n:b].fill_(-1)
                self.window_tables[n:b, 0].fill_(0)
        if b > n:  # padding rows: write nowhere, attend to one token of block 0
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.tables[n:b, 0].fill_(0)
        self.graphs[b].replay()
        return self.logits[b][:n]


def capture_decode_graphs(runner: ModelRunner) -> DecodeGraphs | None:
    """Every bucket's graph for ``runner``'s model, or None where transformers' modelling
    code of the model cannot be captured (decode steps then run eagerly). A native model
    that cannot be captured is a bug: its error propagates."""
    graphs = DecodeGraphs(runner)
    try:
        graphs.capture()
    except RuntimeError as exc:
        if runner.model_config.impl == "native":
            raise
        logger.warning(
            "decode CUDA graphs off: the transformers code of %s cannot be captured (%s); "
            "decode steps run eagerly",
            runner.model_config.architecture,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return None
    return graphs
