"""How much memory one step takes at the configured batch: a profiling forward pass.

A GPU's KV pool gets what is left after the weights and the largest step's activations
(``max_num_batched_tokens`` tokens spread over ``max_num_seqs`` requests, each sampling,
so the logits of a full batch count too). The step runs on dummy tokens against a throwaway
KV pool just large enough for it; the peak the allocator saw is the activation bill. A
formula would miss the kernels' workspaces, the attention scratch and the sampler's
temporaries, which is why vLLM and SGLang profile too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner


def profile_batch(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> tuple[SchedulerOutput, int]:
    """The largest step the scheduler may hand the runner, and the KV blocks it touches.

    Tokens are split as evenly as the budget allows over ``min(max_num_seqs, tokens)``
    requests (none longer than ``max_model_len``); every request samples."""
    seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    per = min(max_model_len, max(1, max_num_batched_tokens // seqs))
    chunks = []
    next_block = 0
    for i in range(seqs):
        n = per + (1 if i < max_num_batched_tokens - per * seqs and per < max_model_len else 0)
        blocks = math.ceil(n / block_size)
        chunks.append(
            ScheduledChunk(
                request_id=f"profile-{i}",
                token_ids=[0] * n,
                start_position=0,
                block_ids=list(range(next_block, next_block + blocks)),
                sample=True,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
                num_output_tokens=0,
            )
        )
        next_block += blocks
    return SchedulerOutput(chunks, sum(c.num_tokens for c in chunks)), next_block


@torch.inference_mode()
def run_profile_step(runner: ModelRunner, num_tokens: int | None = None) -> int:
    """Run the largest step (or one of ``num_tokens`` tokens over up to max_num_seqs
    requests: ``max_num_seqs`` tokens is a full decode batch) once on a throwaway pool
    (restored afterwards); returns its blocks. The caller measures memory around it."""
    cfg = runner.config
    step, num_blocks = profile_batch(
        num_tokens or cfg.max_num_batched_tokens,
        cfg.max_num_seqs,
        runner.max_model_len,
        cfg.block_size,
    )
    saved, connector, graphs = runner.kv_cache, runner.kv_connector, runner.decode_graphs
    saved_window = runner.window_kv_cache
    runner.kv_connector = None  # the profile step sends nothing
    runner.decode_graphs = None  # captured graphs are bound to the real pool: run eagerly
    runner.kv_cache = torch.zeros(
        runner.kv_cache_shape(num_blocks), dtype=runner.kv_dtype, device=runner.device
    )
    if runner.window_layout is not None:  # a window pool as large: the step's tables fit it
        runner.window_kv_cache = torch.zeros(
            runner.window_cache_shape(num_blocks), dtype=runner.kv_dtype, device=runner.device
        )
    try:
        _, logits = runner.compute_logits(step)
        # The sampler's worst temporaries: a full-vocabulary sort (top-p) of every row.
        torch.sort(logits, dim=-1)
    finally:
        runner.kv_cache, runner.kv_connector, runner.decode_graphs = saved, connector, graphs
        runner.window_kv_cache = saved_window
    return num_blocks


def cuda_step_peak_bytes(runner: ModelRunner) -> int:
    """Bytes the largest step needs beyond what is allocated now (weights), measured."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run_profile_step(runner)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()  # hand the activations back: mem_get_info then sees them free
    return int(peak)
