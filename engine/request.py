"""One request's state inside the engine: tokens, progress, blocks and its state machine.

States and transitions (anything else raises):

    WAITING ──admit──> RUNNING ──preempt──> PREEMPTED ──admit──> RUNNING
    WAITING_FOR_REMOTE_KV ──complete──> WAITING (KV present) ──admit──> RUNNING
    WAITING_FOR_REMOTE_KV ──fail──> WAITING (recompute locally into the reserved blocks)
    any unfinished ──> FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED

No tensors here; the scheduler and the cache manager mutate these objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.outputs import FinishReason, TokenLogprob
from pdserve.engine.sampling_params import SamplingParams


class Detokenizer(Protocol):
    """What the scheduler needs of pdserve.engine.detokenizer.IncrementalDetokenizer."""

    def append(self, token_id: int) -> str: ...

    @property
    def text(self) -> str: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}
_FINISH_REASON: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
_ALLOWED: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.WAITING: {RequestStatus.RUNNING},
    RequestStatus.PREEMPTED: {RequestStatus.RUNNING},
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED},
    RequestStatus.WAITING_FOR_REMOTE_KV: {RequestStatus.WAITING},
}


@dataclass(eq=False)
class Request:
    """Mutable per-request state. ``block_ids`` is owned by the KVCacheManager."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    prefill_only: bool = False
    detokenizer: Detokenizer | None = None
    status: RequestStatus = RequestStatus.WAITING

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Tokens whose KV is in this request's blocks (prompt and output alike).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (reported to clients).
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # The window layers' block table (engine/window_kv.py), when they have a pool of their
    # own: one entry per block of the sequence, NULL_BLOCK where it fell out of the window.
    window_block_ids: list[int] = field(default_factory=list)
    # Leading blocks whose hash is registered in the prefix cache.
    num_hashed_blocks: int = 0
    # Hashes of the full blocks of all_token_ids, computed lazily and extended as it grows.
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Output text already handed to the caller, before a migration included (a prefix of
    # the detokenizer's text).
    emitted_text: str = ""
    # Number of output tokens already handed to the caller.
    num_emitted_tokens: int = 0
    num_emitted_logprobs: int = 0
    # Where the output text ends when a stop string matched (the stop string is cut off).
    stop_text_index: int | None = None
    # prefill_only: its KV send was started, so its blocks wait for the connector.
    kv_send_scheduled: bool = False
    # ... and the connector reported it finished (its blocks may be freed).
    kv_send_done: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    def transition(self, new: RequestStatus) -> None:
        """Move to ``new``; finishing is allowed from any unfinished state."""
        if new.is_finished and not self.status.is_finished:
            self.status = new
            return
        if new not in _ALLOWED.get(self.status, set()):
            raise RuntimeError(
                f"request {self.request_id}: illegal transition {self.status.name} -> {new.name}"
            )
        self.status = new
