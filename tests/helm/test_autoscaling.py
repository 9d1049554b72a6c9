"""The pools can scale: Ray's own KubeRay autoscaling-config builder reads each rendered
RayCluster spec, and Ray's v2 autoscaler scheduler (what `autoscalerOptions.version: v2`
runs) is asked for each pool's replicas at their maximum, with the resources and label
selector the app builder gives them. Every replica must find a group, and every group must
grow to its maxReplicas and no further."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import yaml

pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")

from pdserve.deployments.app import actor_options  # noqa: E402
from pdserve.deployments.config import AppConfig, PoolRole  # noqa: E402
from tests.helm.rendering import VALUE_SETS, app_args, rayservice  # noqa: E402

ROLES: tuple[PoolRole, ...] = ("prefill", "decode")


def autoscaling_config(svc: dict[str, Any]) -> dict[str, Any]:
    """What the autoscaler in the head pod derives from the RayCluster KubeRay creates."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    ray_cluster = {
        "metadata": {"name": f"{svc['metadata']['name']}-raycluster", "namespace": "llm"},
        "spec": svc["spec"]["rayClusterConfig"],
    }
    return _derive_autoscaling_config_from_ray_cr(ray_cluster)


def replica_request(cfg: AppConfig, role: PoolRole, count: int) -> Any:
    """``count`` replicas of a pool as the resource demand Ray's GCS reports for them."""
    from ray.autoscaler.v2.utils import ResourceRequestUtil
    from ray.core.generated.autoscaler_pb2 import ResourceRequestByCount
    from ray.core.generated.common_pb2 import LabelSelectorOperator

    options = actor_options(cfg.pool(role), role)  # what Serve's replica actors ask for
    bundle = {"CPU": float(options["num_cpus"])}
    if options["num_gpus"]:
        bundle["GPU"] = float(options["num_gpus"])
    selector = []
    for key, value in options.get("label_selector", {}).items():
        assert not value.startswith(("!", "in(")), "plain equality selectors only"
        selector.append((key, LabelSelectorOperator.LABEL_OPERATOR_IN, [value]))
    request = ResourceRequestUtil.make(bundle, label_selectors=[selector] if selector else None)
    return ResourceRequestByCount(request=request, count=count)


def schedule(config: dict[str, Any], requests: list[Any]) -> Any:
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig
    from ray.autoscaler.v2.scheduler import ResourceDemandScheduler, SchedulingRequest

    node_types = AutoscalingConfig(config, skip_content_hash=True).get_node_type_configs()
    return ResourceDemandScheduler().schedule(
        SchedulingRequest(
            disable_launch_config_check=True,
            node_type_configs=node_types,
            max_num_nodes=config["max_workers"],
            resource_requests=requests,
        )
    )


def launched(reply: Any) -> Counter[str]:
    counts: Counter[str] = Counter()
    for launch in reply.to_launch:
        counts[launch.instance_type] += launch.count
    return counts


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_pool_scales_to_its_maximum_and_no_further(name: str) -> None:
    svc = rayservice(VALUE_SETS[name])
    cfg = AppConfig.from_dict(app_args(svc))
    config = autoscaling_config(svc)
    node_types = config["available_node_types"]
    assert node_types["headgroup"]["resources"]["CPU"] == 0  # no replica on the head
    for role in ROLES:
        pool, node_type = cfg.pool(role), node_types[role]
        assert (node_type["min_workers"], node_type["max_workers"]) == (
            pool.min_replicas,
            pool.max_replicas,
        )
        # Every key the replicas select on is a label the autoscaler knows the group has.
        assert pool.label_selector(role).items() <= node_type["labels"].items()
    # Ask for one replica more than each pool's maximum: the surplus must stay unplaced
    # and every group must grow to exactly its maximum.
    requests = [replica_request(cfg, role, cfg.pool(role).max_replicas + 1) for role in ROLES]
    reply = schedule(config, requests)
    assert launched(reply) == Counter({role: cfg.pool(role).max_replicas for role in ROLES})
    assert len(reply.infeasible_resource_requests) == len(ROLES)
    # At the minimum the groups already hold every replica: nothing more is launched.
    at_min = [replica_request(cfg, role, cfg.pool(role).min_replicas) for role in ROLES]
    reply = schedule(config, at_min)
    assert launched(reply) == Counter({role: cfg.pool(role).min_replicas for role in ROLES})
    assert list(reply.infeasible_resource_requests) == []


def test_a_group_missing_the_accelerator_label_never_scales() -> None:
    """What issue 19 found: with only pdserve.io/pool on the group, the v2 scheduler rejects
    the group for replicas that also select ray.io/accelerator-type."""
    svc = rayservice()
    cfg = AppConfig.from_dict(app_args(svc))
    broken = copy.deepcopy(svc)
    for group in broken["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        group["labels"] = {"pdserve.io/pool": group["groupName"]}
    reply = schedule(autoscaling_config(broken), [replica_request(cfg, "decode", 2)])
    assert launched(reply) == Counter({"prefill": 1, "decode": 1})  # the minimum only
    assert len(reply.infeasible_resource_requests) == 2


def test_replicas_do_not_land_on_the_other_pool() -> None:
    """A decode replica fits a prefill node's resources; only the labels keep it off."""
    values = {"pools": {"prefill": {"gpuProduct": "NVIDIA-H200"}}}  # same GPU in both pools
    svc = rayservice(values)
    cfg = AppConfig.from_dict(app_args(svc))
    assert cfg.prefill.accelerator_type == cfg.decode.accelerator_type == "H200"
    reply = schedule(autoscaling_config(svc), [replica_request(cfg, "decode", 5)])
    assert launched(reply) == Counter({"prefill": 1, "decode": 5})


def test_serve_config_bounds_match_the_groups() -> None:
    svc = rayservice(VALUE_SETS["h100-prefill-h200-decode-pvc"])
    serve_config = yaml.safe_load(svc["spec"]["serveConfigV2"])
    cfg = AppConfig.from_dict(serve_config["applications"][0]["args"])
    from pdserve.deployments.app import deployment_options

    for role in ROLES:
        scaling = deployment_options(cfg, role)["autoscaling_config"]
        group = {g["groupName"]: g for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}[
            role
        ]
        assert (scaling["min_replicas"], scaling["max_replicas"]) == (
            group["minReplicas"],
            group["maxReplicas"],
        )
