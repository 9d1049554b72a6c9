"""Generate ``helm/pdserve/values.schema.json``: Helm then rejects a misspelt value at
``helm install``/``helm template`` time instead of deploying a RayService that ignores it.

The chart's own keys are described here; the ``app`` section is ``AppConfig``'s JSON schema,
so the Serve application args are checked against the same model the replicas load.
``python -m cluster.helm_schema`` rewrites the file; a test keeps it in sync.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deployments.config import AppConfig

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


def _pool() -> dict[str, Any]:
    return _obj(
        {
            "minReplicas": INT,
            "maxReplicas": {"type": "integer", "minimum": 1},
            "gpus": INT,
            "cpus": {"type": "number", "exclusiveMinimum": 0},
            "gpuProduct": _string(),
            "acceleratorType": _string(),
            "resources": MAP,
            "sharedMemory": QUANTITY,
            "nodeSelector": MAP,
            "tolerations": LIST,
        },
        required=["minReplicas", "maxReplicas", "gpus", "cpus"],
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
                    "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                }
            ),
            "imagePullSecrets": LIST,
            "rayVersion": _string(minLength=1),
            "upgradeStrategy": {"enum": ["NewCluster", "NewClusterWithIncrementalUpgrade", "None"]},
            "serviceUnhealthySecondThreshold": INT,
            "deploymentUnhealthySecondThreshold": INT,
            "autoscaling": _obj(
                {
                    "enabled": {"type": "boolean"},
                    "idleTimeoutSeconds": INT,
                    "upscalingMode": {"enum": ["Default", "Conservative", "Aggressive"]},
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
            "pools": _obj({"prefill": _pool(), "decode": _pool()}, required=["prefill", "decode"]),
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
