"""``DecodeServer``: a decode-pool replica that orchestrates each request (Serve deployment
class, built by ``app.py``).

For every ``GenerateRequest`` it asks the disaggregation policy where to prefill:
- local: the engine computes the prompt itself (short prompt, cached prefix, prefill pool
  saturated, or no prefill pool);
- remote: ``remote_prefill.RemotePrefill``, the one owner of this side of the hand-off:
  reserve KV blocks, expect the KV (-> ``KVTarget``), call the prefill pool (through its
  TTFT-aware router) with a ``PrefillRequest``, wait for the KV, then decode here. If the
  prefill replica dies or the transfer misses its deadline, it recomputes locally into the
  same blocks: the client sees a slower first token, never an error;
- shed: admission control (``admission.decode.DecodeAdmission``) predicts the request's
  TTFT from everything queued ahead of it here and answers at once with a 429 error chunk
  (Retry-After from the predicted drain time) when the prediction exceeds its class's
  threshold.

Tokens stream back as ``GenerateChunk``s. If the consumer goes away (client disconnect:
the generator is closed or its task cancelled) the prefill call is cancelled, the receiver
stops expecting the KV (after fencing the peer) and the engine request is aborted, so no
block is leaked on either side.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict
from ray.serve.handle import DeploymentHandle

from pdserve.deployments import autoscaling, kv_events, tracing
from pdserve.deployments.admission.decode import (
    AdmissionRequest,
    DecodeAdmission,
    ReplicaSignals,
    uncached_tokens,
)
from pdserve.deployments.admission.rules import MIN_DRAIN_S, AdmissionDecision
from pdserve.deployments.config import AppConfig
from pdserve.deployments.engine_factory import (
    EngineFactory,
    default_engine_factory,
    engine_config,
    pool_hooks,
)
from pdserve.deployments.handle_warmup import start_warm_up
from pdserve.deployments.load import Ema, RateMeter, decode_autoscaling_stats, replica_stats
from pdserve.deployments.messages import (
    ErrorInfo,
    GenerateChunk,
    GenerateRequest,
)
from pdserve.deployments.metrics import ServingMetrics
from pdserve.deployments.policy import (
    Decision,
    DisaggregationPolicy,
    LocalLoad,
    RemotePrefillEstimator,
)
from pdserve.deployments.remote_prefill import (
    DecodeConnector,
    PrefillClient,
    RemotePrefill,
    ServePrefillClient,
)
from pdserve.deployments.replica import (
    IntegrityReport,
    TransferMetricsObserver,
    replica_name,
    replica_node_id,
    runtime_report,
    transfer_host,
)
from pdserve.deployments.tp_kv import (
    DecodeAgentFactory,
    TPDecodeConnector,
    replica_kv_bytes_per_token,
)
from pdserve.engine.outputs import RequestOutput
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.decode_connector import DecodeKVConnector

logger = logging.getLogger("ray.serve")


class DecodeCounters(BaseModel):
    """Totals since the replica started (for tests, benchmarks and ``pdserve status``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    local: int
    remote: int
    fallbacks: int
    shed: int
    kv_transfers: int
    kv_bytes_received: int
    kv_transfer_failures: int


class AdmissionReport(BaseModel):
    """How well this replica predicted TTFT (for the overload benchmark and ops)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_observed: int
    median_abs_error_s: float | None
    calibration: float
    samples: list[tuple[float, float]]  # (predicted, actual) TTFT of recent requests


class DecodeServer:
    """Decode-pool replica: ``generate(GenerateRequest)`` streams ``GenerateChunk``s."""

    def __init__(
        self,
        config: dict[str, Any] | AppConfig,
        model_dir: str,
        prefill: Any = None,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        self.cfg = config if isinstance(config, AppConfig) else AppConfig.from_dict(config)
        tracing.setup_tracing(self.cfg.observability)
        self.model_name = self.cfg.model.served_name(model_dir)
        self.replica = replica_name()
        self.metrics = ServingMetrics(
            model_name=self.model_name,
            role="decode",
            replica=self.replica,
            enabled=self.cfg.observability.metrics_enabled,
        )
        allocator = _shared_allocator(self.cfg)
        t = self.cfg.transport
        transfer = KVTransferConfig(
            transport=t.kind, host=transfer_host(t.host), connect_timeout_s=t.connect_timeout_s
        )
        self.transfer_observer = TransferMetricsObserver(self.metrics)
        # Serve injects a DeploymentHandle to PrefillServer; tests may pass a PrefillClient.
        client: PrefillClient | None = (
            ServePrefillClient(prefill) if isinstance(prefill, DeploymentHandle) else prefill
        )
        tp = self.cfg.decode.tensor_parallel_size > 1
        # The engine's KV connector receives remote prefills (none without a prefill pool);
        # under tensor parallelism rank 0's speaks for every rank's receiver.
        connector: DecodeConnector | None = None
        if client is not None:
            local = DecodeKVConnector(
                transfer,
                observer=self.transfer_observer,
                segment_for=allocator.segment_for if allocator is not None else None,
                # A window model's engine then keeps (and receives) only its window layers'
                # window (every rank its heads'), paired with the prefill pool's
                # (deployments/window_handoff.py).
                window_pool=True,
            )
            connector = TPDecodeConnector(local, window_pool=True) if tp else local
        factory = engine_factory or default_engine_factory
        self.engine = factory(
            engine_config(self.cfg, "decode", model_dir),
            pool_hooks(
                self.cfg,
                "decode",
                kv_cache_allocator=allocator,
                kv_connector=connector,
                # Tensor parallel: ranks 1.. receive the KV heads they hold themselves.
                kv_agent_factory=DecodeAgentFactory(transfer) if tp else None,
            ),
        )
        self._kv_events = kv_events.publisher_for(self.engine)
        self.metrics.record_dtypes(self.engine)
        self.block_size: int = self.engine.block_size
        self.max_num_seqs = self.cfg.decode.engine.max_num_seqs
        model = self.engine.model_config
        # A token's KV over the whole replica (every rank's heads, each once).
        self.kv_bytes_per_token = replica_kv_bytes_per_token(
            self.engine.kv_cache,
            model.num_kv_heads,
            getattr(self.engine, "window_kv_cache", None),  # injected test engines may lack it
        )
        self._allocator = allocator
        self.policy = DisaggregationPolicy(
            self.cfg.policy, self.cfg.slo, self.cfg.router.default_prefill_tokens_per_s
        )
        self.remote_estimate = RemotePrefillEstimator(self.cfg.router.default_prefill_tokens_per_s)
        self.remote = (
            RemotePrefill(
                engine=self.engine,
                connector=connector,
                client=client,
                estimate=self.remote_estimate,
                timeout_s=t.timeout_s,
                model_name=self.model_name,
                metrics=self.metrics,
            )
            if client is not None and connector is not None
            else None  # no prefill pool: every prompt is prefilled here
        )
        self._counts = {"local": 0, "remote": 0, "shed": 0}
        self._open_streams = 0
        self._itl = Ema()
        self.admission = DecodeAdmission.from_config(self.cfg)
        self._output_tokens = Ema()
        self._admitted_prompt_tokens = RateMeter()
        # Demand for the autoscaling policy: requests admitted here, and requests turned away
        # for lack of capacity (this replica's sheds, and those the ingress reports).
        self._admitted = RateMeter()
        self._turned_away = RateMeter()
        self._warmups: set[asyncio.Task[bool]] = set()
        if isinstance(client, ServePrefillClient):
            start_warm_up(client.warm_up, "prefill", self._warmups)

    # ------------------------------------------------------------------ request path
    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's tokens; the last chunk has ``finish_reason`` or ``error``."""
        start = time.time()
        if req.arrival_time is not None:
            self.metrics.queue_time.observe(max(0.0, start - req.arrival_time))
        if req.admit_by is not None and start > req.admit_by:
            # The ingress answered it 429 already (its decision came too late): no work,
            # and not counted (the ingress counted the shed and the demand).
            yield GenerateChunk.overloaded(req, "overloaded (admission_timeout)", MIN_DRAIN_S)
            return
        self._open_streams += 1
        attrs = {
            tracing.REQUEST_MAX_TOKENS: req.sampling.max_tokens,
            tracing.REQUEST_TEMPERATURE: req.sampling.temperature,
            tracing.USAGE_INPUT_TOKENS: len(req.prompt_token_ids),
        }
        try:
            with tracing.span(
                "decode", self.model_name, carrier=req.trace_carrier, attributes=attrs
            ) as span:
                decision, cached = self._decide(req)
                verdict = self._admit(req, decision, cached, start)
                span.set_attribute("pdserve.admission.predicted_ttft_s", verdict.predicted_ttft_s)
                span.set_attribute("pdserve.admission.decision", verdict.action)
                span.set_attribute("pdserve.admission.reason", verdict.reason)
                if verdict.action == "shed":
                    yield self._shed(req, verdict)
                    return
                if req.admit_by is not None:
                    yield GenerateChunk.admitted(req, self.replica)
                self.metrics.record_decision(decision.location)
                span.set_attribute("pdserve.prefill.location", decision.location)
                span.set_attribute("pdserve.prefill.reason", decision.reason)
                try:
                    async for chunk in self._stream(req, decision, start, span):
                        yield chunk
                finally:
                    self.admission.finished(req.request_id)
        finally:
            self._open_streams -= 1
            if self.remote is not None:
                self.remote.forget(req.request_id)

    def _decide(self, req: GenerateRequest) -> tuple[Decision, int]:
        """Where to prefill (the policy never sheds here: admission does), and the
        prompt's cached prefix tokens."""
        ids = req.prompt_token_ids
        stats = self.engine.stats()
        load = LocalLoad(
            queued_prefill_tokens=stats.queued_prefill_tokens,
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            num_running=stats.num_running,
            max_num_seqs=self.max_num_seqs,
        )
        short = len(ids) <= self.cfg.policy.local_prefill_max_tokens
        cached = 0 if short else self.engine.cached_prefix_tokens(ids)
        decision = self.policy.decide(
            num_prompt_tokens=len(ids),
            num_cached_tokens=cached,
            load=load,
            remote=self.remote_estimate if self.remote is not None else None,
        )
        return decision, cached

    def _admit(
        self, req: GenerateRequest, decision: Decision, cached: int, now: float
    ) -> AdmissionDecision:
        """Predict the TTFT from what is queued ahead here; admit or shed."""
        n = len(req.prompt_token_ids)
        verdict = self.admission.admit(
            AdmissionRequest(
                request_id=req.request_id,
                priority=req.priority,
                prompt_tokens=n,
                cached_tokens=cached,
                max_tokens=req.sampling.max_tokens,
                arrival_time=req.arrival_time,
                location=decision.location,
            ),
            ReplicaSignals(
                engine=self.engine.stats(),
                remote=self.remote_estimate if self.remote is not None else None,
                step_s=self._itl.value,
                mean_output_tokens=self._output_tokens.value,
            ),
            now,
        )
        if verdict.action == "admit":
            self._admitted_prompt_tokens.add(uncached_tokens(n, cached, decision.location))
            self._admitted.add(1)
            self.metrics.predicted_ttft.observe(verdict.predicted_ttft_s)
            if verdict.past_slo:
                self.metrics.record_admitted_past_slo(verdict.reason, req.priority)
        return verdict

    def _first_token(self, req: GenerateRequest, now: float, span: Any) -> float | None:
        """Score the admission prediction against the observed TTFT; the prediction (from
        arrival) goes to the ingress with the first token (None: not predicted)."""
        score = self.admission.first_token(req.request_id, now)
        if score is None:
            return None
        self.metrics.ttft_prediction_error.observe(abs(score.predicted_s - score.actual_s))
        span.set_attribute("pdserve.admission.actual_ttft_s", score.actual_s)
        return score.predicted_s

    def _shed(self, req: GenerateRequest, verdict: AdmissionDecision) -> GenerateChunk:
        self._counts["shed"] += 1
        self._turned_away.add(1)
        self.metrics.record_shed(verdict.reason, req.priority)
        retry = verdict.retry_after_s or 1.0
        message = (
            f"overloaded ({verdict.reason}): predicted time to first token "
            f"{verdict.predicted_ttft_s:.1f}s exceeds what a {req.priority} request "
            f"may wait (TTFT objective {self.cfg.slo.ttft_ms / 1000:.1f}s); "
            f"retry after {retry:g}s"
        )
        return GenerateChunk.overloaded(req, message, retry_after_s=retry, replica=self.replica)

    async def _stream(
        self, req: GenerateRequest, decision: Decision, start: float, span: Any
    ) -> AsyncIterator[GenerateChunk]:
        params = req.sampling.to_params()
        location = decision.location
        if location == "remote":
            assert self.remote is not None  # the policy never says remote without a pool
            outputs = self.remote.outputs(req, params)
        else:
            outputs = self.engine.generate(
                req.request_id,
                req.prompt_token_ids,
                params,
                arrival_time=start,
                on_added=functools.partial(self.admission.taken_in, req.request_id),
            )
        self._counts[location] += 1
        first_at: float | None = None
        last_at = start
        sent_any = False
        async with contextlib.aclosing(outputs) as stream:
            try:
                async for out in stream:
                    now = time.time()
                    extra: dict[str, Any] = {}
                    if out.new_token_ids:
                        if first_at is None:
                            first_at = now
                            self.metrics.time_to_first_token.observe(now - start)
                            extra["predicted_ttft_s"] = self._first_token(req, now, span)
                        else:
                            gap = (now - last_at) / len(out.new_token_ids)
                            self.metrics.inter_token_latency.observe(gap)
                            self._itl.add(gap)
                        last_at = now
                    if not sent_any:
                        extra["prefill_location"] = self._location(req, location)
                        extra["replica"] = self.replica
                    chunk = GenerateChunk.from_output(out, self.engine.tokenizer, **extra)
                    sent_any = True
                    if out.finished:
                        self._finish_metrics(out, start, first_at, now, span)
                    yield chunk
            except ValueError as err:
                if sent_any:
                    raise
                # The engine rejected the request before any token (e.g. prompt too long).
                yield GenerateChunk(
                    request_id=req.request_id,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    error=ErrorInfo(code=400, type="invalid_request_error", message=str(err)),
                )

    def _location(self, req: GenerateRequest, planned: str) -> str:
        if self.remote is None:
            return planned
        return self.remote.location(req.request_id, planned)

    def _finish_metrics(
        self, out: RequestOutput, start: float, first_at: float | None, now: float, span: Any
    ) -> None:
        n_out = out.num_output_tokens
        self._output_tokens.add(n_out)
        self.metrics.e2e_latency.observe(now - start)
        self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
        self.metrics.prefix_cache_queries.inc(out.num_prompt_tokens)
        if out.num_cached_tokens:
            self.metrics.prefix_cache_hits.inc(out.num_cached_tokens)
        if n_out:
            self.metrics.generation_tokens.inc(n_out)
        if first_at is not None and n_out > 1:
            self.metrics.time_per_output_token.observe((now - first_at) / (n_out - 1))
        span.set_attribute(tracing.USAGE_OUTPUT_TOKENS, n_out)
        span.set_attribute(tracing.RESPONSE_FINISH_REASONS, [out.finish_reason or "unknown"])

    # ------------------------------------------------------------------ Serve hooks
    def record_routing_stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        self.metrics.record_load(
            running=stats.num_running,
            waiting=stats.num_waiting + stats.num_waiting_remote_kv,
            kv_usage=stats.kv_usage,
        )
        return replica_stats(
            "decode",
            stats,
            max_num_seqs=self.max_num_seqs,
            kv_bytes_per_token=self.kv_bytes_per_token,
            prompt_tokens_per_s=0.0,
            kv_events=kv_events.publish(self._kv_events),
        ).model_dump()

    def record_autoscaling_stats(self) -> dict[str, float]:
        refused = self.remote.kv_refused.rate() if self.remote is not None else 0.0
        stats = decode_autoscaling_stats(
            self.engine.stats(), self._itl.value, self._admitted_prompt_tokens.rate(), refused
        )
        stats[autoscaling.ADMITTED_PER_S] = self._admitted.rate()
        stats[autoscaling.TURNED_AWAY_PER_S] = self._turned_away.rate()
        return stats

    def report_turned_away(self, requests: int) -> None:
        """The ingress turned ``requests`` away for lack of capacity in this pool (on its
        drain hint, or Serve's queue for the pool full) since its last report: demand the
        pool never saw, counted in this replica's ``turned_away_per_s`` for the autoscaling
        policy (which sums the pool's replicas)."""
        if requests < 0:
            raise ValueError(f"requests must be >= 0, got {requests}")
        if requests:
            self._turned_away.add(requests)

    def check_health(self) -> None:
        self.engine.check_health()

    # ------------------------------------------------------------------ test/ops hooks
    def counters(self) -> DecodeCounters:
        obs = self.transfer_observer
        return DecodeCounters(
            **self._counts,
            fallbacks=self.remote.fallbacks if self.remote is not None else 0,
            kv_transfers=obs.transfers,
            kv_bytes_received=obs.bytes,
            kv_transfer_failures=obs.failures,
        )

    def num_open_streams(self) -> int:
        """Streams this replica is serving now (from the call until its last chunk)."""
        return self._open_streams

    def admission_report(self, last: int = 1000) -> AdmissionReport:
        """Predicted vs observed TTFT of the most recent admitted requests."""
        pairs = [(s.predicted_s, s.actual_s) for s in self.admission.scores][-last:]
        errors = [abs(p - a) for p, a in pairs]
        return AdmissionReport(
            num_observed=len(pairs),
            median_abs_error_s=statistics.median(errors) if errors else None,
            calibration=self.admission.calibration.value,
            samples=pairs,
        )

    async def check_integrity(self) -> IntegrityReport:
        """Engine queues and block ref counts consistent; reports what is still held."""
        await self.engine.check_integrity()
        stats = self.engine.stats()
        return IntegrityReport(
            role="decode",
            node_id=replica_node_id(),
            num_unfinished=stats.num_running + stats.num_waiting + stats.num_waiting_remote_kv,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            pending_transfers=self.remote.pending() if self.remote is not None else [],
            num_streams=self._open_streams,
            num_window_free_blocks=stats.num_window_free_blocks,
            num_window_total_blocks=stats.num_window_total_blocks,
            **runtime_report(self.engine),
        )

    def shutdown(self) -> None:
        """Release the shared KV segment, stop receiving KV, stop the engine (idempotent).

        The segment's name is unlinked first: it is the one thing that outlives the process
        (Ray kills a worker's child processes, guardian included, when the worker exits),
        and unlinking is safe while the pool is still mapped here.
        """
        if self._allocator is not None:
            self._allocator.close()
        if self.remote is not None:
            self.remote.close()
        self.engine.shutdown()

    def __del__(self) -> None:  # Serve calls this when it stops the replica
        with contextlib.suppress(Exception):
            self.shutdown()


def _shared_allocator(cfg: AppConfig) -> Any:
    """A shared-memory KV allocator when the pool is on CPU and shm may be offered."""
    if cfg.transport.kind not in ("auto", "shm"):
        return None
    device = cfg.model.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        return None
    from pdserve.kvtransfer.shm import SharedKVAllocator

    return SharedKVAllocator()
