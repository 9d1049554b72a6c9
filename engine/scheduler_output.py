"""What the scheduler hands the model runner for one step (no tensors here).

The scheduler decides *which tokens* of *which requests* run; the model runner turns this
into batch tensors. Everything is plain Python so the scheduler never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.kv_connector import PendingSend
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens one request feeds through the model in this step."""

    request_id: str
    # Tokens fed this step: a prompt chunk (prefill) or the last sampled token (decode).
    token_ids: list[int]
    # num_computed_tokens before this step, i.e. the position of token_ids[0].
    start_position: int
    # The request's whole block table; it covers start_position + len(token_ids) tokens.
    block_ids: list[int]
    # True when, after this step, the request needs a new token sampled.
    sample: bool
    sampling_params: SamplingParams
    # Tokens generated so far; seeded sampling derives its generator from (seed, this).
    num_output_tokens: int
    # (prompt ids, output ids) of the request, by reference, for the sampler's penalties;
    # None when its sampling does not read them (no copy per step for the common case).
    history: tuple[list[int], list[int]] | None = None
    # The window layers' block table when they have a pool of their own (same length as
    # block_ids; out-of-window entries point at the pool's never-written null block).
    window_block_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        """True while the chunk still processes prompt tokens (more than one token or none
        sampled yet)."""
        return self.num_output_tokens == 0 or len(self.token_ids) > 1


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's batch: chunks in batch order plus KV sends that start this step."""

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    kv_sends: list[PendingSend] = field(default_factory=list)
    # Requests that left the engine since the previous step (finished, aborted or
    # preempted); the runner may drop any per-request state it keeps for them.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
