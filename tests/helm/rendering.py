"""Rendering the chart offline (Helm's Go engine through helm-python-sdk) and the value sets
the tests render it with: one per kind of install a user does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CHART = HERE.parents[1] / "helm" / "pdserve"
SCHEMA = HERE / "crds" / "rayservice-v1.schema.yaml"  # see crds/README.md
FULL_CRD = HERE.parents[2] / "shared" / "kuberay-crds" / "ray.io_rayservices.yaml"

H100 = "NVIDIA-H100-80GB-HBM3"
H200 = "NVIDIA-H200"

# Every install the tests render: the chart's defaults, and the three a GPU-cluster user
# starts from (weights on a PVC, from the Hub with a token, and a CPU-only cluster), plus
# tensor-parallel pools, an object-store model and an incremental upgrade.
VALUE_SETS: dict[str, dict[str, Any] | None] = {
    "defaults": None,
    "h100-prefill-h200-decode-pvc": {
        "pools": {
            "prefill": {"gpuProduct": H100, "acceleratorType": "H100", "maxReplicas": 6},
            "decode": {"gpuProduct": H200, "minReplicas": 2, "maxReplicas": 12},
        },
        "modelStorage": {
            "volume": {
                "mountPath": "/models",
                "persistentVolumeClaim": {"claimName": "llama-3-1-8b"},
            }
        },
        "app": {"model": {"hf_id": None, "path": "/models/llama-3.1-8b-instruct"}},
    },
    "hub-id-with-token-secret": {
        "app": {
            "model": {
                "hf_id": "meta-llama/Llama-3.1-8B-Instruct",
                "revision": "0e9e39f249a16976918f6564b8830bc894c89659",
            }
        },
        "modelStorage": {"hfTokenSecret": {"name": "hf-token", "key": "token"}},
        "monitoring": {
            "podMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "prometheusRule": {"enabled": True},
            "dashboard": {"enabled": True},
            "grafanaHost": "http://prometheus-grafana.prometheus-system.svc:80",
            "prometheusHost": "http://prometheus-kube-prometheus-prometheus.prometheus-system.svc:9090",
        },
    },
    "cpu-only": {
        "image": {"variant": "cpu"},
        "head": {
            "resources": {
                "requests": {"cpu": "1", "memory": "4Gi"},
                "limits": {"cpu": "2", "memory": "4Gi"},
            },
            "sharedMemory": "1Gi",
        },
        "pools": {
            pool: {
                "gpus": 0,
                "gpuProduct": "",
                "cpus": 2,
                "minReplicas": 1,
                "maxReplicas": 3,
                "resources": {
                    "requests": {"cpu": "2", "memory": "6Gi"},
                    "limits": {"cpu": "2", "memory": "6Gi"},
                },
                "sharedMemory": "2Gi",
            }
            for pool in ("prefill", "decode")
        },
        "app": {
            "model": {"hf_id": None, "test_model": "tiny", "device": "cpu", "dtype": "float32"}
        },
    },
    # Tensor parallelism: a 72B model over 4 GPUs per prefill replica and 2 per decode
    # replica (one replica per pod: its ranks all on that pod).
    "tensor-parallel": {
        "pools": {
            "prefill": {
                "tensorParallelSize": 4,
                "cpus": 4,
                "maxReplicas": 2,
                "resources": {
                    "requests": {"cpu": "18", "memory": "256Gi"},
                    "limits": {"cpu": "18", "memory": "256Gi"},
                },
            },
            "decode": {"tensorParallelSize": 2, "cpus": 4, "maxReplicas": 4},
        },
        "app": {"model": {"hf_id": "Qwen/Qwen2.5-72B-Instruct"}},
    },
    "object-store-uri": {
        "app": {"model": {"hf_id": None, "uri": "s3://models/llama-3.1-8b-instruct"}},
        "modelStorage": {"objectStoreSecret": "s3-credentials", "cache": {"hostPath": ""}},
    },
    "incremental-upgrade": {
        "upgradeStrategy": "NewClusterWithIncrementalUpgrade",
        "incrementalUpgrade": {"gatewayClassName": "istio", "stepSizePercent": 20},
        "drain": {"timeoutSeconds": 600},
    },
}


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


def render(values: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Rendered manifests grouped by kind."""
    import helm_python

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


def pod_specs(svc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod spec per group: ``head``, ``prefill``, ``decode``."""
    cluster = svc["spec"]["rayClusterConfig"]
    specs = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    specs.update({name: g["template"]["spec"] for name, g in groups(svc).items()})
    return specs
