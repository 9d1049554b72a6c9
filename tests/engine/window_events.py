"""A KV cache manager with a window pool whose two pools log their KV events, and a prompt
computed through it chunk by chunk (shared by the engine's and the routers' window tests)."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_events import KVEventLog, KVEvents
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.window_kv import WindowKV

B = 16


class LoggedWindowManager:
    """``KVCacheManager`` with a window pool of ``num_window_blocks`` (null block included),
    each pool logging to its own ``KVEventLog`` as ``LLMEngine`` wires them."""

    def __init__(self, window: int, num_window_blocks: int, num_blocks: int = 400) -> None:
        self.window = WindowKV(window, B, num_window_blocks, True)
        self.kv = KVCacheManager(num_blocks, B, True, self.window)
        self.full_log = self.kv.pool.events = KVEventLog()
        self.window_log = self.window.pool.events = KVEventLog()

    def drain(self) -> KVEvents:
        return self.full_log.drain().with_window(self.window_log.drain())

    def compute(
        self, rid: str, prompt: list[int], chunk: int, after_step: Callable[[], None] = lambda: None
    ) -> Request:
        """Compute the whole prompt in ``chunk``-token steps (caching full blocks after each,
        as the scheduler does); ``after_step`` runs after every step. Returns the request,
        still holding its blocks."""
        request = Request(rid, prompt, SamplingParams(max_tokens=1), 0.0)
        while request.num_computed_tokens < request.num_tokens:
            n = min(chunk, request.num_tokens - request.num_computed_tokens)
            assert self.kv.allocate_slots(request, n) is not None
            request.num_computed_tokens += n
            self.kv.cache_full_blocks(request)
            after_step()
        return request
