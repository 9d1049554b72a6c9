"""The synchronous engine: validate requests, then schedule -> execute -> update, one step
at a time.

``LLMEngine`` is not thread-safe: one thread drives it (``AsyncLLMEngine`` owns such a
thread). It knows nothing of Ray; the model runner, the KV allocator and the KV connector
are injected so other packages (kvtransfer, deployments, tests) can compose it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from pdserve.engine.block_pool import NO_PARENT_HASH, hash_block_tokens
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import (
    KVConnector,
    QuantizedKVConnector,
    WindowKVConnector,
    moves_window_pool,
)
from pdserve.engine.kv_events import KVEventLog, KVEvents
from pdserve.engine.output_processor import prior_streamed_text
from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import SampledTokenLike, Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.stats import EngineStats, ThroughputMeter
from pdserve.engine.window_kv import NULL_BLOCK, WindowKV, WindowLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from pdserve.engine.loader import ModelConfig
    from pdserve.kernels.ops import DeviceRuntime, RuntimeSettings

logger = logging.getLogger(__name__)


class SamplerLike(Protocol):
    """What the engine needs of pdserve.engine.sampler.Sampler."""

    def forget(self, request_ids: Sequence[str]) -> None: ...


class ModelRunnerLike(Protocol):
    """What the engine needs of pdserve.engine.model_runner.ModelRunner (or, under tensor
    parallelism, pdserve.engine.tp_executor.TPExecutor). Read-only members: the engine
    never sets them."""

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def tokenizer(self) -> Any: ...  # a transformers tokenizer

    @property
    def runtime(self) -> DeviceRuntime: ...

    @property
    def sampler(self) -> SamplerLike: ...

    def profile_num_blocks(self) -> int: ...

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor: ...

    def execute(self, out: SchedulerOutput) -> Mapping[str, SampledTokenLike]: ...


def checked_connector(connector: object) -> KVConnector | None:
    """``connector`` as a KVConnector; a TypeError naming its type when it is not one
    (callers outside the type checker, such as Ray actors, can pass anything)."""
    if connector is None or isinstance(connector, KVConnector):
        return connector
    raise TypeError(f"kv_connector: expected a KVConnector, got {type(connector).__name__}")


def saves_kv_layers(connector: KVConnector | None) -> bool:
    """Whether ``connector`` must be called as each layer's KV is written."""
    return connector is not None and bool(connector.saves_kv_layers)


class LLMEngine:
    """One model, one KV pool, one scheduler."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        kv_cache_allocator: Any = None,
        kv_connector: KVConnector | None = None,
        model_runner: ModelRunnerLike | None = None,
        runtime_settings: RuntimeSettings | None = None,
        kv_cache_allocator_factory: Any = None,
        kv_agent_factory: Any = None,
    ) -> None:
        """``kv_cache_allocator_factory`` / ``kv_agent_factory`` (picklable callables)
        build the KV allocator and KV agent of ranks 1..tp-1 under tensor parallelism
        (``pdserve.engine.tp_executor``)."""
        kv_connector = checked_connector(kv_connector)
        if not moves_window_pool(kv_connector) and config.window_kv_pool:
            # This hand-off moves one pool of every layer: window layers keep all their KV.
            config = config.model_copy(update={"window_kv_pool": False})
        self.config = config
        if model_runner is None and config.tensor_parallel_size > 1:
            from pdserve.engine.loader import load_model_config
            from pdserve.engine.model_runner import check_transformers_path
            from pdserve.engine.tp_executor import TPExecutor, checked_tp_connector

            # Refused before any rank starts.
            model_config = load_model_config(config.model, config.model_impl)
            check_transformers_path(model_config, config, config.tensor_parallel_size)

            model_runner = TPExecutor(  # starts ranks 1..tp-1
                config,
                kv_cache_allocator=kv_cache_allocator,
                kv_connector=checked_tp_connector(kv_connector),
                runtime_settings=runtime_settings,
                kv_cache_allocator_factory=kv_cache_allocator_factory,
                kv_agent_factory=kv_agent_factory,
            )
        elif model_runner is None:
            from pdserve.engine.model_runner import ModelRunner  # torch and the model load here

            model_runner = ModelRunner(
                config,
                kv_cache_allocator=kv_cache_allocator,
                # Only a connector that reads KV per layer is hooked into the forward pass.
                kv_connector=kv_connector if saves_kv_layers(kv_connector) else None,
                runtime_settings=runtime_settings,
            )
        self.runner = model_runner
        # The device runtime: hooks for whoever runs the step loop (AsyncLLMEngine).
        self.runtime = model_runner.runtime
        self.kv_connector = kv_connector
        self.model_config = model_runner.model_config
        self.tokenizer = model_runner.tokenizer
        self.block_size = config.block_size
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.vocab_size: int = self.model_config.vocab_size

        num_blocks = config.num_kv_blocks or model_runner.profile_num_blocks()
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        self.kv_cache = model_runner.allocate_kv_cache(num_blocks)
        warm_up = getattr(model_runner, "warm_up", None)  # optional: fakes have none
        if warm_up is not None:  # GPU: compile every kernel variant before serving
            warm_up()
        # int8 / float8 pools: the [L_pool, 2, Hkv] scales of kv_cache's layers, which the
        # hand-off compares (engine/kv_scales.py), and the window pool's (below).
        split = getattr(model_runner, "pool_kv_scales", None)
        self.kv_scales: torch.Tensor | None
        self.window_kv_scales: torch.Tensor | None
        if split is not None:
            self.kv_scales, self.window_kv_scales = split()
        else:  # a runner without a window pool
            self.kv_scales = getattr(model_runner, "kv_scales", None)
            self.window_kv_scales = None
        if kv_connector is not None and self.kv_scales is not None:
            cast(QuantizedKVConnector, kv_connector).register_kv_caches(
                self.kv_cache, self.model_config.kv_identity, kv_scales=self.kv_scales
            )
        elif kv_connector is not None:
            kv_connector.register_kv_caches(self.kv_cache, self.model_config.kv_identity)
        # The window layers' own pool, where the runner keeps one (engine/window_kv.py).
        self.window_layout: WindowLayout | None = getattr(model_runner, "window_layout", None)
        window = None
        if self.window_layout is not None:
            window = WindowKV(
                self.window_layout.window,
                config.block_size,
                self.window_layout.num_blocks,
                config.enable_prefix_caching,
            )
            window_pool = getattr(model_runner, "window_kv_cache", None)
            if kv_connector is not None and window_pool is not None:  # moves_window_pool
                # A quantized window pool's scales ride along (only then: a float pool's
                # connector need not take them).
                scaled = (
                    {} if self.window_kv_scales is None else {"kv_scales": self.window_kv_scales}
                )
                cast(WindowKVConnector, kv_connector).register_window_kv_caches(
                    window_pool,
                    self.model_config.kv_identity,
                    layers=self.window_layout.layers,
                    window=self.window_layout.window,
                    **scaled,
                )
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, window
        )
        # The prefix cache's stored/evicted block hashes, drained by the serving layer.
        self.kv_events = KVEventLog()
        self.kv_cache_manager.pool.events = self.kv_events
        # The window pool's own: a router needs both to know which prefix hit is usable.
        self.window_kv_events: KVEventLog | None = None
        if window is not None:
            self.window_kv_events = window.pool.events = KVEventLog()
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            kv_connector=kv_connector,
        )
        self._prefill_meter = ThroughputMeter()
        self._decode_meter = ThroughputMeter()
        self._ids = itertools.count()
        # Tokens the latest step computed (0: the queue is blocked, e.g. waiting for blocks
        # held by remote reservations or in-flight KV sends).
        self.last_step_num_tokens = 0

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        kv_cache_allocator: Any = None,
        kv_connector: KVConnector | None = None,
        runtime_settings: RuntimeSettings | None = None,
        kv_cache_allocator_factory: Any = None,
        kv_agent_factory: Any = None,
        **config_overrides: Any,
    ) -> LLMEngine:
        config = EngineConfig(model=str(model_dir), **config_overrides)
        return cls(
            config,
            kv_cache_allocator=kv_cache_allocator,
            kv_connector=kv_connector,
            runtime_settings=runtime_settings,
            kv_cache_allocator_factory=kv_cache_allocator_factory,
            kv_agent_factory=kv_agent_factory,
        )

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        model_max = int(
            getattr(self.model_config, "max_context", self.model_config.max_position_embeddings)
        )
        pool_max = num_blocks * self.block_size
        wanted = self.config.max_model_len
        if wanted is not None:
            if wanted > model_max:
                raise ValueError(
                    f"max_model_len ({wanted}) exceeds the model's context ({model_max})"
                )
            if wanted > pool_max:
                raise ValueError(
                    f"max_model_len ({wanted}) does not fit in the KV pool "
                    f"({num_blocks} blocks x {self.block_size} tokens)"
                )
            return wanted
        if pool_max < model_max:
            logger.warning(
                "max_model_len capped at %d tokens: the KV pool has %d blocks of %d",
                pool_max,
                num_blocks,
                self.block_size,
            )
        return min(model_max, pool_max)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError naming the bad field; nothing is queued then."""
        self.scheduler.add_request(
            self._make_request(request_id, prompt, params, prefill_only, arrival_time)
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request and free its blocks; returns its final output (None if unknown
        or already finished)."""
        return self.scheduler.abort(request_id)

    def reserve_remote_prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        receives_window_pool: bool = False,
    ) -> list[int] | None:
        """Decode role: reserve blocks for the prompt whose KV another engine computes.

        Returns the destination block ids in prompt order, or None when the pool has no
        room now (nothing is held then). An engine with a window pool
        (``window_layout``) also reserves the window layers' blocks of the first decoded
        token's window only: ``remote_window_blocks`` says which; the caller
        (``receives_window_pool=True``) fills both, else this is refused.
        """
        if self.window_layout is not None and not receives_window_pool:
            raise ValueError(
                "this engine keeps its window layers' KV in a pool of their own: pass "
                "receives_window_pool=True and fill remote_window_blocks() too (a window "
                "pool hand-off), or build it with window_kv_pool=False"
            )
        request = self._make_request(request_id, prompt_token_ids, params, False, arrival_time)
        return self.scheduler.reserve_remote_prefill(request)

    @property
    def window_kv_cache(self) -> torch.Tensor | None:
        """The window layers' own pool ``[L_window, 2, N_w, B, Hkv, D]`` (engine/window_kv.py),
        None where every layer is in ``kv_cache``."""
        return getattr(self.runner, "window_kv_cache", None)

    def remote_window_blocks(self, request_id: str) -> tuple[int, list[int]]:
        """A reserved remote prefill's window pool blocks: the index of the first prompt
        block whose window-layer KV is received and the window blocks from there to the
        prompt's end (the entries before are ``NULL_BLOCK``: never received, never read).
        ValueError without a window pool or such a reservation."""
        request = self.scheduler.remote.get(request_id)
        if self.window_layout is None or request is None:
            raise ValueError(f"request {request_id!r}: no window pool reservation")
        table = request.window_block_ids
        first = next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table))
        # Blocks of a prefix hit are held already (a delta hand-off starts after them).
        first = max(first, request.num_computed_tokens // self.kv_cache_manager.block_size)
        end = self.kv_cache_manager.num_blocks_for(request.num_prompt_tokens)
        return first, list(table[first:end])

    def complete_remote_prefill(
        self,
        request_id: str,
        first_token_id: int,
        first_logprobs: TokenLogprob | None = None,
        *,
        num_cached_tokens: int | None = None,
    ) -> None:
        """The prompt's KV is in the reserved blocks; the first token is streamed by the
        next step() and decoding continues here. ``num_cached_tokens``: the prompt tokens
        the prefill side took from its prefix cache (None: this side's hit counts)."""
        if not isinstance(first_token_id, int) or not 0 <= first_token_id < self.vocab_size:
            raise ValueError(
                f"first_token_id must be in [0, {self.vocab_size}), got {first_token_id!r}"
            )
        self.scheduler.complete_remote_prefill(
            request_id, first_token_id, first_logprobs, num_cached_tokens
        )

    def fail_remote_prefill(self, request_id: str) -> None:
        """The remote prefill failed: compute the prompt locally into the reserved blocks."""
        self.scheduler.fail_remote_prefill(request_id)

    def _make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        prefill_only: bool,
        arrival_time: float | None,
    ) -> Request:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = self._prompt_token_ids(prompt)
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, more than max_model_len "
                f"({self.max_model_len})"
            )
        if params.num_prior_output_tokens >= len(prompt_ids):
            raise ValueError(
                f"num_prior_output_tokens ({params.num_prior_output_tokens}) must be less than "
                f"the prompt's length ({len(prompt_ids)}): the prior outputs follow a prompt"
            )
        from pdserve.engine.detokenizer import IncrementalDetokenizer

        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            prefill_only=prefill_only,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                params.skip_special_tokens,
                num_prior_output_tokens=params.num_prior_output_tokens,
            ),
        )
        # A migrated request's text continues after what the client already has.
        request.emitted_text = prior_streamed_text(request)
        return request

    def _prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, Sequence):
            ids = list(prompt)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise ValueError(
                        f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}"
                    )
        else:
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt must not be empty")
        return ids

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that got a token (or
        finished) in it."""
        connector = self.kv_connector
        if connector is not None:
            self.scheduler.finish_sends(connector.poll_finished())
        out = self.scheduler.schedule()
        self.last_step_num_tokens = out.num_batched_tokens
        sampled: Mapping[str, SampledTokenLike] = {}
        sends_done: list[str] = []
        if out.chunks:
            start = time.perf_counter()
            # The runner calls connector.begin_step(out.kv_sends) and layer_computed();
            # the engine collects finished sends after the forward pass.
            try:
                sampled = self.runner.execute(out)
            finally:
                if connector is not None:
                    sends_done = connector.end_step()
            self._measure(out, time.perf_counter() - start)
        else:
            if out.finished_request_ids:
                # No forward pass this step, but the sampler still drops per-request state.
                self.runner.sampler.forget(out.finished_request_ids)
            if connector is not None and out.kv_sends:
                # Only cancels (a request left mid-prefill): no forward pass to carry them.
                other_ranks = getattr(self.runner, "run_sends_only", None)
                if other_ranks is not None:  # tensor parallel: every rank's connector
                    other_ranks(list(out.kv_sends))
                connector.begin_step(list(out.kv_sends))
                sends_done = connector.end_step()
        outputs = self.scheduler.update_from_output(sampled)
        # After the update, so a send of a request that finished in this step is known.
        self.scheduler.finish_sends(sends_done)
        return outputs

    def _measure(self, out: SchedulerOutput, seconds: float) -> None:
        prefill = sum(c.num_tokens for c in out.chunks if c.num_tokens > 1)
        decode = out.num_batched_tokens - prefill
        # A mixed step is attributed to prefill: prompt tokens dominate its cost.
        if prefill:
            self._prefill_meter.update(prefill, seconds)
        elif decode:
            self._decode_meter.update(decode, seconds)

    def has_unfinished_requests(self) -> bool:
        """Any request not finished: queued, running, or waiting for remote KV."""
        return self.scheduler.has_unfinished_requests()

    def has_ready_work(self) -> bool:
        """Whether step() makes progress now: tokens to compute or outputs to emit."""
        return self.scheduler.has_work()

    def has_pending_work(self) -> bool:
        """Whether step() should be called: tokens to compute, outputs to emit, or KV sends
        whose completion must be polled."""
        return self.scheduler.has_work() or bool(self.scheduler.sending)

    def drain_kv_events(self) -> KVEvents:
        """Both pools' prefix-cache events since the last call (each log has its lock)."""
        events = self.kv_events.drain()
        if self.window_kv_events is not None:
            events = events.with_window(self.window_kv_events.drain())
        return events

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens whose KV the prefix cache holds right now (full blocks; the last
        token is always computed, so it never counts). Only reads block hashes."""
        manager = self.kv_cache_manager
        if not manager.enable_prefix_caching:
            return 0
        bs = manager.block_size
        parent = NO_PARENT_HASH
        hashes: list[int] = []
        for i in range((len(token_ids) - 1) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            if manager.pool.lookup(parent) is None:
                break
            hashes.append(parent)
        if manager.window is not None:  # as far as the window pool holds the window too
            return manager.window.usable_hit(hashes, len(hashes)) * bs
        return len(hashes) * bs

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_steps: int = 1_000_000,
    ) -> list[RequestOutput]:
        """Run prompts to completion (for tests and benchmarks); final outputs in order."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        requests = [
            self._make_request(rid, prompt, p, False, None)
            for rid, prompt, p in zip(ids, prompts, params, strict=True)
        ]
        for request in requests:
            self.scheduler.add_request(request)
        final: dict[str, RequestOutput] = {}
        try:
            for _ in range(max_steps):
                if len(final) == len(ids):
                    return [final[rid] for rid in ids]
                outputs = self.step()
                for output in outputs:
                    if output.finished:
                        final[output.request_id] = output
                if not outputs and not self.last_step_num_tokens and not self.scheduler.sending:
                    raise RuntimeError("generate: no request can be scheduled (KV pool held)")
            if len(final) == len(ids):
                return [final[rid] for rid in ids]
            raise RuntimeError(f"generate: not finished after {max_steps} steps")
        finally:
            for rid in ids:
                if rid not in final:
                    self.abort(rid)

    # ------------------------------------------------------------------ state
    def dtypes(self) -> tuple[str, str]:
        """(weights, KV cache) as reports show them: 'bfloat16', 'int8 a8 int8' (a quantized
        checkpoint or at-load quantization), '...; experts mxfp4 dequantized to bfloat16'
        (quantized experts), and 'bfloat16' / 'int8' / 'fp8_e4m3'."""
        from pdserve.engine.kv_scales import kv_dtype_label

        dtype = str(self.model_config.dtype).removeprefix("torch.")
        quant = self.model_config.quantization
        if quant is not None:
            weights = quant.describe()
        elif self.config.quantization is not None:
            weights = self.config.quantization
        else:
            weights = dtype
        moe, fp8_block = self.model_config.moe, self.model_config.dequantized_fp8_block
        if moe is not None and moe.quantized is not None:  # held in the model's dtype
            weights = f"{weights}; experts {moe.quantized.describe()} dequantized to {dtype}"
        elif fp8_block is not None:
            weights = f"{weights}; fp8 {fp8_block[0]}x{fp8_block[1]} blocks dequantized"
        return weights, kv_dtype_label(self.kv_cache.dtype)

    def stats(self) -> EngineStats:
        s = self.scheduler
        kv = self.kv_cache_manager
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_waiting_remote_kv=len(s.remote),
            num_sending_kv=len(s.sending),
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            block_size=self.block_size,
            queued_prefill_tokens=s.queued_prefill_tokens,
            prefill_tokens_per_s=self._prefill_meter.rate,
            decode_tokens_per_s=self._decode_meter.rate,
            kv_usage=kv.usage,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_prompt_tokens=s.num_prompt_tokens_computed,
            num_generation_tokens=s.num_generated_tokens,
            num_window_free_blocks=kv.window.pool.num_free_blocks if kv.window else 0,
            num_window_total_blocks=kv.window.pool.num_blocks - 1 if kv.window else 0,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError if queues, request states or block ref counts disagree."""
        self.scheduler.check_integrity()

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    def check_health(self) -> None:
        """Raise if the runner cannot compute any more (a tensor-parallel rank is gone)."""
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    def worker_places(self) -> list[Any]:
        """Where the runner's other tensor-parallel ranks run (``RankPlace`` each; [] for a
        single-device engine). Safe from any thread."""
        places = getattr(self.runner, "worker_places", None)
        return list(places()) if places is not None else []

    def shutdown(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel workers)."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()
