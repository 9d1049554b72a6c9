"""``PrefillServer``: a prefill-pool replica (Serve deployment class, built by ``app.py``).

It runs an engine in the prefill role: each ``PrefillRequest`` is computed with
``prefill_only=True`` while the engine's KV connector pushes every layer's KV into the decode
replica's reserved blocks (``kvtransfer``; the engine registers its pool with the connector
once allocated, which builds the connector's sender). It answers with the first token once
the decode side confirmed the whole KV landed; a failed transfer raises, which the decode
server turns into a local recompute. It never decodes past the first token and never talks
to clients.

The class is plain Python: ``app.py`` wraps it with ``serve.deployment``; tests may also
construct it directly (no Ray needed) with an injected engine factory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from pdserve.deployments import kv_events, tracing
from pdserve.deployments.config import AppConfig
from pdserve.deployments.engine_factory import (
    EngineFactory,
    default_engine_factory,
    engine_config,
    pool_hooks,
)
from pdserve.deployments.load import RateMeter, prefill_autoscaling_stats, replica_stats
from pdserve.deployments.messages import PrefillRequest, PrefillResponse, TokenLogprob
from pdserve.deployments.metrics import ServingMetrics
from pdserve.deployments.replica import (
    IntegrityReport,
    TransferMetricsObserver,
    replica_actor_name,
    replica_name,
    replica_node_id,
    runtime_report,
    transfer_host,
)
from pdserve.deployments.tp_kv import (
    PrefillAgentFactory,
    TPPrefillConnector,
    replica_kv_bytes_per_token,
)
from pdserve.deployments.window_handoff import check_window_pairing
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connector import PrefillKVConnector
from pdserve.kvtransfer.types import KVTransferError

logger = logging.getLogger("ray.serve")

# Extra time, past the KV deadline, to wait for the sender's verdict (it is bounded by
# the deadline itself; this only absorbs scheduling jitter).
RESULT_GRACE_S = 2.0


class PrefillServer:
    """Prefill-pool replica: ``prefill(PrefillRequest) -> PrefillResponse``."""

    def __init__(
        self,
        config: dict[str, Any] | AppConfig,
        model_dir: str,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        self.cfg = config if isinstance(config, AppConfig) else AppConfig.from_dict(config)
        tracing.setup_tracing(self.cfg.observability)
        self.model_name = self.cfg.model.served_name(model_dir)
        self.replica = replica_name()  # named in each answer (the decode side counts the pool)
        self.metrics = ServingMetrics(
            model_name=self.model_name,
            role="prefill",
            replica=self.replica,
            enabled=self.cfg.observability.metrics_enabled,
        )
        t = self.cfg.transport
        transfer = KVTransferConfig(
            transport=t.kind, host=transfer_host(t.host), connect_timeout_s=t.connect_timeout_s
        )
        local = PrefillKVConnector(
            transfer,
            observer=TransferMetricsObserver(self.metrics),
            # A window model's engine then keeps (and sends) only its window layers' window
            # (every rank its heads'), paired with the decode pool's (window_handoff.py).
            window_pool=True,
        )
        # Tensor parallel: every rank sends the KV heads it holds; rank 0's connector hands
        # the targets to the others' and merges their results.
        tp = self.cfg.prefill.tensor_parallel_size > 1
        self._local = local  # rank 0's own connector (the window pool's, if any)
        self.connector: PrefillKVConnector | TPPrefillConnector = (
            TPPrefillConnector(local) if tp else local
        )
        factory = engine_factory or default_engine_factory
        self.engine = factory(
            engine_config(self.cfg, "prefill", model_dir),
            pool_hooks(
                self.cfg,
                "prefill",
                kv_connector=self.connector,
                kv_agent_factory=PrefillAgentFactory(transfer) if tp else None,
            ),
        )
        self._kv_events = kv_events.publisher_for(self.engine)
        self.metrics.record_dtypes(self.engine)
        # The engine registered its pool with the connector, which built the sender.
        self.sender = self.connector.sender
        self.layout = self.sender.layout
        # Over the whole replica: every KV head once, whichever rank holds it.
        block_bytes = self.layout.block_bytes(self.layout.heads_total)
        self.kv_bytes_per_token = (
            block_bytes * self.layout.num_layers // max(self.layout.block_size, 1)
        )
        # A window pool (not in the sender's layout): its layers hand off only the blocks
        # of the first decoded token's window, which the router's estimate counts. A
        # token's KV on every layer counts them too.
        window_pool = getattr(self.engine, "window_kv_cache", None)  # test engines may lack it
        self.window_kv_bytes_per_token = (
            replica_kv_bytes_per_token(window_pool, self.engine.model_config.num_kv_heads)
            if window_pool is not None
            else 0
        )
        self.kv_bytes_per_token += self.window_kv_bytes_per_token
        self.kv_window: int = getattr(self.engine, "kv_window", 0)
        self.max_num_seqs = self.cfg.prefill.engine.max_num_seqs
        self._arrivals = RateMeter()

    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        """Compute the prompt, push its KV to ``req.kv_targets``, return the first token.

        Raises on any failure (bad request, engine error, transfer failure or timeout): the
        caller recomputes locally. Cancelling the call aborts the request here.
        """
        rid = req.request_id
        num_tokens = len(req.prompt_token_ids)
        # The autoscaler weighs this rate against the measured prefill throughput, which
        # counts computed tokens only: a prefix this replica holds costs it nothing.
        self._arrivals.add(num_tokens - self.engine.cached_prefix_tokens(req.prompt_token_ids))
        self.metrics.prompt_tokens.inc(num_tokens)
        params = req.sampling.to_params()
        attrs = {
            tracing.USAGE_INPUT_TOKENS: num_tokens,
            # Where this replica pushes the KV (the decode replica's listener).
            "pdserve.kv_target.address": req.kv_targets[0].address,
            "pdserve.kv_target.transport": req.kv_targets[0].transport,
        }
        with tracing.span("prefill", self.model_name, carrier=req.trace_carrier, attributes=attrs):
            targets = req.kv_targets  # one per rank of the decode replica
            windowed = self._local.has_window_pool  # rank 0's, as every rank's
            check_window_pairing(
                prefill_has_window_pool=windowed,
                num_window_targets=len(req.window_kv_targets),
                num_targets=len(targets),
            )
            target = targets[0] if len(targets) == 1 else targets
            if windowed:
                window = req.window_kv_targets  # one per decode rank, as ``targets``
                window_target = window[0] if len(window) == 1 else window
                self.connector.register_target(rid, target, window_target=window_target)
            else:
                self.connector.register_target(rid, target)
            last = None
            try:
                async for out in self.engine.generate(
                    rid, req.prompt_token_ids, params, prefill_only=True
                ):
                    last = out
            finally:
                if last is None or not last.finished:
                    # Never scheduled (or aborted before its send began): drop the target.
                    self.connector.unregister_target(rid)
            if last is None or last.finish_reason == "abort" or not last.token_ids:
                raise RuntimeError(f"prefill of {rid!r} ended without a first token")
            # The sender's verdict: every layer landed and the decode side confirmed it.
            timeout = max(0.0, req.kv_targets[0].deadline - time.time()) + RESULT_GRACE_S
            result = await asyncio.to_thread(self.connector.take_result, rid, timeout)
            if result is None:
                raise TimeoutError(f"KV transfer of {rid!r} did not finish within {timeout:.1f}s")
            if not result.ok:
                raise KVTransferError(f"KV transfer of {rid!r} failed: {result.error}")
        first_logprobs = (
            TokenLogprob.from_engine(last.logprobs[0], self.engine.tokenizer)
            if last.logprobs
            else None
        )
        # The prefill pool's prefix-cache hit rate (the decode pool records its own).
        self.metrics.prefix_cache_queries.inc(len(req.prompt_token_ids))
        self.metrics.prefix_cache_hits.inc(last.num_cached_tokens)
        return PrefillResponse(
            request_id=rid,
            first_token_id=last.token_ids[0],
            first_logprobs=first_logprobs,
            transfer=result,
            num_cached_tokens=last.num_cached_tokens,
            prefill_tokens_per_s=self.engine.stats().prefill_tokens_per_s,
            replica=self.replica,
        )

    # ------------------------------------------------------------------ Serve hooks
    def record_routing_stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        self.metrics.record_load(
            running=stats.num_running, waiting=stats.num_waiting, kv_usage=stats.kv_usage
        )
        return replica_stats(
            "prefill",
            stats,
            max_num_seqs=self.max_num_seqs,
            kv_bytes_per_token=self.kv_bytes_per_token,
            prompt_tokens_per_s=self._arrivals.rate(),
            kv_events=kv_events.publish(self._kv_events),
            window_kv_bytes_per_token=self.window_kv_bytes_per_token,
            kv_window=self.kv_window,
        ).model_dump()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return prefill_autoscaling_stats(self.engine.stats(), self._arrivals.rate())

    def check_health(self) -> None:
        self.engine.check_health()

    # ------------------------------------------------------------------ test/ops hooks
    async def check_integrity(self) -> IntegrityReport:
        """Engine queues and block ref counts consistent; reports what is still held."""
        await self.engine.check_integrity()
        stats = self.engine.stats()
        return IntegrityReport(
            role="prefill",
            node_id=replica_node_id(),
            num_unfinished=stats.num_running + stats.num_waiting + stats.num_sending_kv,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            pending_transfers=self._local.open_handles(),  # both pools' sends
            num_window_free_blocks=stats.num_window_free_blocks,
            num_window_total_blocks=stats.num_window_total_blocks,
            **runtime_report(self.engine),
        )

    def actor_name(self) -> str | None:
        """Ray actor name of this replica (ops and tests: ``ray.get_actor(name, "serve")``)."""
        return replica_actor_name()

    def shutdown(self) -> None:
        """Close KV connections and stop the engine (idempotent)."""
        self.connector.close()
        self.engine.shutdown()

    def __del__(self) -> None:  # Serve calls this when it stops the replica
        with contextlib.suppress(Exception):
            self.shutdown()
