"""pdserve's Prometheus metrics, exported through Ray's metrics agent (``ray.util.metrics``).

Names follow vLLM's set with the ``pdserve:`` prefix (ECOSYSTEM.md); through Ray they show
up as ``ray_pdserve_*``. Every metric carries ``model_name``, ``role`` (prefill|decode|
ingress) and ``replica``; ``pdserve:disagg_decisions`` adds ``decision`` (local|remote).
With metrics disabled every recorder is a no-op, so call sites never branch.
"""

from __future__ import annotations

from typing import Any

LATENCY_BUCKETS_S = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
BYTES_BUCKETS = [2.0**k for k in range(10, 34, 2)]
BASE_TAGS = ("model_name", "role", "replica")


class _Null:
    """Stands in for a Ray metric when metrics are disabled."""

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        pass

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        pass

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        pass


class ServingMetrics:
    """All metrics one replica records; construct once per replica process."""

    def __init__(self, *, model_name: str, role: str, replica: str, enabled: bool = True) -> None:
        self.enabled = enabled
        self._tags = {"model_name": model_name, "role": role, "replica": replica}
        self.time_to_first_token = self._histogram(
            "pdserve:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS_S
        )
        self.inter_token_latency = self._histogram(
            "pdserve:inter_token_latency_seconds", "Gap between output tokens.", LATENCY_BUCKETS_S
        )
        self.time_per_output_token = self._histogram(
            "pdserve:request_time_per_output_token_seconds",
            "Mean time per output token of a finished request.",
            LATENCY_BUCKETS_S,
        )
        self.e2e_latency = self._histogram(
            "pdserve:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS_S
        )
        self.queue_time = self._histogram(
            "pdserve:request_queue_time_seconds",
            "Time from arrival until the prefill started.",
            LATENCY_BUCKETS_S,
        )
        self.prompt_tokens = self._counter("pdserve:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = self._counter("pdserve:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = self._counter(
            "pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = self._counter(
            "pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_requests_running = self._gauge(
            "pdserve:num_requests_running", "Requests in the running batch."
        )
        self.num_requests_waiting = self._gauge(
            "pdserve:num_requests_waiting", "Requests waiting (incl. for remote KV)."
        )
        self.kv_cache_usage = self._gauge(
            "pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)."
        )
        self.kv_transfer_seconds = self._histogram(
            "pdserve:kv_transfer_seconds",
            "Duration of one request's KV transfer.",
            LATENCY_BUCKETS_S,
        )
        self.kv_transfer_bytes = self._counter(
            "pdserve:kv_transfer_bytes", "KV bytes moved between replicas."
        )
        self.kv_transfer_failures = self._counter(
            "pdserve:kv_transfer_failures", "KV transfers that failed or missed their deadline."
        )
        self.disagg_decisions = self._counter(
            "pdserve:disagg_decisions", "Prefill placement decisions.", ("decision",)
        )
        self.prefill_fallbacks = self._counter(
            "pdserve:prefill_fallbacks", "Remote prefills recomputed locally after a failure."
        )
        self.requests_shed = self._counter(
            "pdserve:requests_shed", "Requests rejected because no placement met the SLO."
        )

    def record_decision(self, decision: str) -> None:
        self.disagg_decisions.inc(1.0, {"decision": decision})

    def record_load(self, *, running: int, waiting: int, kv_usage: float) -> None:
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_usage.set(kv_usage)

    def _histogram(self, name: str, description: str, buckets: list[float]) -> Any:
        if not self.enabled:
            return _Null()
        from ray.util.metrics import Histogram

        metric = Histogram(name, description, boundaries=buckets, tag_keys=BASE_TAGS)
        metric.set_default_tags(self._tags)
        return metric

    def _counter(self, name: str, description: str, extra_tags: tuple[str, ...] = ()) -> Any:
        if not self.enabled:
            return _Null()
        from ray.util.metrics import Counter

        metric = Counter(name, description, tag_keys=BASE_TAGS + extra_tags)
        metric.set_default_tags(self._tags)
        return metric

    def _gauge(self, name: str, description: str) -> Any:
        if not self.enabled:
            return _Null()
        from ray.util.metrics import Gauge

        metric = Gauge(name, description, tag_keys=BASE_TAGS)
        metric.set_default_tags(self._tags)
        return metric
