"""pdserve's Prometheus metrics, exported through Ray's metrics agent (``ray.util.metrics``).

Names follow vLLM's set with a ``pdserve_`` prefix: ``pdserve_time_to_first_token_seconds``
where vLLM has ``vllm:time_to_first_token_seconds``. The ``:`` cannot be used: Ray 2.60
records metrics through OpenTelemetry, whose instrument names allow no ``:``, and such a
metric is silently never exported (checked on a local cluster: a ``pdserve:x`` counter never
reached the node's metrics endpoint, ``pdserve_x`` did). Ray adds its ``ray_`` prefix, and
Prometheus the usual suffixes: a histogram ``h`` is scraped as ``ray_h_bucket``/``_sum``/
``_count``, a counter ``c`` as ``ray_c_total``, a gauge ``g`` as ``ray_g`` (``exported_name``).

Every metric carries ``model_name``, ``role`` (prefill|decode|ingress) and ``replica``;
``pdserve_disagg_decisions`` adds ``decision`` (local|remote), ``pdserve_requests_shed``
and ``pdserve_requests_admitted_past_slo`` add ``reason`` and ``priority``
(interactive|batch), ``pdserve_engine_dtypes`` (always 1) ``weight_dtype`` and
``kv_cache_dtype``. The pools' replica
counts (``pdserve_pool_replicas{pool}``) are recorded by the autoscaling policy, in Serve's
controller, through ``PoolReplicaGauge``. With metrics disabled every recorder is a no-op,
so call sites never branch.
"""

from __future__ import annotations

from typing import Any, Literal

PREFIX = "pdserve_"
RAY_PREFIX = "ray_"
MetricKind = Literal["histogram", "counter", "gauge"]

LATENCY_BUCKETS_S = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
BASE_TAGS = ("model_name", "role", "replica")
DTYPE_TAGS = ("weight_dtype", "kv_cache_dtype")


def exported_name(name: str, kind: MetricKind) -> str:
    """The Prometheus family name a metric ``name`` gets on a Ray node's metrics endpoint
    (what a dashboard query or ``pdserve status`` looks for)."""
    suffix = "_total" if kind == "counter" else ""
    return f"{RAY_PREFIX}{name}{suffix}"


class _Null:
    """Stands in for a Ray metric when metrics are disabled."""

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        pass

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        pass

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        pass


class _Counter:
    """A Ray counter that accepts an increment of 0 as "nothing happened" (Ray raises on it,
    and a request with no output tokens must not fail while recording its metrics)."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value > 0:
            self._metric.inc(value, tags)


class ServingMetrics:
    """All metrics one replica records; construct once per replica process."""

    def __init__(self, *, model_name: str, role: str, replica: str, enabled: bool = True) -> None:
        self.enabled = enabled
        # Full metric name -> kind, for every metric below (tests, docs, scrapers).
        self.kinds: dict[str, MetricKind] = {}
        self._tags = {"model_name": model_name, "role": role, "replica": replica}
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Time to first token."
        )
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Gap between output tokens."
        )
        self.time_per_output_token = self._histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token of a finished request.",
        )
        self.e2e_latency = self._histogram(
            "e2e_request_latency_seconds", "End-to-end request latency."
        )
        self.queue_time = self._histogram(
            "request_queue_time_seconds", "Time from arrival until the prefill started."
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_requests_running = self._gauge(
            "num_requests_running", "Requests in the running batch."
        )
        self.num_requests_waiting = self._gauge(
            "num_requests_waiting", "Requests waiting (incl. for remote KV)."
        )
        self.kv_cache_usage = self._gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)."
        )
        self.kv_transfer_seconds = self._histogram(
            "kv_transfer_seconds", "Duration of one request's KV transfer."
        )
        self.kv_transfer_bytes = self._counter(
            "kv_transfer_bytes", "KV bytes moved between replicas."
        )
        self.kv_transfer_failures = self._counter(
            "kv_transfer_failures", "KV transfers that failed or missed their deadline."
        )
        self.kv_transfer_skipped_blocks = self._counter(
            "kv_transfer_skipped_blocks",
            "Prompt KV blocks a remote prefill did not move: the decode side held them.",
        )
        self.kv_transfer_skipped_bytes = self._counter(
            "kv_transfer_skipped_bytes",
            "KV bytes a remote prefill did not move: the prefix blocks the decode side held, "
            "and a window pool's blocks before the first decoded token's window.",
        )
        self.disagg_decisions = self._counter(
            "disagg_decisions", "Prefill placement decisions.", ("decision",)
        )
        self.prefill_fallbacks = self._counter(
            "prefill_fallbacks", "Remote prefills recomputed locally after a failure."
        )
        self.requests_shed = self._counter(
            "requests_shed",
            "Requests answered 429 by admission control (predicted TTFT over the threshold).",
            ("reason", "priority"),
        )
        self.requests_admitted_past_slo = self._counter(
            "requests_admitted_past_slo",
            "Requests admitted although predicted over their TTFT threshold, by reason "
            "(queued_past_slo: the class queues; unmeasured: a cold pool's prior rate; "
            "idle_past_slo: nothing queued ahead, its own work is over the threshold).",
            ("reason", "priority"),
        )
        self.predicted_ttft = self._histogram(
            "predicted_time_to_first_token_seconds",
            "Admission control's predicted TTFT of admitted requests (from arrival).",
        )
        self.open_streams = self._gauge(
            "open_streams", "Streams an ingress holds open (admitted, not finished)."
        )
        self.stream_limit = self._gauge(
            "stream_limit",
            "An ingress's adaptive bound on its open streams (admission.StreamLimit).",
        )
        self.engine_dtypes = self._gauge(
            "engine_dtypes",
            "1, labelled with the replica engine's weight and KV cache dtypes.",
            DTYPE_TAGS,
        )
        self.ttft_prediction_error = self._histogram(
            "ttft_prediction_error_seconds",
            "|predicted - observed| TTFT of admitted requests (the prediction's error).",
        )

    def record_streams(self, num_open: int, limit: float | None) -> None:
        self.open_streams.set(num_open)
        if limit is not None:
            self.stream_limit.set(limit)

    def record_shed(self, reason: str, priority: str, n: int = 1) -> None:
        self.requests_shed.inc(float(n), {"reason": reason, "priority": priority})

    def record_admitted_past_slo(self, reason: str, priority: str) -> None:
        self.requests_admitted_past_slo.inc(1.0, {"reason": reason, "priority": priority})

    def record_decision(self, decision: str) -> None:
        self.disagg_decisions.inc(1.0, {"decision": decision})

    def record_dtypes(self, engine: object) -> None:
        """Once, when the engine is up: what its weights and KV cache are stored in (an
        engine without ``dtypes()``, a test's fake, records nothing)."""
        dtypes = getattr(engine, "dtypes", None)
        if dtypes is None:
            return
        weights, kv = dtypes()
        self.engine_dtypes.set(1.0, {"weight_dtype": weights, "kv_cache_dtype": kv})

    def record_load(self, *, running: int, waiting: int, kv_usage: float) -> None:
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_usage.set(kv_usage)

    def _histogram(self, name: str, description: str) -> Any:
        self.kinds[PREFIX + name] = "histogram"
        if not self.enabled:
            return _Null()
        from ray.util.metrics import Histogram

        metric = Histogram(
            PREFIX + name, description, boundaries=LATENCY_BUCKETS_S, tag_keys=BASE_TAGS
        )
        metric.set_default_tags(self._tags)
        return metric

    def _counter(self, name: str, description: str, extra_tags: tuple[str, ...] = ()) -> Any:
        self.kinds[PREFIX + name] = "counter"
        if not self.enabled:
            return _Null()
        from ray.util.metrics import Counter

        metric = Counter(PREFIX + name, description, tag_keys=BASE_TAGS + extra_tags)
        metric.set_default_tags(self._tags)
        return _Counter(metric)

    def _gauge(self, name: str, description: str, extra_tags: tuple[str, ...] = ()) -> Any:
        self.kinds[PREFIX + name] = "gauge"
        if not self.enabled:
            return _Null()
        from ray.util.metrics import Gauge

        metric = Gauge(PREFIX + name, description, tag_keys=BASE_TAGS + extra_tags)
        metric.set_default_tags(self._tags)
        return metric


class RoutingDecisions:
    """``pdserve_routing_decisions{pool, reason}``: the requests a pool's router placed, by
    why the replica won (``prefix_routing.RoutingReason``). Created lazily in the process
    that routes (a handle's owner), a no-op when disabled."""

    def __init__(self, pool: str, *, enabled: bool = True) -> None:
        self._pool = pool
        self._metric: Any = None
        if enabled:
            from ray.util.metrics import Counter

            self._metric = Counter(
                PREFIX + "routing_decisions",
                "Requests placed by a pool's router, by the reason the replica won.",
                tag_keys=("pool", "reason"),
            )

    def record(self, reason: str) -> None:
        if self._metric is not None:
            self._metric.inc(1.0, {"pool": self._pool, "reason": reason})


class PoolReplicaGauge:
    """``pdserve_pool_replicas{model_name, pool}``: the replica count Serve is scaling each
    pool to (its target after pdserve's autoscaling decisions, delays and bounds), and
    ``pdserve_pool_replicas_wanted{model_name, pool}``: the count pdserve's autoscaling
    policy sized the pool to at its last tick. Created lazily in the process that records
    them (Serve's controller)."""

    def __init__(self, model_name: str) -> None:
        from ray.util.metrics import Gauge

        tags = ("model_name", "pool")
        self._gauge = Gauge(
            PREFIX + "pool_replicas",
            "Replicas per pool: the target Serve scales the pool to.",
            tag_keys=tags,
        )
        self._wanted = Gauge(
            PREFIX + "pool_replicas_wanted",
            "Replicas per pool as sized by pdserve's autoscaling policy (before Serve's "
            "upscale/downscale delays and min/max bounds).",
            tag_keys=tags,
        )
        self._model = model_name

    def set(self, pool: str, replicas: int) -> None:
        self._gauge.set(float(replicas), {"model_name": self._model, "pool": pool})

    def set_wanted(self, pool: str, replicas: int) -> None:
        self._wanted.set(float(replicas), {"model_name": self._model, "pool": pool})


class APIMetrics:
    """The ingress's own Prometheus registry, served as text on the API port (GET /metrics)
    so that a scraper pointed at the API sees requests by route and status and the pools'
    readiness without going through Ray's metrics agent (which keeps ``ServingMetrics``)."""

    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self._model = model_name
        self._requests = Counter(
            f"{PREFIX}api_requests",
            "HTTP requests answered by the ingress, by route and status code.",
            ("model_name", "route", "status"),
            registry=self.registry,
        )
        self._latency = Histogram(
            f"{PREFIX}api_request_duration_seconds",
            "Time until the response headers were sent (streams: until the first byte).",
            ("model_name", "route"),
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._ready = Gauge(
            f"{PREFIX}api_pools_ready",
            "1 when every pool has a running replica (what /health answers), else 0.",
            ("model_name",),
            registry=self.registry,
        )

    def record_request(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(self._model, route, str(status)).inc()
        self._latency.labels(self._model, route).observe(seconds)

    def record_ready(self, ready: bool) -> None:
        self._ready.labels(self._model).set(1.0 if ready else 0.0)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
