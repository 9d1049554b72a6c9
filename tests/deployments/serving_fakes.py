"""Fakes shared by the deployments tests (one place, not a copy per test file)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdserve.kvtransfer.types import KVLayout, KVTarget

TINY_LAYOUT = KVLayout(
    model="fake", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32"
)


def make_kv_target(request_id: str, num_blocks: int, deadline_s: float = 30.0) -> KVTarget:
    return KVTarget(
        transport="shm",
        address="127.0.0.1:1",
        node_id="node",
        request_id=request_id,
        block_ids=tuple(range(num_blocks)),
        deadline=time.time() + deadline_s,
        token="x" * 32,
        layout=TINY_LAYOUT,
    )


class InProcessPrefill:
    """``PrefillClient`` calling a ``PrefillServer`` in this process, with knobs to make the
    call fail or stall the way a dead or overloaded prefill replica would."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.requests: list[Any] = []  # every PrefillRequest sent, in order
        self.fail: BaseException | None = None
        self.delay_s = 0.0
        self.cancelled = 0

    async def prefill(self, request: Any) -> Any:
        self.calls += 1
        self.requests.append(request)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.fail is not None:
                raise self.fail
            return await self.server.prefill(request)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
