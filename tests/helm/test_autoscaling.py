"""The pools can scale: Ray's own KubeRay autoscaling-config builder reads each rendered
RayCluster spec, and Ray's v2 autoscaler scheduler (what `autoscalerOptions.version: v2`
runs) is asked for each pool's replicas at their maximum, with the resources and label
selector the app builder gives them (a tensor-parallel replica: its STRICT_PACK placement
group). Every replica must find a group, and every group must grow to its maxReplicas and
no further."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")

from pdserve.deployments.app import actor_options, deployment_options  # noqa: E402
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


@dataclass
class Demand:
    """Pending replicas as Ray's GCS reports them to the autoscaler."""

    requests: list[Any] = field(default_factory=list)  # ResourceRequestByCount: actors
    gangs: list[Any] = field(default_factory=list)  # GangResourceRequest: placement groups


def _selector(labels: dict[str, str] | None) -> list[Any] | None:
    from ray.core.generated.common_pb2 import LabelSelectorOperator

    selector = []
    for key, value in (labels or {}).items():
        assert not value.startswith(("!", "in(")), "plain equality selectors only"
        selector.append((key, LabelSelectorOperator.LABEL_OPERATOR_IN, [value]))
    return [selector] if selector else None


def replica_demand(cfg: AppConfig, role: PoolRole, count: int) -> Demand:
    """``count`` replicas of a pool, from the options the app builder gives Serve: a TP=1
    replica is one actor's resource request; a TP>1 replica is its placement group, a gang
    whose bundles GCS ties with an affinity constraint on the group's ``_PG_<id>`` label
    (its STRICT_PACK), each with its bundle label selector."""
    from ray.autoscaler.v2.utils import ResourceRequestUtil
    from ray.core.generated.autoscaler_pb2 import GangResourceRequest, ResourceRequestByCount

    options = deployment_options(cfg, role)
    bundles = options.get("placement_group_bundles")
    if bundles is None:
        actor = options["ray_actor_options"]
        assert actor == actor_options(cfg.pool(role), role)  # what Serve's replicas ask for
        bundle = {"CPU": float(actor["num_cpus"])}
        if actor["num_gpus"]:
            bundle["GPU"] = float(actor["num_gpus"])
        request = ResourceRequestUtil.make(
            bundle, label_selectors=_selector(actor.get("label_selector"))
        )
        return Demand(requests=[ResourceRequestByCount(request=request, count=count)])
    assert options["placement_group_strategy"] == "STRICT_PACK"
    selectors = options.get("placement_group_bundle_label_selector") or [{}] * len(bundles)
    affinity = ResourceRequestUtil.PlacementConstraintType.AFFINITY
    gangs = []
    for index in range(count):
        pg_label = f"_PG_{role}{index:04d}"
        requests = [
            ResourceRequestUtil.make(
                bundle, constraints=[(affinity, pg_label, "")], label_selectors=_selector(labels)
            )
            for bundle, labels in zip(bundles, selectors, strict=True)
        ]
        gangs.append(GangResourceRequest(requests=requests, details=f"{role} replica {index}"))
    return Demand(gangs=gangs)


def schedule(config: dict[str, Any], demands: list[Demand]) -> Any:
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig
    from ray.autoscaler.v2.scheduler import ResourceDemandScheduler, SchedulingRequest

    node_types = AutoscalingConfig(config, skip_content_hash=True).get_node_type_configs()
    return ResourceDemandScheduler().schedule(
        SchedulingRequest(
            disable_launch_config_check=True,
            node_type_configs=node_types,
            max_num_nodes=config["max_workers"],
            resource_requests=[r for d in demands for r in d.requests],
            gang_resource_requests=[g for d in demands for g in d.gangs],
        )
    )


def unplaced(reply: Any) -> int:
    return len(reply.infeasible_resource_requests) + len(reply.infeasible_gang_resource_requests)


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
    demands = [replica_demand(cfg, role, cfg.pool(role).max_replicas + 1) for role in ROLES]
    reply = schedule(config, demands)
    assert launched(reply) == Counter({role: cfg.pool(role).max_replicas for role in ROLES})
    assert unplaced(reply) == len(ROLES)
    # At the minimum the groups already hold every replica: nothing more is launched.
    at_min = [replica_demand(cfg, role, cfg.pool(role).min_replicas) for role in ROLES]
    reply = schedule(config, at_min)
    assert launched(reply) == Counter({role: cfg.pool(role).min_replicas for role in ROLES})
    assert unplaced(reply) == 0


def test_a_group_missing_the_accelerator_label_never_scales() -> None:
    """With only pdserve.io/pool on the group, the v2 scheduler rejects
    the group for replicas that also select ray.io/accelerator-type."""
    svc = rayservice()
    cfg = AppConfig.from_dict(app_args(svc))
    broken = copy.deepcopy(svc)
    for group in broken["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        group["labels"] = {"pdserve.io/pool": group["groupName"]}
    reply = schedule(autoscaling_config(broken), [replica_demand(cfg, "decode", 2)])
    assert launched(reply) == Counter({"prefill": 1, "decode": 1})  # the minimum only
    assert len(reply.infeasible_resource_requests) == 2


def test_replicas_do_not_land_on_the_other_pool() -> None:
    """A decode replica fits a prefill node's resources; only the labels keep it off."""
    values = {"pools": {"prefill": {"gpuProduct": "NVIDIA-H200"}}}  # same GPU in both pools
    svc = rayservice(values)
    cfg = AppConfig.from_dict(app_args(svc))
    assert cfg.prefill.accelerator_type == cfg.decode.accelerator_type == "H200"
    reply = schedule(autoscaling_config(svc), [replica_demand(cfg, "decode", 5)])
    assert launched(reply) == Counter({"prefill": 1, "decode": 5})


def test_a_tensor_parallel_replica_needs_its_ranks_on_one_pod() -> None:
    """A TP=2 decode replica fits a pod with 2 GPUs; had the pod kept 1 GPU (the chart's
    count not following tensorParallelSize), the group would never grow: two 1-GPU pods
    hold the GPUs but not on one node, which STRICT_PACK needs."""
    values = {"pools": {"decode": {"tensorParallelSize": 2, "cpus": 4, "maxReplicas": 3}}}
    svc = rayservice(values)
    cfg = AppConfig.from_dict(app_args(svc))
    reply = schedule(autoscaling_config(svc), [replica_demand(cfg, "decode", 3)])
    assert launched(reply) == Counter({"prefill": 1, "decode": 3})
    assert unplaced(reply) == 0
    one_gpu = copy.deepcopy(svc)
    for group in one_gpu["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        group["rayStartParams"]["num-gpus"] = "1"
        group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 1
    reply = schedule(autoscaling_config(one_gpu), [replica_demand(cfg, "decode", 3)])
    assert launched(reply) == Counter({"prefill": 1, "decode": 1})  # the minimum only
    assert len(reply.infeasible_gang_resource_requests) == 3


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
