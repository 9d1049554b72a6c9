"""The one typed configuration of a pdserve application (pydantic, strict, loadable from YAML).

``AppConfig`` describes the model, the two replica pools (prefill and decode), the SLOs,
the KV transport, the request routers, the disaggregation policy, observability and the
HTTP/gRPC front door. Unknown keys are rejected with the offending path in the message,
never dropped. This module imports neither Ray nor torch: the CLI and the Helm tests load
and validate configs without starting anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve.kernels.cpu.cpus import parse_cpu_list

PoolRole = Literal["prefill", "decode"]
POOL_LABEL_KEY = "pdserve.io/pool"
ACCELERATOR_LABEL_KEY = "ray.io/accelerator-type"
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "0:0:0:0:0:0:0:0"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(_Strict):
    """Which weights to serve and how they are named to clients."""

    path: str | None = Field(
        default=None,
        description=(
            "Local Hugging Face model directory (config.json, safetensors, tokenizer), e.g. "
            "a mounted PVC. None (and no hf_id/uri) = the deterministic test model, "
            "generated on first use."
        ),
    )
    hf_id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$",
        description=(
            "Hugging Face Hub repository ('org/name'), fetched into cache_dir before the "
            "replicas load (the chart's init containers, or `python -m "
            "pdserve.deployments.model_source fetch`); the engine never downloads. The "
            "token comes from HF_TOKEN. Clients see this id unless name is set."
        ),
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "Hub revision of hf_id (branch, tag or commit); None = 'main'. Pin a commit so "
            "that every node serves the same weights."
        ),
    )
    uri: str | None = Field(
        default=None,
        pattern=r"^[a-z][a-z0-9+.-]*://.+",
        description=(
            "Object-store prefix holding a model directory (s3://bucket/llama, gs://..., "
            "az://...; any fsspec URL whose backend is installed), fetched into cache_dir "
            "like hf_id; credentials from the environment."
        ),
    )
    cache_dir: str = Field(
        default="~/.cache/pdserve/models",
        min_length=1,
        description=(
            "Where hf_id/uri models are fetched to, per node (the chart mounts its model "
            "cache volume here)."
        ),
    )
    test_model: Literal["tiny", "small"] = Field(
        default="small",
        description="Which generated test model to use when path is None.",
    )
    name: str | None = Field(
        default=None,
        description="Model id shown to clients (/v1/models); None = the directory's name.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weight/activation dtype passed to the engine."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Engine device; 'auto' = cuda when the replica has a GPU."
    )
    quantization: Literal["int8", "int8-weight-only", "fp8"] | None = Field(
        default=None,
        description=(
            "Quantize a float checkpoint's linear layers at load (int8 = W8A8 with dynamic "
            "per-token activations, int8-weight-only = W8A16, fp8 = float8 e4m3 weights); "
            "None = as the checkpoint is. A checkpoint with a quantization_config is served "
            "quantized without it."
        ),
    )
    quantize_lm_head: bool = Field(
        default=False,
        description=(
            "Int8 weights (per output channel, weight-only) for the logits projection too "
            "(it stays float otherwise); CPU pools only for now."
        ),
    )
    impl: Literal["auto", "native", "transformers"] = Field(
        default="auto",
        description=(
            "Model code (EngineConfig.model_impl): 'native' = pdserve's own class (the Llama "
            "family, Qwen3, Qwen3-MoE, Mixtral), 'transformers' = transformers' modelling code "
            "on pdserve's paged attention (any decoder-only model whose attention goes "
            "through AttentionInterface), 'auto' = native where a class exists, else "
            "transformers."
        ),
    )
    seed: int = Field(default=0, description="Engine seed for unseeded sampling.")

    def resolve_path(self) -> str:
        """The model directory; generates the test model on first use (idempotent, safe to
        call from every replica: each node resolves the same deterministic model)."""
        if self.path is not None or self.hf_id is not None or self.uri is not None:
            from pdserve.deployments.model_source import resolve  # ModelSourceError names it

            return str(resolve(self))
        from pdserve.engine.testmodel import ensure_test_model  # torch: only when needed

        return str(ensure_test_model(self.test_model))

    def served_name(self, resolved_path: str) -> str:
        """The model id clients use: ``name``, ``pdserve-<size>`` for a generated test
        model (its cache directory carries a content hash), else the directory's name."""
        if self.name:
            return self.name
        if self.hf_id is not None:
            return self.hf_id
        if self.uri is not None:
            return self.uri.rstrip("/").rsplit("/", 1)[-1]
        if self.path is None:
            return f"pdserve-{self.test_model}"
        return Path(resolved_path).name

    @model_validator(mode="after")
    def _check_source(self) -> ModelSettings:
        if self.hf_id is not None and self.uri is not None:
            raise ValueError("model: give one source, hf_id or uri, not both")
        if self.revision is not None and self.hf_id is None:
            raise ValueError("model.revision applies to hf_id only")
        if self.path is not None and (self.hf_id is not None or self.uri is not None):
            from pdserve.deployments.model_source import cache_path

            # Allowed only as a pinned copy: a launcher that resolved the hub/uri model
            # already may hand replicas its cache directory as path.
            if Path(self.path) != cache_path(self):
                raise ValueError("model: give one source, path or hf_id/uri, not both")
        return self


class EngineLimits(_Strict):
    """Per-replica engine sizing (maps onto ``pdserve.engine.config.EngineConfig``)."""

    num_kv_blocks: int | None = Field(
        default=None, ge=1, description="KV blocks per replica; None = profiled by the engine."
    )
    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV block.")
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, description="Token budget of one engine step (batch token budget)."
    )
    max_num_seqs: int = Field(default=64, ge=1, description="Most sequences running at once.")
    max_model_len: int | None = Field(
        default=None, ge=1, description="Longest prompt + output; None = model's max positions."
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse KV blocks of identical prompt prefixes."
    )
    cuda_graphs: bool = Field(
        default=True,
        description="On a GPU, replay decode steps from CUDA graphs (false = every step eager).",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "int8"] = Field(
        default="auto",
        description=(
            "KV cache element type (EngineConfig.kv_cache_dtype): 'auto' = the model's dtype; "
            "'fp8_e4m3' / 'int8' = one byte per element with per-layer, per-head scales: "
            "twice the blocks in the same memory, half the bytes per hand-off. The prefill "
            "and decode pools must agree (the hand-off moves the cache as it is)."
        ),
    )


class CpuSettings(_Strict):
    """How a CPU engine replica uses its node's CPUs (the CPU runtime of ``pdserve.kernels``).

    Ignored, with one log line, by replicas whose engine runs on a GPU.
    """

    nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description=(
            "Niceness added to the replica's process (0 = unchanged). Where the pools share "
            "CPUs, a niced prefill pool lets decode steps win the cores: steady TPOT while "
            "long prompts are prefilled next door."
        ),
    )
    engine_nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description=(
            "Niceness (at least) of the engine's compute threads only: its step thread and "
            "the OpenMP threads it starts; the replica's serving threads (Ray, the "
            "event loop that admits requests and streams tokens) keep theirs. Where engines "
            "share a node's CPUs with the Serve proxy and the ingress, a niced engine lets "
            "the front door run first: under overload a request still reaches admission "
            "control and gets its 429 at once, instead of queueing unseen in the proxy "
            "behind the engine's steps. 0 = unchanged."
        ),
    )
    cpu_bind: str = Field(
        default="auto",
        description=(
            "CPUs the replica's engine threads are bound to: 'auto' = the engine CPUs the "
            "node reserved in $PDSERVE_ENGINE_CPUS (`pdserve up` sets it; unbound when "
            "unset; replicas of one node share them), 'none' = never bind, or a CPU list "
            "such as '2-3'. Bound replicas run at most one torch thread per CPU."
        ),
    )
    helper_threads: int = Field(
        default=0,
        ge=0,
        description=(
            "Engines bound to their CPUs: OpenMP threads added on the process's other "
            "(shared) CPUs, niced, for steps of at least helper_min_tokens tokens. On a "
            "small node they turn the serving CPUs' idle time into prefill compute; the "
            "linears hand out work dynamically, so a preempted helper costs little. 0 = none."
        ),
    )
    helper_min_tokens: int = Field(
        default=32,
        ge=1,
        description="Smallest step (in tokens) that the helper threads join.",
    )

    @field_validator("cpu_bind")
    @classmethod
    def _check_cpu_bind(cls, value: str) -> str:
        if value not in ("auto", "none"):
            parse_cpu_list(value)  # ValueError naming the list
        return value


class PoolConfig(_Strict):
    """One replica pool (prefill or decode): size, placement, resources, engine limits."""

    min_replicas: int = Field(default=1, ge=0, description="Autoscaling lower bound.")
    max_replicas: int = Field(default=1, ge=1, description="Autoscaling upper bound.")
    initial_replicas: int | None = Field(
        default=None, ge=0, description="Replicas at deploy time; None = min_replicas."
    )
    node_labels: dict[str, str] | None = Field(
        default=None,
        description=(
            "Ray label selector for this pool's replicas; None = "
            "{'pdserve.io/pool': <role>}. Use {} to place anywhere."
        ),
    )
    accelerator_type: str | None = Field(
        default=None,
        description="GPU type (e.g. 'H100'); adds 'ray.io/accelerator-type' to the selector.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description=(
            "Ranks each replica's model is split over (tensor parallelism), all on one node: "
            "the replica gets a placement group of this many bundles of num_cpus CPUs and "
            "num_gpus GPUs each (strategy STRICT_PACK); rank 0 runs in the replica's process "
            "(bundle 0), ranks 1.. are Ray actors the engine starts in the other bundles. "
            "1 = one process, no placement group."
        ),
    )
    num_cpus: float = Field(
        default=1.0,
        gt=0,
        description=(
            "CPUs per rank (= per replica when tensor_parallel_size is 1); also each rank's "
            "torch threads. A replica reserves tensor_parallel_size x this on its node."
        ),
    )
    num_gpus: float | None = Field(
        default=None,
        ge=0,
        description=(
            "GPUs per rank (= per replica when tensor_parallel_size is 1; a replica reserves "
            "tensor_parallel_size x this on its node). None = 1 when the pool runs on CUDA "
            "(model.device 'cuda', or 'auto' with an accelerator_type), else 0 (see "
            "AppConfig.gpus_per_rank). With tensor_parallel_size > 1 it must be 0 or 1: "
            "each rank drives one whole GPU."
        ),
    )
    cpu: CpuSettings = Field(
        default_factory=CpuSettings,
        description="CPU engines: niceness, CPU binding, helper threads (ignored on a GPU).",
    )
    max_ongoing_requests: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Serve's per-replica cap on in-flight requests; None = 4 x engine.max_num_seqs. "
            "On a decode replica admission control keeps only part of it admitted "
            "(AdmissionConfig.max_admitted), so a shed request always finds a slot and gets "
            "its 429 without queueing."
        ),
    )
    max_queued_requests: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Serve's cap on requests one caller (an ingress or decode replica) queues for "
            "this pool while every replica is at its ongoing cap; past it the caller gets "
            "back-pressure at once, so a flood cannot grow memory without bound. None = 4 x "
            "the ongoing cap."
        ),
    )
    scale_down_margin: float = Field(
        default=0.25,
        ge=0,
        lt=1,
        description=(
            "Autoscaling hysteresis: the pool shrinks only when its load would fit the "
            "smaller pool with this fraction of the targets to spare."
        ),
    )
    target_ongoing_requests: float = Field(
        default=8.0, gt=0, description="Fallback autoscaling target when no custom stats yet."
    )
    upscale_delay_s: float = Field(default=10.0, ge=0, description="Autoscaler upscale delay.")
    downscale_delay_s: float = Field(default=60.0, ge=0, description="Autoscaler downscale delay.")
    engine: EngineLimits = Field(
        default_factory=EngineLimits, description="Engine limits of each replica."
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> PoolConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must not exceed "
                f"max_replicas ({self.max_replicas})"
            )
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError(
                f"initial_replicas ({self.initial_replicas}) must lie in "
                f"[min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]"
            )
        if self.accelerator_type is not None and self.num_gpus == 0:
            raise ValueError("accelerator_type is set but num_gpus is 0: give the pool GPUs")
        tp = self.tensor_parallel_size
        if tp > 1 and self.num_gpus is not None and self.num_gpus not in (0, 1):
            if self.num_gpus < 1:
                reason = (
                    "a fraction would put several ranks of one replica on one GPU, and each "
                    "rank (one NCCL peer) needs a GPU of its own"
                )
            else:
                reason = "a rank drives one GPU, so the others would sit idle"
            raise ValueError(
                f"num_gpus ({self.num_gpus:g}) with tensor_parallel_size {tp}: num_gpus is "
                f"per rank and must be 1 (or 0 on a CPU); {reason}. A replica of this pool "
                f"spans tensor_parallel_size = {tp} GPUs with num_gpus: 1"
            )
        if self.node_labels:
            for key in self.node_labels:
                if key.startswith("ray.io/") and key != ACCELERATOR_LABEL_KEY:
                    raise ValueError(f"node_labels: the 'ray.io/' prefix is reserved ({key!r})")
        return self

    @property
    def ongoing_limit(self) -> int:
        """``max_ongoing_requests``, or the value derived from the engine limits."""
        return self.max_ongoing_requests or 4 * self.engine.max_num_seqs

    @property
    def queued_limit(self) -> int:
        return self.max_queued_requests or 4 * self.ongoing_limit

    @property
    def start_replicas(self) -> int:
        return self.min_replicas if self.initial_replicas is None else self.initial_replicas

    def label_selector(self, role: PoolRole) -> dict[str, str]:
        """The Ray ``label_selector`` for this pool's replicas."""
        selector: dict[str, str] = (
            {POOL_LABEL_KEY: role} if self.node_labels is None else dict(self.node_labels)
        )
        if self.accelerator_type is not None:
            selector[ACCELERATOR_LABEL_KEY] = self.accelerator_type
        return selector


class SLOConfig(_Strict):
    """Latency objectives the routers, the policy and the autoscaler aim for."""

    ttft_ms: float = Field(default=2000.0, gt=0, description="Time-to-first-token target (ms).")
    tpot_ms: float = Field(default=200.0, gt=0, description="Time-per-output-token target (ms).")


class TransportConfig(_Strict):
    """How KV blocks move from prefill to decode replicas (maps onto KVTransferConfig)."""

    kind: Literal["auto", "shm", "torch_dist", "cuda_ipc"] = Field(
        default="auto",
        description=(
            "'auto' = chosen from where the two replicas are: shared memory (CPU) or CUDA IPC "
            "on one node, torch.distributed (gloo/NCCL) across nodes."
        ),
    )
    timeout_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Slack of a remote prefill past the compute the decode replica predicts for it "
            "(the prompts it sent ahead and this one, at the prefill engine's measured "
            "rate); past it decode recomputes the prompt locally."
        ),
    )
    connect_timeout_s: float = Field(
        default=10.0, gt=0, description="Bound on connecting to a peer (incl. group setup)."
    )
    host: str | None = Field(
        default=None,
        description=(
            "Address the KV listener binds to and advertises to prefill peers; None = the "
            "replica's Ray node address (the pod IP on Kubernetes, 127.0.0.2 locally). "
            "Wildcards (0.0.0.0, ::) are refused: peers need an address they can dial."
        ),
    )

    @model_validator(mode="after")
    def _check_host(self) -> TransportConfig:
        if self.host is not None and self.host.strip("[]") in WILDCARD_HOSTS:
            raise ValueError(
                f"transport.host: {self.host!r} is a wildcard; the KV listener must bind "
                "an address its peers can dial (leave it unset for the node's address)"
            )
        if self.host is not None and not self.host.strip():
            raise ValueError("transport.host: empty; leave it unset for the node's address")
        return self


class RouterConfig(_Strict):
    """Parameters of the TTFT-aware prefill router and the KV-aware decode router."""

    enabled: bool = Field(
        default=True, description="Use pdserve's request routers; False = Serve's default."
    )
    default_prefill_tokens_per_s: float = Field(
        default=2000.0,
        gt=0,
        description="Prefill rate assumed for a replica that has not measured one yet.",
    )
    transfer_bytes_per_s: float = Field(
        default=1.0e9, gt=0, description="KV transfer bandwidth used in the TTFT estimate."
    )
    kv_bytes_per_token: int = Field(
        default=0,
        ge=0,
        description="KV bytes per prompt token for the transfer estimate; 0 = from replica stats.",
    )
    decode_kv_weight: float = Field(
        default=1.0, ge=0, description="Decode router: weight of KV usage in the load score."
    )
    decode_batch_weight: float = Field(
        default=1.0, ge=0, description="Decode router: weight of batch fullness in the score."
    )
    prefix_aware: bool = Field(
        default=True,
        description="Route by the prompt's blocks each replica's prefix cache holds (KV "
        "events, and this router's own recent routings), weighed against load; False = "
        "load only.",
    )
    prefix_weight: float = Field(
        default=1.0,
        ge=0,
        description="Decode router: score bonus for holding the whole prompt (scaled by the "
        "fraction held), against the load score (KV usage + batch fullness, each up to 1).",
    )
    prefix_max_imbalance: int = Field(
        default=4,
        ge=0,
        description="Decode router: a replica running more than this many requests above "
        "the pool's least-loaded one gets no prefix bonus (a hot prefix cannot pile up).",
    )
    prefix_history_ttl_s: float = Field(
        default=30.0,
        ge=0,
        description="How long a router counts a prompt it routed as held by that replica "
        "when the replica's KV events have not said so (yet).",
    )
    stats_period_s: float = Field(
        default=0.5, gt=0, description="How often replicas publish routing stats."
    )
    stats_timeout_s: float = Field(
        default=2.0, gt=0, description="How long the router waits for a replica's stats."
    )


class PolicyConfig(_Strict):
    """Disaggregation policy: prefill locally on the decode replica, or remotely."""

    mode: Literal["auto", "always_remote", "always_local"] = Field(
        default="auto", description="'auto' = predict which is faster per request."
    )
    local_prefill_max_tokens: int = Field(
        default=64,
        ge=0,
        description="Prompts with at most this many uncached tokens prefill locally.",
    )
    local_when_saturated: bool = Field(
        default=True,
        description=(
            "In 'auto' mode, prefill a long prompt locally when the prefill pool is "
            "predicted to miss the TTFT SLO and local is faster. False keeps every long "
            "prompt off the decode batch (steady TPOT) at the cost of TTFT under load."
        ),
    )


class AdmissionConfig(_Strict):
    """Overload control: what the decode replicas admit or shed (``DecodeAdmission``) and
    what each ingress turns away at its door (``FrontDoor``)."""

    on_slo_miss: Literal["queue", "shed"] = Field(
        default="shed",
        description=(
            "Interactive requests whose predicted TTFT (everything queued ahead on the decode "
            "replica, see deployments/admission/) exceeds shed_ttft_factor x SLO: shed "
            "(429 + Retry-After from the predicted drain time) or queue anyway."
        ),
    )
    shed_ttft_factor: float = Field(
        default=1.5,
        ge=1,
        description=(
            "Shed an interactive request when its predicted TTFT exceeds this multiple of the "
            "SLO (prediction errors are what the gap between this and the target absorbs)."
        ),
    )
    adaptive_concurrency: bool = Field(
        default=True,
        description=(
            "With shedding on: each ingress bounds the streams it holds open by the time to "
            "first token it observes and its own event loop's lag (grow while first tokens "
            "come within half the TTFT SLO and the loop is quiet; cut when one comes past "
            "the SLO behind other streams, or when the loop lags while the door answers "
            "429s, never below the streams served in time; admission/stream_limit.py), and "
            "answers 429 past the bound. It covers the serving path the decode replica's "
            "prediction does not model (event loops, Ray transfers, HTTP writes)."
        ),
    )
    admission_timeout: bool = Field(
        default=False,
        description=(
            "With shedding on: the ingress answers 429 itself (reason admission_timeout) for a "
            "request the decode pool has not admitted or shed within half of "
            "reject_within_ms: a guard for a path to the decode replicas slower than the 429 "
            "budget. Off by default: the stream bound alone meets the 429 target, and each "
            "late decision cuts that bound, so it costs admissions (docs/tuning.md)."
        ),
    )
    reject_within_ms: float = Field(
        default=100.0,
        gt=0,
        description=(
            "How fast a shed request should get its 429 (p99). With adaptive_concurrency, an "
            "ingress answering 429s while its event loop lags a sixth of this on average "
            "cuts its stream bound: every 429 waits in that loop behind the streams it "
            "carries. With "
            "admission_timeout, a request the decode pool has not admitted or shed within "
            "half of this from its arrival gets its 429 from the ingress."
        ),
    )
    batch_on_slo_miss: Literal["queue", "shed"] = Field(
        default="shed",
        description=(
            "The same choice for batch requests (header x-pdserve-priority: batch); they "
            "queue behind nothing but count as work ahead of interactive requests."
        ),
    )
    batch_shed_ttft_factor: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Shed a batch request when its predicted TTFT exceeds this multiple of the SLO; "
            "below shed_ttft_factor so that under overload batch traffic is shed first."
        ),
    )
    max_queue_wait_factor: float = Field(
        default=4.0,
        gt=0,
        description=(
            "An interactive request that already waited (ingress + Serve's queue) this "
            "multiple of the TTFT SLO is dropped with 429 before it prefills: its client "
            "has given up."
        ),
    )
    batch_max_queue_wait_s: float = Field(
        default=120.0,
        gt=0,
        description="The same bound for batch requests, in seconds: batch may queue longer.",
    )

    def max_admitted(self, ongoing_limit: int) -> int:
        """Most requests a decode replica holds admitted under Serve's per-replica cap
        ``ongoing_limit`` before a class that sheds is shed whatever its prediction: half
        of it, so that the other half of Serve's slots stays free for answering 429s at
        once."""
        return max(1, ongoing_limit // 2)

    def admitted_per_replica(self, ongoing_limit: int) -> int:
        """The requests one decode replica takes at once: ``max_admitted`` while
        interactive traffic is shed, else its whole ongoing cap."""
        if self.on_slo_miss == "shed":
            return self.max_admitted(ongoing_limit)
        return ongoing_limit


# Keys that left ``policy`` for ``admission``: a config naming one there gets an error
# naming where it went, not "unknown field".
MOVED_TO_ADMISSION = (
    "on_slo_miss",
    "shed_ttft_factor",
    "adaptive_concurrency",
    "admission_timeout",
    "reject_within_ms",
    "batch_on_slo_miss",
    "batch_shed_ttft_factor",
    "max_queue_wait_factor",
    "batch_max_queue_wait_s",
)


class ObservabilityConfig(_Strict):
    """Tracing and metrics."""

    tracing_exporter: Literal["otlp", "console", "none"] = Field(
        default="none", description="OpenTelemetry span exporter."
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces endpoint; None = the OTEL_EXPORTER_OTLP_* defaults.",
    )
    service_name: str = Field(default="pdserve", description="OpenTelemetry service.name.")
    metrics_enabled: bool = Field(
        default=True,
        description="Export pdserve_* metrics through Ray's metrics agent (as ray_pdserve_*).",
    )


class APIConfig(_Strict):
    """The API's edge: who may call it and how much one request or one key may ask for.

    Keys also come from ``pdserve serve/run --api-key`` and the ``PDSERVE_API_KEYS``
    environment variable (comma-separated), which the CLI reads once and merges here.
    Limits are enforced per ingress replica (each keeps its own rate buckets).
    """

    api_keys: list[str] = Field(
        default_factory=list,
        description=(
            "Bearer keys accepted on every route (`Authorization: Bearer <key>`, or "
            "`x-api-key`); empty = no authentication. Compared in constant time."
        ),
    )
    chat_template: str | None = Field(
        default=None,
        description=(
            "Jinja chat template for a model whose tokenizer has none; None = chat "
            "requests to such a model get 400 (completions still work)."
        ),
    )
    open_health: bool = Field(
        default=True, description="Serve /health, /ready and /version without a key."
    )
    open_metrics: bool = Field(default=True, description="Serve /metrics without a key.")
    max_body_bytes: int = Field(
        default=4 * 2**20, ge=1024, description="Largest request body; larger gets 413."
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most prompt tokens per request (400 past it); None = the context length.",
    )
    max_messages: int = Field(
        default=512, ge=1, description="Most chat messages per request; more gets 400."
    )
    max_stop_strings: int = Field(
        default=16, ge=0, le=16, description="Most stop strings per request; more gets 400."
    )
    rate_limit_per_minute: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Requests per minute per API key (per client address without keys), as a "
            "token bucket; past it 429 with Retry-After. None = unlimited."
        ),
    )
    rate_limit_burst: int = Field(
        default=10, ge=1, description="Requests a key may send at once before the rate applies."
    )

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if len(key) < 8 or not key.isascii() or not key.isprintable() or " " in key:
                raise ValueError(
                    "api_keys: each key must be at least 8 printable ASCII characters "
                    f"without spaces (one key is not, length {len(key)}; not echoed: secret)"
                )
        return keys


class HTTPOptions(_Strict):
    """Serve's HTTP proxy."""

    host: str = Field(default="127.0.0.1", description="Address the HTTP proxy binds to.")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port; 0 = OS-chosen.")
    route_prefix: str = Field(default="/", description="Route prefix of the application.")


class GRPCOptions(_Strict):
    """Serve's gRPC proxy."""

    enabled: bool = Field(
        default=True,
        description="Serve the pdserve gRPC API (deployments/grpc/pdserve.proto) too.",
    )
    port: int = Field(
        default=9000,
        ge=0,
        le=65535,
        description="gRPC port; `pdserve serve` picks a free one unless this is set.",
    )


# Serve's queue for an ingress replica while its door sheds: the door's stream bound
# starts at 8 (``StreamLimit``), and what arrives past it at once is answered 429 either way,
# cheapest by Serve itself.
SHED_INGRESS_QUEUE = 8


class AppConfig(_Strict):
    """Everything a pdserve application needs: ``pdserve.deployments.app.build_app(AppConfig)``."""

    name: str = Field(default="pdserve", description="Serve application name.")
    model: ModelSettings = Field(default_factory=ModelSettings, description="Model to serve.")
    prefill: PoolConfig = Field(default_factory=PoolConfig, description="Prefill pool.")
    decode: PoolConfig = Field(default_factory=PoolConfig, description="Decode pool.")
    ingress_replicas: int = Field(default=1, ge=1, description="Ingress (HTTP/gRPC) replicas.")
    ingress_num_cpus: float = Field(
        default=0.0, ge=0, description="CPUs reserved per ingress replica."
    )
    ingress_max_ongoing_requests: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Serve's cap on requests one ingress replica holds at once, streams included. "
            "None = what the decode pool takes at decode.max_replicas, split over the "
            "ingress replicas: the requests its admission control admits "
            "(AdmissionConfig.max_admitted of each replica's ongoing cap) when interactive "
            "traffic is shed, its ongoing caps when it queues. Past it Serve's HTTP proxy "
            "queues up to ingress_max_queued_requests, then answers 429 itself."
        ),
    )
    ingress_max_queued_requests: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Requests one Serve proxy queues for a full ingress; past it the proxy refuses "
            "at once, without a hop to the ingress (HTTP 429 with a Retry-After of the TTFT "
            "SLO rounded up, gRPC RESOURCE_EXHAUSTED), so a flood the front door cannot "
            "take grows no queue there. Serve counts requests still being routed as queued, "
            "so this also bounds a burst arriving at once. None = 8 while interactive "
            "traffic is shed (admission.on_slo_miss: shed): the ingress's door would answer "
            "most of a burst 429 anyway, after a hop into its event loop that Serve's own "
            "refusal saves, and its stream bound starts at 8; one decode batch per decode "
            "replica (decode.engine.max_num_seqs x decode.max_replicas) when it queues."
        ),
    )
    slo: SLOConfig = Field(default_factory=SLOConfig, description="Latency objectives.")
    transport: TransportConfig = Field(default_factory=TransportConfig, description="KV transport.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="Request routers.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Disaggregation policy.")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig,
        description="Overload control: admission on the decode replicas, the ingress's door.",
    )
    graceful_shutdown_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "How long a stopping ingress, prefill or decode replica (scale-down, upgrade) "
            "waits for its in-flight requests, streams included, before it is killed; size "
            "it to the longest stream (max tokens x TPOT). The chart sets it from "
            "drain.timeoutSeconds."
        ),
    )
    autoscaling: bool = Field(
        default=True,
        description="Attach pdserve's custom autoscaling policies (min != max pools scale).",
    )
    observability: ObservabilityConfig = Field(
        default_factory=ObservabilityConfig, description="Tracing and metrics."
    )
    http: HTTPOptions = Field(default_factory=HTTPOptions, description="HTTP front door.")
    api: APIConfig = Field(
        default_factory=APIConfig, description="API keys, request size and rate limits."
    )
    grpc: GRPCOptions = Field(default_factory=GRPCOptions, description="gRPC front door.")
    max_migrations: int = Field(
        default=2,
        ge=0,
        description=(
            "How often one stream may move to another decode replica when the replica "
            "serving it dies (deployments/migration.py); past it the stream ends with a 503 "
            "error chunk. 0 = never migrate."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _reject_moved_keys(cls, data: Any) -> Any:
        policy = data.get("policy") if isinstance(data, dict) else None
        if isinstance(policy, dict):
            moved = [key for key in MOVED_TO_ADMISSION if key in policy]
            if moved:
                raise ValueError(
                    "; ".join(f"policy.{key} moved to admission.{key}" for key in moved)
                )
        return data

    @model_validator(mode="after")
    def _check_pools(self) -> AppConfig:
        if self.decode.min_replicas < 1:
            raise ValueError("decode.min_replicas must be >= 1: the decode pool serves requests")
        if self.policy.mode != "always_local" and self.prefill.max_replicas < 1:
            raise ValueError("prefill.max_replicas must be >= 1 unless policy.mode=always_local")
        kv_p, kv_d = self.prefill.engine.kv_cache_dtype, self.decode.engine.kv_cache_dtype
        if kv_p != kv_d and self.policy.mode != "always_local":
            raise ValueError(
                f"prefill.engine.kv_cache_dtype={kv_p!r} and decode.engine.kv_cache_dtype="
                f"{kv_d!r} differ: the KV hand-off moves the cache in its own dtype, so both "
                "pools must use the same one"
            )
        return self

    def pool(self, role: PoolRole) -> PoolConfig:
        return self.prefill if role == "prefill" else self.decode

    @property
    def ingress_ongoing_limit(self) -> int:
        """``ingress_max_ongoing_requests``, or what the decode pool takes per ingress."""
        if self.ingress_max_ongoing_requests is not None:
            return self.ingress_max_ongoing_requests
        per_replica = self.admission.admitted_per_replica(self.decode.ongoing_limit)
        total = self.decode.max_replicas * per_replica
        return max(1, -(-total // self.ingress_replicas))

    @property
    def ingress_queued_limit(self) -> int:
        """``ingress_max_queued_requests``, or ``SHED_INGRESS_QUEUE`` while interactive
        traffic is shed (docs/benchmarks.md, "Overload"), else one decode batch per decode
        replica."""
        if self.ingress_max_queued_requests is not None:
            return self.ingress_max_queued_requests
        if self.admission.on_slo_miss == "shed":
            return SHED_INGRESS_QUEUE
        return self.decode.engine.max_num_seqs * self.decode.max_replicas

    def gpus_per_rank(self, role: PoolRole) -> float:
        """What each rank of a replica (the replica itself without tensor parallelism) asks
        Ray for: ``num_gpus`` when set, else 1 on CUDA (``device: cuda``, or ``auto`` on a
        GPU node type) and 0 on a CPU."""
        pool = self.pool(role)
        if pool.num_gpus is not None:
            return pool.num_gpus
        return 1.0 if self.pool_device(role) == "cuda" else 0.0

    def gpus_per_replica(self, role: PoolRole) -> float:
        """GPUs one replica occupies on its node: ``gpus_per_rank`` x tensor_parallel_size."""
        return self.gpus_per_rank(role) * self.pool(role).tensor_parallel_size

    def pool_device(self, role: PoolRole) -> Literal["cpu", "cuda", "auto"]:
        """The device a pool's engines run on: ``model.device``, with 'auto' settled where
        the pool's resources say (GPUs given, or a GPU node type: cuda; none: cpu)."""
        device = self.model.device
        if device != "auto":
            return device
        pool = self.pool(role)
        if pool.num_gpus is None:
            return "cuda" if pool.accelerator_type is not None else "auto"
        return "cuda" if pool.num_gpus > 0 else "cpu"

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AppConfig:
        """Validate a mapping; errors name every offending field path."""
        try:
            return cls.model_validate(data or {})
        except ValidationError as err:
            raise ValueError(format_validation_error(err, "AppConfig")) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> AppConfig:
        """Load and validate a YAML file of ``AppConfig`` fields."""
        data = yaml.safe_load(Path(path).read_text())
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of AppConfig fields")
        try:
            return cls.model_validate(data or {})
        except ValidationError as err:
            raise ValueError(format_validation_error(err, str(path))) from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: ``source: a.b.c: message`` (unknown keys say so plainly)."""
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            lines.append(f"{source}: {where}: unknown field (not part of the config)")
        else:
            lines.append(f"{source}: {where}: {item['msg']}")
    return "invalid pdserve config\n" + "\n".join(lines)
