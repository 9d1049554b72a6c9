"""One simulated request: what the workload fixes (arrival, lengths) and what the simulated
cluster records about it (first token, finish, where it was prefilled).

Mutable on purpose and slotted: a one-hour simulated day creates hundreds of thousands.
"""

from __future__ import annotations

from typing import Literal

Placement = Literal["local", "remote", "fallback", "shed"]


class SimRequest:
    __slots__ = (
        "rid",
        "arrival",
        "prompt_tokens",
        "output_tokens",
        "first_token_at",
        "finished_at",
        "placement",
        "block_hashes",
        "turn",
        "cached_tokens",
    )

    def __init__(self, rid: int, arrival: float, prompt_tokens: int, output_tokens: int) -> None:
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError(
                f"request {rid}: prompt_tokens ({prompt_tokens}) and output_tokens "
                f"({output_tokens}) must be >= 1"
            )
        self.rid = rid
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.placement: Placement | None = None
        # The prompt's block-hash chain (``pdserve.sim.prefix``); empty: it shares no prefix.
        self.block_hashes: tuple[int, ...] = ()
        self.turn = 1  # its turn in a conversation
        self.cached_tokens = 0  # prompt tokens its prefill did not compute

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival

    @property
    def tpot(self) -> float | None:
        """bench.serve's definition: (e2e - ttft) / (output tokens - 1)."""
        if self.finished_at is None or self.first_token_at is None or self.output_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)
