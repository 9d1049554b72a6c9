"""Generate ``helm/pdserve/values.schema.json``: Helm then rejects a misspelt value at
``helm install``/``helm template`` time instead of deploying a RayService that ignores it.

The chart's own keys are described here; the ``app`` section is ``AppConfig``'s JSON schema,
so the Serve application args are checked against the same model the replicas load.
``python -m pdserve.cluster.helm_schema`` rewrites the file; a test keeps it in sync.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.deployments.config import AppConfig

CHART_DIR = Path(__file__).resolve().parents[1] / "helm" / "pdserve"
SCHEMA_FILE = CHART_DIR / "values.schema.json"


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


def _string(**extra: Any) -> dict[str, Any]:
    return {"type": "string", **extra}


INT = {"type": "integer", "minimum": 0}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
QUANTITY = {"anyOf": [{"type": "string"}, {"type": "number"}]}
MAP = {"type": "object"}  # free-form Kubernetes fields (resources, nodeSelector...)
LIST = {"type": "array"}


def _pool(min_replicas: int) -> dict[str, Any]:
    return _obj(
        {
            # The decode pool serves every request: AppConfig requires one replica at least.
            "minReplicas": {"type": "integer", "minimum": min_replicas},
            "maxReplicas": {"type": "integer", "minimum": 1},
            # Ranks per replica (one replica per pod, its ranks all on the pod).
            "tensorParallelSize": {"type": "integer", "minimum": 1},
            # Per rank; more than one is refused by the templates (a rank drives one GPU).
            "gpus": INT,
            "cpus": {"type": "number", "exclusiveMinimum": 0},
            "gpuProduct": _string(),
            "acceleratorType": _string(),
            "resources": MAP,
            "sharedMemory": QUANTITY,
            "nodeSelector": MAP,
            "tolerations": LIST,
        },
        required=["minReplicas", "maxReplicas", "tensorParallelSize", "gpus", "cpus"],
    )


def _model_storage() -> dict[str, Any]:
    abs_path = _string(pattern="^/")
    return _obj(
        {
            "volume": _obj(
                {
                    "mountPath": abs_path,
                    "persistentVolumeClaim": _obj(
                        {"claimName": _string(minLength=1)}, required=["claimName"]
                    ),
                    "hostPath": _obj({"path": abs_path, "type": _string()}, required=["path"]),
                    "inImage": {"type": "boolean"},
                }
            ),
            "cache": _obj(
                {"mountPath": abs_path, "hostPath": _string(), "sizeLimit": QUANTITY},
                required=["mountPath"],
            ),
            "hfTokenSecret": _obj({"name": _string(), "key": _string(minLength=1)}),
            "hfEndpoint": _string(),
            "objectStoreSecret": _string(),
            "downloader": _obj({"resources": MAP, "securityContext": MAP}),
        }
    )


def _monitoring() -> dict[str, Any]:
    share = {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}
    return _obj(
        {
            "podMonitor": _obj(
                {"enabled": {"type": "boolean"}, "interval": _string(), "labels": MAP}
            ),
            "prometheusRule": _obj(
                {
                    "enabled": {"type": "boolean"},
                    "labels": MAP,
                    "ttftObjective": share,
                    "fallbackRatio": share,
                }
            ),
            "dashboard": _obj({"enabled": {"type": "boolean"}, "labels": MAP}),
            "grafanaHost": _string(),
            "grafanaIframeHost": _string(),
            "prometheusHost": _string(),
            "prometheusName": _string(),
        }
    )


def values_schema() -> dict[str, Any]:
    app = AppConfig.model_json_schema()
    defs = app.pop("$defs")
    defs["AppConfig"] = app
    schema = _obj(
        {
            "nameOverride": _string(),
            "fullnameOverride": _string(),
            "image": _obj(
                {
                    "repository": _string(minLength=1),
                    "tag": _string(),
                    "variant": {"enum": ["cuda", "cpu"]},
                    "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                }
            ),
            "imagePullSecrets": LIST,
            "rayVersion": _string(minLength=1),
            "upgradeStrategy": {"enum": ["NewCluster", "NewClusterWithIncrementalUpgrade", "None"]},
            "incrementalUpgrade": _obj(
                {
                    "gatewayClassName": _string(),
                    "stepSizePercent": {"type": "integer", "minimum": 1, "maximum": 100},
                    "intervalSeconds": {"type": "integer", "minimum": 1},
                    "maxSurgePercent": {"type": "integer", "minimum": 1, "maximum": 100},
                }
            ),
            "drain": _obj(
                {"timeoutSeconds": {"type": "integer", "minimum": 1}, "extraSeconds": INT},
                required=["timeoutSeconds", "extraSeconds"],
            ),
            "frontDoor": {"enum": ["proxy", "haproxy"]},
            "autoscaling": _obj(
                {
                    "enabled": {"type": "boolean"},
                    "idleTimeoutSeconds": INT,
                    "upscalingMode": {"enum": ["Default", "Conservative", "Aggressive"]},
                    "resources": MAP,
                }
            ),
            "ports": _obj(
                {name: PORT for name in ("gcs", "dashboard", "client", "serve", "grpc", "metrics")}
            ),
            "head": _obj(
                {
                    "resources": MAP,
                    "sharedMemory": QUANTITY,
                    "nodeSelector": MAP,
                    "tolerations": LIST,
                }
            ),
            "pools": _obj(
                {"prefill": _pool(min_replicas=0), "decode": _pool(min_replicas=1)},
                required=["prefill", "decode"],
            ),
            "modelStorage": _model_storage(),
            "monitoring": _monitoring(),
            "app": {"$ref": "#/$defs/AppConfig"},
            "extraVolumes": LIST,
            "extraVolumeMounts": LIST,
            "extraEnv": LIST,
            "metricsService": _obj({"enabled": {"type": "boolean"}}),
        }
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "pdserve chart values",
        **schema,
        "$defs": defs,
    }


def render_schema() -> str:
    return json.dumps(values_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_FILE.write_text(render_schema())
    print(SCHEMA_FILE)
