"""The KubeRay chart renders (Helm's Go engine through helm-python-sdk, offline) into a
RayService that the RayService CRD accepts with no unknown field, a serveConfigV2 that Ray
Serve accepts, and Serve application args that pdserve's AppConfig accepts."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import yaml

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")
jsonschema = pytest.importorskip("jsonschema")

from pdserve.cluster.serving import GRPC_SERVICER  # noqa: E402
from pdserve.deployments.config import (  # noqa: E402
    ACCELERATOR_LABEL_KEY,
    POOL_LABEL_KEY,
    AppConfig,
)
from tests.helm.rendering import (  # noqa: E402
    CHART,
    FULL_CRD,
    SCHEMA,
    VALUE_SETS,
    app_args,
    groups,
    pod_specs,
    rayservice,
    render,
    strict,
)


@pytest.fixture(scope="module")
def rayservice_schema() -> dict[str, Any]:
    """The RayService CRD's v1 schema, strict: from the full CRD beside the checkout when it
    is there, else the vendored copy (which a test keeps equal to it)."""
    if FULL_CRD.is_file():
        from tests.helm.crds.extract import v1_schema

        return strict(v1_schema(FULL_CRD))
    return strict(yaml.safe_load(SCHEMA.read_text()))


def test_vendored_schema_matches_the_kuberay_crd() -> None:
    if not FULL_CRD.is_file():
        pytest.skip(f"the full CRD is not beside this checkout ({FULL_CRD})")
    from tests.helm.crds.extract import v1_schema

    assert yaml.safe_load(SCHEMA.read_text()) == v1_schema(FULL_CRD)


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
    assert app.import_path == "pdserve.deployments.app:build_app"
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
    for role, product, accelerator in (
        ("prefill", "NVIDIA-H100-80GB-HBM3", "H100"),
        ("decode", "NVIDIA-H200", "H200"),
    ):
        group = by_name[role]
        # Node labels in the group's labels field: Ray 2.60's autoscaler ignores
        # labels passed through rayStartParams. Every label the replicas select on is
        # there, or the v2 autoscaler never grows the group past its minimum.
        assert group["labels"] == {POOL_LABEL_KEY: role, ACCELERATOR_LABEL_KEY: accelerator}
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
    assert cluster["autoscalerOptions"]["version"] == "v2"  # v1 ignores Ray labels
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
        ({"frontDoor": "direct"}, "/frontDoor"),
    ],
)
def test_values_schema_rejects_bad_values_at_render_time(values: dict, where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=where):
        rayservice(values)


def test_haproxy_front_door_switches_every_ray_pod_to_serves_haproxy_mode() -> None:
    """Ray reads RAY_SERVE_ENABLE_HA_PROXY in every Serve process (controller, replicas), so
    it must be on every pod; the default front door (Serve's proxy) sets nothing."""

    def flags(svc: dict[str, Any]) -> dict[str, list[str]]:
        return {
            name: [
                e.get("value")
                for e in pod["containers"][0]["env"]
                if e["name"] == "RAY_SERVE_ENABLE_HA_PROXY"
            ]  # fmt: skip
            for name, pod in pod_specs(svc).items()
        }

    assert flags(rayservice({"frontDoor": "haproxy"})) == {
        "head": ["1"],
        "prefill": ["1"],
        "decode": ["1"],
    }
    assert flags(rayservice()) == {"head": [], "prefill": [], "decode": []}


def test_every_ray_pod_runs_the_edge_gate_on_serves_http_servers() -> None:
    """Serve reads its HTTP callback where a proxy or a direct-ingress replica starts: every
    pod names pdserve's, and the name imports."""
    from pdserve.deployments.door_gate import EDGE_CALLBACK, serve_http_middlewares

    for values in ({}, {"frontDoor": "haproxy"}):
        for name, pod in pod_specs(rayservice(values)).items():
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == EDGE_CALLBACK, name
    module, _, function = EDGE_CALLBACK.partition(":")
    assert getattr(importlib.import_module(module), function) is serve_http_middlewares


def test_values_schema_is_generated_from_app_config() -> None:
    from pdserve.cluster.helm_schema import SCHEMA_FILE, render_schema

    assert SCHEMA_FILE.read_text() == render_schema(), "run `python -m pdserve.cluster.helm_schema`"


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


# --- every install a user does renders valid objects ----------------------------------------


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_value_set_renders_a_valid_rayservice(name: str, rayservice_schema: dict[str, Any]) -> None:
    from ray.serve.schema import ServeDeploySchema

    report = helm_python.lint(str(CHART), VALUE_SETS[name], strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    svc = rayservice(VALUE_SETS[name])
    jsonschema.validate(svc, rayservice_schema)  # the CRD, no unknown field anywhere
    ServeDeploySchema.model_validate(yaml.safe_load(svc["spec"]["serveConfigV2"]))
    cfg = AppConfig.from_dict(app_args(svc))
    spec = svc["spec"]
    # Deprecated RayService fields (unused since KubeRay 1.1) are gone.
    assert "serviceUnhealthySecondThreshold" not in spec
    assert "deploymentUnhealthySecondThreshold" not in spec
    by_name = groups(svc)
    for role in ("prefill", "decode"):
        pool, group = cfg.pool(role), by_name[role]
        # The group's labels carry every key of the replicas' selector, with its value.
        assert pool.label_selector(role).items() <= group["labels"].items()
        assert (group["minReplicas"], group["maxReplicas"]) == (
            pool.min_replicas,
            pool.max_replicas,
        )
        # One replica per pod: the pod holds every rank's GPUs and CPUs (STRICT_PACK).
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        pod_gpus = pool.num_gpus * pool.tensor_parallel_size
        assert limits.get("nvidia.com/gpu", 0) == pod_gpus == cfg.gpus_per_replica(role)
        assert int(group["rayStartParams"].get("num-gpus", 0)) == pod_gpus
        assert pool.num_cpus * pool.tensor_parallel_size <= float(limits["cpu"])


def test_tensor_parallel_pools_get_gpus_per_pod_and_tp_in_the_app_config() -> None:
    from pdserve.deployments.app import deployment_options

    svc = rayservice(VALUE_SETS["tensor-parallel"])
    cfg = AppConfig.from_dict(app_args(svc))
    assert app_args(svc)["prefill"]["tensor_parallel_size"] == 4
    assert (cfg.prefill.tensor_parallel_size, cfg.decode.tensor_parallel_size) == (4, 2)
    by_name = groups(svc)
    for role, tp in (("prefill", 4), ("decode", 2)):
        group = by_name[role]
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert group["rayStartParams"]["num-gpus"] == str(tp)
        # What Serve reserves for one replica is exactly what its pod offers Ray.
        bundles = deployment_options(cfg, role)["placement_group_bundles"]
        assert len(bundles) == tp and sum(b["GPU"] for b in bundles) == tp
        assert sum(b["CPU"] for b in bundles) <= float(container["resources"]["limits"]["cpu"])
    # At TP=1 the app config says so too, and the pod keeps one GPU.
    default = rayservice()
    assert app_args(default)["decode"]["tensor_parallel_size"] == 1
    assert groups(default)["decode"]["rayStartParams"]["num-gpus"] == "1"


def test_a_cpu_pool_splits_over_processes_without_gpus() -> None:
    values = copy.deepcopy(VALUE_SETS["cpu-only"])
    values["pools"]["decode"].update({"tensorParallelSize": 2, "cpus": 1})
    svc = rayservice(values)
    cfg = AppConfig.from_dict(app_args(svc))
    assert cfg.decode.tensor_parallel_size == 2 and cfg.gpus_per_replica("decode") == 0
    decode = groups(svc)["decode"]
    assert "num-gpus" not in decode["rayStartParams"]
    assert (
        "nvidia.com/gpu" not in decode["template"]["spec"]["containers"][0]["resources"]["limits"]
    )


def test_pvc_model_is_mounted_read_only_on_every_ray_pod() -> None:
    svc = rayservice(VALUE_SETS["h100-prefill-h200-decode-pvc"])
    cfg = AppConfig.from_dict(app_args(svc))
    assert cfg.model.path == "/models/llama-3.1-8b-instruct" and cfg.model.hf_id is None
    for name, pod in pod_specs(svc).items():
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": "llama-3-1-8b", "readOnly": True}
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}, name
        assert "initContainers" not in pod  # nothing to download
    by_name = groups(svc)
    assert by_name["decode"]["minReplicas"] == 2 and by_name["prefill"]["maxReplicas"] == 6


def test_hub_model_is_fetched_before_ray_starts_with_the_token_from_the_secret() -> None:
    svc = rayservice(VALUE_SETS["hub-id-with-token-secret"])
    cfg = AppConfig.from_dict(app_args(svc))
    assert cfg.model.hf_id == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.model.cache_dir == "/model-cache"
    for name, pod in pod_specs(svc).items():
        (init,) = pod["initContainers"]
        command = init["command"]
        assert command[:4] == ["python", "-m", "pdserve.deployments.model_source", "fetch"]
        # The init container fetches exactly the model the app builder resolves.
        model_json = command[command.index("--model") + 1]
        assert AppConfig.from_dict({"model": yaml.safe_load(model_json)}).model == cfg.model
        # The head's builder and ingress need config and tokenizer, not the weights.
        assert ("--metadata-only" in command) == (name == "head")
        token = {e["name"]: e for e in init["env"]}["HF_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        (cache,) = [v for v in pod["volumes"] if v["name"] == "model-cache"]
        assert cache["hostPath"]["path"] == "/var/cache/pdserve/models"  # once per node
        assert {"name": "model-cache", "mountPath": "/model-cache"} in init["volumeMounts"]
        ray = pod["containers"][0]
        assert "HF_TOKEN" not in {e["name"] for e in ray["env"]}  # only the downloader
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in ray["env"]  # replicas never fetch
        assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in ray[
            "volumeMounts"
        ]


def test_object_store_model_downloads_with_credentials_from_a_secret() -> None:
    svc = rayservice(VALUE_SETS["object-store-uri"])
    assert AppConfig.from_dict(app_args(svc)).model.uri == "s3://models/llama-3.1-8b-instruct"
    for pod in pod_specs(svc).values():
        (init,) = pod["initContainers"]
        assert init["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
        assert "HF_TOKEN" not in {e["name"] for e in init["env"]}
        (cache,) = [v for v in pod["volumes"] if v["name"] == "model-cache"]
        assert "emptyDir" in cache  # cache.hostPath "" = per pod


def test_cpu_only_install_uses_the_cpu_image_and_no_gpu_scheduling() -> None:
    svc = rayservice(VALUE_SETS["cpu-only"])
    cfg = AppConfig.from_dict(app_args(svc))
    assert cfg.model.device == "cpu" and cfg.prefill.num_gpus == 0 == cfg.decode.num_gpus
    for name, pod in pod_specs(svc).items():
        assert pod["containers"][0]["image"] == "ghcr.io/pdserve/pdserve:0.1.0-cpu"
        assert "tolerations" not in pod and "initContainers" not in pod
        if name != "head":
            assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
    for group in groups(svc).values():
        assert ACCELERATOR_LABEL_KEY not in group["labels"]


def test_incremental_upgrade_emits_cluster_upgrade_options(
    rayservice_schema: dict[str, Any],
) -> None:
    svc = rayservice(VALUE_SETS["incremental-upgrade"])
    strategy = svc["spec"]["upgradeStrategy"]
    assert strategy == {
        "type": "NewClusterWithIncrementalUpgrade",
        "clusterUpgradeOptions": {
            "gatewayClassName": "istio",
            "stepSizePercent": 20,
            "intervalSeconds": 60,
            "maxSurgePercent": 100,
        },
    }
    assert "clusterUpgradeOptions" not in rayservice()["spec"]["upgradeStrategy"]


def test_drain_timeout_reaches_serve_pods_and_upgrades() -> None:
    svc = rayservice(VALUE_SETS["incremental-upgrade"])  # drain.timeoutSeconds: 600
    assert AppConfig.from_dict(app_args(svc)).graceful_shutdown_timeout_s == 600
    # Pods outlive the replicas' drain; the old cluster outlives its streams.
    for pod in pod_specs(svc).values():
        assert pod["terminationGracePeriodSeconds"] == 630
    assert svc["spec"]["rayClusterDeletionDelaySeconds"] == 630
    from pdserve.deployments.app import deployment_options

    cfg = AppConfig.from_dict(app_args(svc))
    for role in ("prefill", "decode"):
        assert deployment_options(cfg, role)["graceful_shutdown_timeout_s"] == 600


def test_chart_states_the_kuberay_version_its_features_need() -> None:
    # KubeRay release that introduced each feature the chart relies on.
    needs = {
        "serve-* ports (gRPC) on the serve Service": (1, 6, 0),
        "worker group labels for the v2 autoscaler": (1, 5, 1),
        "rayClusterDeletionDelaySeconds": (1, 5, 0),
        "clusterUpgradeOptions": (1, 5, 0),
        "autoscalerOptions.version": (1, 4, 0),
    }
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    stated = chart["annotations"]["pdserve.io/kuberay-version"]
    assert stated.startswith(">=")
    version = tuple(int(x) for x in stated[2:].split("."))
    assert version >= max(needs.values()), needs
    assert stated[2:] in (CHART / "README.md").read_text()
