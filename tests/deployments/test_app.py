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

from pdserve.deployments.app import build_app, deployment_options
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
    decode = deployment_options(cfg, "decode")
    assert decode["num_replicas"] == 2 and "autoscaling_config" not in decode
    assert decode["ray_actor_options"]["label_selector"] == {"pdserve.io/pool": "decode"}
    assert decode["request_router_config"].request_router_class.endswith("DecodeRequestRouter")


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
