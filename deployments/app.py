"""The application builder: ``AppConfig`` -> a Serve application ingress -> decode -> prefill.

Usable three ways:
- Python: ``serve.run(build_app(AppConfig(...)))``;
- Serve config YAML (``serve run`` / ``serve deploy`` / KubeRay ``serveConfigV2``):
  ``import_path: pdserve.deployments.app:build_app`` with ``args:`` holding ``AppConfig`` fields;
- tests: ``build_application(config, engine_factory=...)`` injects a different engine.

Each pool gets its node-pool ``label_selector``, CPUs/GPUs, its request router
(``request_router_config``) and, when its replica count may vary, pdserve's custom
autoscaling policy. A pool with ``tensor_parallel_size`` > 1 also gets a placement group per
replica: one bundle per rank, STRICT_PACK on one node of the pool (``placement_options``).
Nothing here starts Ray or reads environment variables.
"""

from __future__ import annotations

import math
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from pdserve.deployments.autoscaling import APPLICATION_POLICY_PATH, POLICY_PATHS
from pdserve.deployments.config import AppConfig, PoolConfig, PoolRole
from pdserve.deployments.engine_factory import EngineFactory

PREFILL_DEPLOYMENT = "PrefillServer"
DECODE_DEPLOYMENT = "DecodeServer"
INGRESS_DEPLOYMENT = "OpenAIIngress"


def build_app(config: AppConfig | dict[str, Any] | None) -> Application:
    """Serve application builder (exactly one parameter, as Serve requires)."""
    return build_application(config)


def build_application(
    config: AppConfig | dict[str, Any] | None,
    *,
    engine_factory: EngineFactory | None = None,
    with_ingress: bool = True,
) -> Application:
    """Build the app; ``with_ingress=False`` returns the decode deployment as the root
    (tests and benchmarks that talk to ``DecodeServer.generate`` directly)."""
    cfg = config if isinstance(config, AppConfig) else AppConfig.from_dict(config)
    model_dir = cfg.model.resolve_path()
    cfg_data = cfg.model_dump(mode="json")  # replicas get plain data; they re-validate it
    # The autoscaling policies record pdserve_pool_replicas under this model name.
    gauge_model = cfg.model.served_name(model_dir) if cfg.observability.metrics_enabled else None

    from pdserve.deployments.decode_server import DecodeServer
    from pdserve.deployments.prefill_server import PrefillServer

    prefill = None
    if cfg.policy.mode != "always_local":
        prefill = serve.deployment(
            name=PREFILL_DEPLOYMENT, **deployment_options(cfg, "prefill", gauge_model)
        )(PrefillServer).bind(cfg_data, model_dir, engine_factory)
    decode = serve.deployment(
        name=DECODE_DEPLOYMENT, **deployment_options(cfg, "decode", gauge_model)
    )(DecodeServer).bind(cfg_data, model_dir, prefill, engine_factory)
    if not with_ingress:
        return decode

    from pdserve.deployments.admission.front_door import FrontDoorSettings
    from pdserve.deployments.door_gate import INGRESS_REPLICA_ENV
    from pdserve.deployments.ingress import OpenAIIngress

    ready = [DECODE_DEPLOYMENT] + ([PREFILL_DEPLOYMENT] if prefill is not None else [])
    return serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=cfg.ingress_replicas,
        ray_actor_options={
            "num_cpus": cfg.ingress_num_cpus,
            "runtime_env": {"env_vars": dict(INGRESS_REPLICA_ENV)},
        },
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        **ingress_bounds(cfg),
    )(OpenAIIngress).bind(
        decode,
        model_dir,
        model_name=cfg.model.served_name(model_dir),
        max_model_len=cfg.decode.engine.max_model_len,
        ready_deployments=ready,
        observability=cfg.observability,
        api=cfg.api,
        door=FrontDoorSettings.from_config(cfg),
        max_migrations=cfg.max_migrations,
    )


def ingress_bounds(cfg: AppConfig) -> dict[str, Any]:
    """Serve's bounds on the front door: an ingress replica holds at most as many requests
    as the decode pool admits (``AppConfig.ingress_ongoing_limit``), and Serve's HTTP proxy
    queues a few more (``ingress_queued_limit``), then refuses with 429 + Retry-After
    (gRPC RESOURCE_EXHAUSTED) itself. Without them a flood the front door cannot keep up
    with waits, unbounded and unseen by admission control, in the proxy."""
    return {
        "max_ongoing_requests": cfg.ingress_ongoing_limit,
        "max_queued_requests": cfg.ingress_queued_limit,
        "backpressure_config": BackpressureConfig(
            status_code=429, retry_after_s=float(math.ceil(cfg.slo.ttft_ms / 1000.0))
        ),
    }


def deployment_options(
    cfg: AppConfig, role: PoolRole, model_name: str | None = None
) -> dict[str, Any]:
    """``Deployment.options`` for one pool: placement, resources, routing, scaling
    (``model_name``: the autoscaling policy records the pool's replica counts under it)."""
    pool = cfg.pool(role)
    gpus = cfg.gpus_per_rank(role)
    options: dict[str, Any] = {
        # With tensor parallelism the replica actor is rank 0: exactly bundle 0.
        "ray_actor_options": actor_options(pool, role, gpus),
        **placement_options(pool, role, gpus),
        # Bounds from the engine limits: a flood waits in Serve's queue only up to
        # max_queued_requests per caller, then gets back-pressure; admission control on
        # the decode replica sheds the rest with 429 before any work.
        "max_ongoing_requests": pool.ongoing_limit,
        "max_queued_requests": pool.queued_limit,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        # Graceful drain (scale-down, redeploy): Serve stops routing to the replica, then
        # waits for its ongoing requests (streams until their last token; a prefill until
        # its KV has landed) up to this grace period; checking every half second lets an
        # idle replica exit at once.
        "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if cfg.router.enabled:
        options["request_router_config"] = router_config(cfg, role)
    if pool.min_replicas == pool.max_replicas:
        options["num_replicas"] = pool.min_replicas
    else:
        options["autoscaling_config"] = autoscaling_config(cfg, role, model_name)
    return options


def actor_options(
    pool: PoolConfig, role: PoolRole, num_gpus: float | None = None
) -> dict[str, Any]:
    """A replica actor's Ray resources: one rank's (the whole replica's without tensor
    parallelism); ``num_gpus`` is ``AppConfig.gpus_per_rank`` (the pool's own setting, or 1
    on a GPU node type when unset)."""
    if num_gpus is None:
        num_gpus = (
            pool.num_gpus if pool.num_gpus is not None else float(pool.accelerator_type is not None)
        )
    options: dict[str, Any] = {"num_cpus": pool.num_cpus, "num_gpus": num_gpus}
    selector = pool.label_selector(role)
    if selector:
        options["label_selector"] = selector
    return options


def placement_options(pool: PoolConfig, role: PoolRole, num_gpus: float) -> dict[str, Any]:
    """Serve's placement-group options for a tensor-parallel pool (none when
    ``tensor_parallel_size`` is 1): a bundle per rank of the rank's CPUs and GPUs, all on one
    node (STRICT_PACK: the ranks all-reduce every layer), each bundle selecting the pool's
    nodes. Serve pins the replica actor (rank 0) in bundle 0, whose resources equal its
    ``ray_actor_options``; the engine starts ranks 1.. as actors in bundles 1.., which the
    replica's placement group captures. The actor keeps its own ``label_selector`` too (Ray
    applies it inside the bundle, and it names the same nodes)."""
    tp = pool.tensor_parallel_size
    if tp == 1:
        return {}
    bundle: dict[str, float] = {"CPU": float(pool.num_cpus)}
    if num_gpus:
        bundle["GPU"] = float(num_gpus)
    options: dict[str, Any] = {
        "placement_group_bundles": [dict(bundle) for _ in range(tp)],
        "placement_group_strategy": "STRICT_PACK",
    }
    selector = pool.label_selector(role)
    if selector:
        options["placement_group_bundle_label_selector"] = [dict(selector) for _ in range(tp)]
    return options


def router_config(cfg: AppConfig, role: PoolRole) -> RequestRouterConfig:
    from pdserve.deployments.routers import DecodeRequestRouter, PrefillRequestRouter

    r = cfg.router
    prefix = {"prefix_aware": r.prefix_aware, "history_ttl_s": r.prefix_history_ttl_s}
    if role == "prefill":
        cls: type = PrefillRequestRouter
        kwargs: dict[str, Any] = {
            "default_prefill_tokens_per_s": r.default_prefill_tokens_per_s,
            "transfer_bytes_per_s": r.transfer_bytes_per_s,
            "kv_bytes_per_token": r.kv_bytes_per_token,
            **prefix,
        }
    else:
        cls = DecodeRequestRouter
        kwargs = {
            "kv_weight": r.decode_kv_weight,
            "batch_weight": r.decode_batch_weight,
            "prefix_weight": r.prefix_weight,
            "max_imbalance": r.prefix_max_imbalance,
            **prefix,
        }
    # model_validate: Ray annotates the constructor's keyword arguments as dicts.
    return RequestRouterConfig.model_validate(
        {
            "request_router_class": cls,
            "request_router_kwargs": kwargs,
            "request_routing_stats_period_s": r.stats_period_s,
            "request_routing_stats_timeout_s": r.stats_timeout_s,
        }
    )


def autoscaling_config(
    cfg: AppConfig, role: PoolRole, model_name: str | None = None
) -> dict[str, Any]:
    pool = cfg.pool(role)
    config: dict[str, Any] = {
        "min_replicas": pool.min_replicas,
        "max_replicas": pool.max_replicas,
        "initial_replicas": pool.start_replicas,
        "target_ongoing_requests": pool.target_ongoing_requests,
        "upscale_delay_s": pool.upscale_delay_s,
        "downscale_delay_s": pool.downscale_delay_s,
    }
    if cfg.autoscaling:
        if role == "prefill":
            kwargs: dict[str, Any] = {
                "ttft_ms": cfg.slo.ttft_ms,
                "default_tokens_per_s": cfg.router.default_prefill_tokens_per_s,
                "down_margin": pool.scale_down_margin,
            }
        else:
            kwargs = {
                "tpot_ms": cfg.slo.tpot_ms,
                "max_num_seqs": pool.engine.max_num_seqs,
                "down_margin": pool.scale_down_margin,
            }
            # The prompts prefilled on the decode replicas size them against the TTFT SLO:
            # all of them without a prefill pool (the joint model with no prefill pool),
            # else those the policy kept local, whose queue must drain within the SLO.
            kwargs["ttft_ms"] = cfg.slo.ttft_ms
            kwargs["default_tokens_per_s"] = cfg.router.default_prefill_tokens_per_s
            kwargs["prefills_locally"] = cfg.policy.mode == "always_local"
        if model_name is not None:
            kwargs["model_name"] = model_name
        config["policy"] = {"policy_function": POLICY_PATHS[role], "policy_kwargs": kwargs}
    return config


def application_autoscaling_policy(cfg: AppConfig, model_name: str | None = None) -> dict[str, Any]:
    """The Serve config's ``applications[].autoscaling_policy`` that sizes both pools in one
    decision (``autoscaling.JointAutoscalingPolicy``). ``serve.run`` has no such option in
    Ray 2.60 (and ``pdserve serve`` deploys with ``serve.run``), so the Python path keeps
    the per-deployment policies, which share its model; either way the demand the ingress
    turns away reaches the decode pool's reports (``DecodeServer.report_turned_away``), since
    Serve collects custom metrics only from deployments that autoscale, which the ingress
    does not."""
    has_prefill = cfg.policy.mode != "always_local"
    return {
        "policy_function": APPLICATION_POLICY_PATH,
        "policy_kwargs": {
            "prefill_deployment": PREFILL_DEPLOYMENT if has_prefill else None,
            "decode_deployment": DECODE_DEPLOYMENT,
            "ttft_ms": cfg.slo.ttft_ms,
            "tpot_ms": cfg.slo.tpot_ms,
            "default_tokens_per_s": cfg.router.default_prefill_tokens_per_s,
            "max_num_seqs": cfg.decode.engine.max_num_seqs,
            "down_margin": cfg.decode.scale_down_margin,
            "model_name": model_name,
        },
    }
