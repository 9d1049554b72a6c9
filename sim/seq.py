"""A request's state inside one simulated engine (``Seq``) and an engine's limits
(``EngineShape``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.sim.request import SimRequest


@dataclass(frozen=True)
class EngineShape:
    """A replica's engine limits (``EngineLimits`` of its pool)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


WAITING, PREFILLING, DECODING, GONE = 0, 1, 2, 3


class Seq:
    """A request's state inside one engine (its prompt may be recomputed after preemption).

    While ``DECODING`` its ``computed`` and ``outputs`` are implicit: they grew by one per
    engine decode step since it joined at step ``j`` with ``c0`` computed, ``o0`` out."""

    __slots__ = (
        "req", "computed", "outputs", "blocks", "prefill_only", "aborted", "state",
        "j", "c0", "o0",
    )  # fmt: skip

    def __init__(self, req: SimRequest, prefill_only: bool = False) -> None:
        self.req = req
        self.computed = 0
        self.outputs = 0
        self.blocks = 0
        self.prefill_only = prefill_only
        self.aborted = False
        self.state = WAITING
        self.j = self.c0 = self.o0 = 0

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_tokens + self.outputs

    @property
    def uncomputed(self) -> int:
        return self.req.prompt_tokens + self.outputs - self.computed


Callback = Callable[[Seq, float], None]


def noop(seq: Seq, t: float) -> None:
    return None


def blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
