"""Write ``rayservice-v1.schema.yaml`` from KubeRay's RayService CRD (descriptions dropped)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).with_name("rayservice-v1.schema.yaml")


def strip_descriptions(node: Any, in_properties: bool = False) -> Any:
    """Drop schema ``description`` texts; a *field* named description (a key of
    ``properties``) is kept."""
    if isinstance(node, dict):
        return {
            key: strip_descriptions(value, in_properties=key == "properties" and not in_properties)
            for key, value in node.items()
            if in_properties or not (key == "description" and isinstance(value, str))
        }
    if isinstance(node, list):
        return [strip_descriptions(value) for value in node]
    return node


def v1_schema(crd_path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(crd_path.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strip_descriptions(v1["schema"]["openAPIV3Schema"])


if __name__ == "__main__":
    OUT.write_text(yaml.safe_dump(v1_schema(Path(sys.argv[1])), sort_keys=True))
    print(OUT)
