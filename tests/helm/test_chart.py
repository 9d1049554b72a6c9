"""The KubeRay chart renders (Helm's Go engine through helm-python-sdk, offline) into a
RayService that the RayService CRD accepts with no unknown field, a serveConfigV2 that Ray
Serve accepts, and Serve application args that pdserve's AppConfig accepts."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")
jsonschema = pytest.importorskip("jsonschema")

from cluster.serving import GRPC_SERVICER  # noqa: E402
from deployments.config import POOL_LABEL_KEY, AppConfig  # noqa: E402

HERE = Path(__file__).resolve().parent
CHART = HERE.parents[1] / "helm" / "pdserve"
SCHEMA = HERE / "crds" / "rayservice-v1.schema.yaml"  # see crds/README.md
FULL_CRD = HERE.parents[2] / "shared" / "kuberay-crds" / "ray.io_rayservices.yaml"


def strict(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object that lists its fields,
    so a misspelt field fails validation instead of being pruned silently by the API server."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def rayservice_schema() -> dict[str, Any]:
    return strict(yaml.safe_load(SCHEMA.read_text()))


def test_vendored_schema_matches_the_kuberay_crd() -> None:
    if not FULL_CRD.is_file():
        pytest.skip(f"the full CRD is not beside this checkout ({FULL_CRD})")
    from tests.helm.crds.extract import v1_schema

    assert yaml.safe_load(SCHEMA.read_text()) == v1_schema(FULL_CRD)


def render(values: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Rendered manifests grouped by kind."""
    chart = helm_python.Chart.load(str(CHART))
    out = chart.render(values, name="demo", namespace="llm")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for path, text in out.items():
        if not path.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def rayservice(values: dict[str, Any] | None = None) -> dict[str, Any]:
    (svc,) = render(values)["RayService"]
    return svc


def groups(svc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def app_args(svc: dict[str, Any]) -> dict[str, Any]:
    serve_config = yaml.safe_load(svc["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    return app["args"]


def test_chart_lints_clean() -> None:
    report = helm_python.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_rayservice_matches_crd_with_no_unknown_field(rayservice_schema: dict[str, Any]) -> None:
    svc = rayservice()
    assert svc["apiVersion"] == "ray.io/v1"
    jsonschema.validate(svc, rayservice_schema)


def test_strict_schema_catches_a_misspelt_field(rayservice_schema: dict[str, Any]) -> None:
    svc = rayservice()
    broken = copy.deepcopy(svc)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="minReplica"):
        jsonschema.validate(broken, rayservice_schema)
    broken = copy.deepcopy(svc)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "resource"
    ] = {}
    with pytest.raises(jsonschema.ValidationError, match="resource"):
        jsonschema.validate(broken, rayservice_schema)


def test_serve_config_is_valid_for_ray_serve() -> None:
    from ray.serve.schema import ServeDeploySchema

    svc = rayservice()
    config = ServeDeploySchema.model_validate(yaml.safe_load(svc["spec"]["serveConfigV2"]))
    (app,) = config.applications
    assert app.import_path == "deployments.app:build_app"
    assert config.http_options.port == 8000
    assert config.grpc_options.port == 9000
    # The gRPC servicer Serve's proxy imports must exist in the package.
    (servicer,) = config.grpc_options.grpc_servicer_functions
    assert servicer == GRPC_SERVICER  # the same servicer `pdserve serve` starts locally
    module, _, function = servicer.rpartition(".")
    assert callable(getattr(importlib.import_module(module), function))


def test_app_args_are_a_valid_app_config_mirroring_the_pools() -> None:
    cfg = AppConfig.from_dict(app_args(rayservice()))
    assert (cfg.prefill.min_replicas, cfg.prefill.max_replicas) == (1, 4)
    assert (cfg.decode.min_replicas, cfg.decode.max_replicas) == (1, 8)
    assert cfg.prefill.num_gpus == 1 and cfg.decode.num_gpus == 1
    assert cfg.prefill.label_selector("prefill") == {
        POOL_LABEL_KEY: "prefill",
        "ray.io/accelerator-type": "H100",
    }
    assert cfg.decode.label_selector("decode")["ray.io/accelerator-type"] == "H200"
    assert cfg.grpc.enabled and cfg.grpc.port == 9000
    assert cfg.prefill.engine.max_num_batched_tokens == 8192  # values.app merged, not replaced


def test_worker_groups_are_labelled_gpu_pools() -> None:
    svc = rayservice()
    by_name = groups(svc)
    assert set(by_name) == {"prefill", "decode"}
    for role, product in (("prefill", "NVIDIA-H100-80GB-HBM3"), ("decode", "NVIDIA-H200")):
        group = by_name[role]
        # Node labels in the group's labels field: Ray 2.60's autoscaler ignores
        # labels passed through rayStartParams.
        assert group["labels"] == {POOL_LABEL_KEY: role}
        assert "labels" not in group["rayStartParams"]
        pod = group["template"]["spec"]
        assert pod["nodeSelector"]["nvidia.com/gpu.product"] == product
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {p["name"] for p in container["ports"]} >= {"serve", "serve-grpc", "metrics"}
    assert (by_name["decode"]["minReplicas"], by_name["decode"]["maxReplicas"]) == (1, 8)
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert svc["spec"]["upgradeStrategy"]["type"] == "NewCluster"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no engine replica on the head
    head_ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert head_ports == {
        "gcs-server": 6379,
        "dashboard": 8265,
        "client": 10001,
        "serve": 8000,
        "serve-grpc": 9000,
        "metrics": 8080,
    }


def test_values_resize_pools_and_cpu_pools_drop_gpu_scheduling(
    rayservice_schema: dict[str, Any],
) -> None:
    values = {
        "pools": {
            "decode": {"minReplicas": 2, "maxReplicas": 3},
            "prefill": {"gpus": 0, "acceleratorType": "", "gpuProduct": "", "cpus": 4},
        },
        "autoscaling": {"enabled": False},
        "ports": {"serve": 8100},
    }
    svc = rayservice(values)
    jsonschema.validate(svc, rayservice_schema)
    by_name = groups(svc)
    assert (by_name["decode"]["minReplicas"], by_name["decode"]["maxReplicas"]) == (2, 3)
    assert by_name["decode"]["replicas"] == 2
    prefill_pod = by_name["prefill"]["template"]["spec"]
    assert "nodeSelector" not in prefill_pod and "tolerations" not in prefill_pod
    assert "nvidia.com/gpu" not in prefill_pod["containers"][0]["resources"]["limits"]
    assert svc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in svc["spec"]["rayClusterConfig"]
    cfg = AppConfig.from_dict(app_args(svc))
    assert (cfg.decode.min_replicas, cfg.decode.max_replicas) == (2, 3)
    assert cfg.prefill.num_gpus == 0 and cfg.prefill.accelerator_type is None
    assert cfg.prefill.label_selector("prefill") == {POOL_LABEL_KEY: "prefill"}
    assert cfg.http.port == 8100
    assert yaml.safe_load(svc["spec"]["serveConfigV2"])["http_options"]["port"] == 8100


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"app": {"slo": {"ttft": 300}}}, "/app/slo"),  # AppConfig field misspelt
        ({"app": {"prefill": {"max_replicas": 0}}}, "/app/prefill/max_replicas"),
        ({"pools": {"prefil": {}}}, "/pools"),  # chart value misspelt
        ({"upgradeStrategy": "Recreate"}, "/upgradeStrategy"),
    ],
)
def test_values_schema_rejects_bad_values_at_render_time(values: dict, where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=where):
        rayservice(values)


def test_values_schema_is_generated_from_app_config() -> None:
    from cluster.helm_schema import SCHEMA_FILE, render_schema

    assert SCHEMA_FILE.read_text() == render_schema(), "run `python -m cluster.helm_schema`"


def test_metrics_service_selects_every_ray_pod() -> None:
    manifests = render()
    (service,) = manifests["Service"]
    selector = service["spec"]["selector"]
    svc = manifests["RayService"][0]["spec"]["rayClusterConfig"]
    templates = [svc["headGroupSpec"]["template"]] + [
        g["template"] for g in svc["workerGroupSpecs"]
    ]
    for template in templates:
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "metrics" and port["port"] == 8080
    assert "Service" not in render({"metricsService": {"enabled": False}})
