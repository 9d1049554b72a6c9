"""The application builder: Serve options per pool, and the Serve-config YAML path."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.build_app import build_app as serve_build_app
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from pdserve.deployments.app import build_app, build_application, deployment_options
from pdserve.deployments.autoscaling import DecodeAutoscalingPolicy, PrefillAutoscalingPolicy
from pdserve.deployments.config import AppConfig
from pdserve.deployments.routers import DecodeRequestRouter, PrefillRequestRouter

TINY = {"test_model": "tiny", "dtype": "float32", "device": "cpu"}


def test_pools_get_placement_resources_router_and_fixed_size() -> None:
    cfg = AppConfig.from_dict(
        {
            "prefill": {"num_cpus": 2, "num_gpus": 1, "accelerator_type": "L4"},
            "decode": {"num_cpus": 1, "min_replicas": 2, "max_replicas": 2},
        }
    )
    prefill = deployment_options(cfg, "prefill")
    assert prefill["ray_actor_options"] == {
        "num_cpus": 2.0,
        "num_gpus": 1.0,
        "label_selector": {"pdserve.io/pool": "prefill", "ray.io/accelerator-type": "L4"},
    }
    assert prefill["request_router_config"].request_router_class.endswith("PrefillRequestRouter")
    # TP=1 (the default): no placement group, the replica actor alone holds its resources.
    assert not {k for k in prefill if k.startswith("placement_group")}
    decode = deployment_options(cfg, "decode")
    assert decode["num_replicas"] == 2 and "autoscaling_config" not in decode
    assert decode["ray_actor_options"]["label_selector"] == {"pdserve.io/pool": "decode"}
    assert decode["request_router_config"].request_router_class.endswith("DecodeRequestRouter")


def test_tensor_parallel_pools_get_one_bundle_per_rank_on_one_node() -> None:
    cfg = AppConfig.from_dict(
        {
            "model": {"device": "cuda"},
            "prefill": {"num_cpus": 4, "accelerator_type": "H100", "tensor_parallel_size": 4},
            "decode": {"num_cpus": 2, "tensor_parallel_size": 2},
        }
    )
    prefill = deployment_options(cfg, "prefill")
    selector = {"pdserve.io/pool": "prefill", "ray.io/accelerator-type": "H100"}
    # The replica actor is rank 0: exactly bundle 0, as Serve requires.
    assert prefill["ray_actor_options"] == {
        "num_cpus": 4.0,
        "num_gpus": 1.0,
        "label_selector": selector,
    }
    assert prefill["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0}] * 4
    assert prefill["placement_group_strategy"] == "STRICT_PACK"
    assert prefill["placement_group_bundle_label_selector"] == [selector] * 4
    decode = deployment_options(cfg, "decode")
    assert decode["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0}] * 2
    assert decode["placement_group_bundle_label_selector"] == [{"pdserve.io/pool": "decode"}] * 2
    assert decode["ray_actor_options"]["num_gpus"] == 1.0
    # Bundles are separate objects (Serve and Ray may normalise them in place).
    assert decode["placement_group_bundles"][0] is not decode["placement_group_bundles"][1]


def test_a_tensor_parallel_cpu_pool_asks_for_no_gpu_and_may_place_anywhere() -> None:
    cfg = AppConfig.from_dict(
        {
            "model": {"device": "cpu"},
            "decode": {"num_cpus": 1.5, "tensor_parallel_size": 2, "node_labels": {}},
        }
    )
    decode = deployment_options(cfg, "decode")
    assert decode["placement_group_bundles"] == [{"CPU": 1.5}, {"CPU": 1.5}]
    assert decode["placement_group_strategy"] == "STRICT_PACK"
    assert "placement_group_bundle_label_selector" not in decode  # node_labels {}: anywhere
    assert decode["ray_actor_options"] == {"num_cpus": 1.5, "num_gpus": 0.0}


def test_serve_accepts_the_tensor_parallel_options() -> None:
    """Serve's own validation (ReplicaConfig: the actor fits bundle 0, the selectors match
    the bundles; DeploymentSchema: the config-file shape) takes the options as built."""
    from ray.serve.schema import DeploymentSchema

    cfg = AppConfig.from_dict(
        {
            "model": TINY,
            "prefill": {"tensor_parallel_size": 2, "num_cpus": 2},
            "decode": {
                "tensor_parallel_size": 4,
                "num_cpus": 0.5,
                "num_gpus": 1,
                "accelerator_type": "L4",
            },
        }
    )
    deployments = {d.name: d for d in _deployments(build_application(cfg))}
    for name, tp in (("PrefillServer", 2), ("DecodeServer", 4)):
        replica = deployments[name]._replica_config
        assert len(replica.placement_group_bundles) == tp
        assert replica.placement_group_strategy == "STRICT_PACK"
        assert len(replica.placement_group_bundle_label_selector) == tp
        assert replica.ray_actor_options["num_cpus"] == replica.placement_group_bundles[0]["CPU"]
    assert deployments["DecodeServer"]._replica_config.placement_group_bundles[0] == {
        "CPU": 0.5,
        "GPU": 1.0,
    }
    assert deployments["OpenAIIngress"]._replica_config.placement_group_bundles is None
    for role in ("prefill", "decode"):
        options = deployment_options(cfg, role)  # type: ignore[arg-type]
        schema = DeploymentSchema.model_validate(
            {
                "name": role,
                "ray_actor_options": options["ray_actor_options"],
                "placement_group_bundles": options["placement_group_bundles"],
                "placement_group_strategy": options["placement_group_strategy"],
                "placement_group_bundle_label_selector": options[
                    "placement_group_bundle_label_selector"
                ],
            }
        )
        assert schema.placement_group_strategy == "STRICT_PACK"


def test_scaling_pools_use_pdserve_policies_that_serve_can_load() -> None:
    cfg = AppConfig.from_dict(
        {
            "prefill": {"min_replicas": 1, "max_replicas": 4},
            "decode": {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 2},
            "slo": {"ttft_ms": 500, "tpot_ms": 40},
        }
    )
    for role, cls in (("prefill", PrefillAutoscalingPolicy), ("decode", DecodeAutoscalingPolicy)):
        options = deployment_options(cfg, role)  # type: ignore[arg-type]
        assert "num_replicas" not in options
        config = AutoscalingConfig(**options["autoscaling_config"])
        policy = _resolve_policy_callable(config.policy)  # what the Serve controller does
        assert isinstance(policy, cls)
    decode = AutoscalingConfig(**deployment_options(cfg, "decode")["autoscaling_config"])
    assert (decode.min_replicas, decode.max_replicas, decode.initial_replicas) == (1, 3, 2)
    prefill_policy = _resolve_policy_callable(
        AutoscalingConfig(**deployment_options(cfg, "prefill")["autoscaling_config"]).policy
    )
    assert prefill_policy.sizing.ttft_s == 0.5
    # The decode policy knows the TTFT SLO too: the prompts the disaggregation policy keeps
    # on decode replicas (prefill pool saturated) must drain within it.
    decode_policy = _resolve_policy_callable(decode.policy)
    assert decode_policy.knows_ttft and not decode_policy.prefills_locally


def test_routers_disabled_and_autoscaling_off_fall_back_to_serve_defaults() -> None:
    cfg = AppConfig.from_dict(
        {"router": {"enabled": False}, "autoscaling": False, "prefill": {"max_replicas": 3}}
    )
    options = deployment_options(cfg, "prefill")
    assert "request_router_config" not in options
    assert "policy" not in options["autoscaling_config"]


def test_serve_config_yaml_builds_the_app(tmp_path: Any) -> None:
    serve_config = yaml.safe_load(
        f"""
applications:
  - name: pdserve
    route_prefix: /
    import_path: pdserve.deployments.app:build_app
    args:
      model: {TINY}
      prefill: {{min_replicas: 1, max_replicas: 2}}
      policy: {{local_prefill_max_tokens: 16}}
"""
    )
    schema = ServeDeploySchema.model_validate(serve_config)
    args = schema.applications[0].args
    app = call_user_app_builder_with_args_if_necessary(build_app, args)
    deployments = {d.name: d for d in _deployments(app)}
    assert set(deployments) == {"OpenAIIngress", "DecodeServer", "PrefillServer"}
    prefill = deployments["PrefillServer"]
    assert prefill._deployment_config.autoscaling_config.max_replicas == 2
    router = prefill._deployment_config.request_router_config.get_request_router_class()
    assert router is PrefillRequestRouter
    decode_router = deployments["DecodeServer"]._deployment_config.request_router_config
    assert decode_router.get_request_router_class() is DecodeRequestRouter


def test_bad_args_fail_with_the_field_path() -> None:
    with pytest.raises(ValueError, match="decode.num_cpu: unknown field"):
        build_app({"model": TINY, "decode": {"num_cpu": 1}})


def test_always_local_deploys_no_prefill_pool() -> None:
    app = build_app({"model": TINY, "policy": {"mode": "always_local"}})
    assert {d.name for d in _deployments(app)} == {"OpenAIIngress", "DecodeServer"}


def _deployments(app: Any) -> list[Any]:
    """The deployments Serve would create for the application (its own graph builder)."""
    return serve_build_app(app, name="pdserve").deployments


def test_the_ingress_is_bounded_by_the_decode_pool_and_the_proxy_refuses_with_429() -> None:
    """A flood the front door cannot take waits nowhere unbounded: the ingress holds at most
    what the decode pool admits (half of each replica's ongoing cap, at max_replicas, split
    over the ingress replicas), Serve's proxy queues 8 more while the door sheds (one batch
    per decode replica while it queues), then answers 429 with a Retry-After of the TTFT
    SLO itself."""
    cfg: dict[str, Any] = {
        "model": TINY,
        "policy": {"mode": "always_local"},
        "ingress_replicas": 2,
        "slo": {"ttft_ms": 1500},
        "decode": {"min_replicas": 1, "max_replicas": 3, "engine": {"max_num_seqs": 8}},
    }

    def ingress_config(config: dict[str, Any]) -> Any:
        deployments = {d.name: d for d in _deployments(build_app(config))}
        return deployments["OpenAIIngress"]._deployment_config

    config = ingress_config(cfg)
    # Decode's ongoing cap is 4 x 8 = 32, it admits 16 of them; 3 replicas over 2 ingresses.
    assert config.max_ongoing_requests == 3 * 16 // 2
    assert config.max_queued_requests == 8  # the door's bound at start, not 8 x 3 batches
    assert config.backpressure_config.status_code == 429
    assert config.backpressure_config.retry_after_s == 2.0  # 1.5 s rounded up

    # Queueing interactive traffic: the ingress may hold the pool's whole ongoing caps.
    queueing = {**cfg, "policy": {"mode": "always_local"}, "admission": {"on_slo_miss": "queue"}}
    assert ingress_config(queueing).max_ongoing_requests == 3 * 32 // 2
    batch_queue = {**cfg, "decode": {**cfg["decode"], "engine": {"max_num_seqs": 16}}}
    assert ingress_config(batch_queue).max_queued_requests == 8  # shedding: not 16 x 3
    queueing16 = {**queueing, "decode": batch_queue["decode"]}
    assert ingress_config(queueing16).max_queued_requests == 16 * 3

    given = {**cfg, "ingress_max_ongoing_requests": 50, "ingress_max_queued_requests": 5}
    config = ingress_config(given)
    assert (config.max_ongoing_requests, config.max_queued_requests) == (50, 5)


def test_the_ingress_runs_its_code_on_serves_loop_with_the_edge_gate() -> None:
    """The ingress replica's environment: its code on Serve's own event loop (so that the
    edge gate on Serve's HTTP server may ask its door) and the edge gate named; the engine
    pools keep Serve's default (their calls block)."""
    from pdserve.deployments.door_gate import INGRESS_REPLICA_ENV

    deployments = {d.name: d for d in _deployments(build_app({"model": TINY}))}
    ingress = deployments["OpenAIIngress"].ray_actor_options
    assert ingress["runtime_env"] == {"env_vars": INGRESS_REPLICA_ENV}
    assert INGRESS_REPLICA_ENV["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    for name in ("DecodeServer", "PrefillServer"):
        assert "runtime_env" not in deployments[name].ray_actor_options
