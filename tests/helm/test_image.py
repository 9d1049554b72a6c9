"""The image the chart runs: `make image` builds it from the Dockerfile with the tag the
chart's values expect, and says plainly why it cannot where Docker is missing."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.helm.rendering import CHART

ROOT = CHART.parents[1]


def make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_chart_default_image_is_what_make_image_builds() -> None:
    (version,) = re.findall(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == version  # the default image tag
    assert values["image"]["repository"] == "ghcr.io/pdserve/pdserve"
    # `true` stands in for docker: make prints the build it would run.
    for variant, tag in (("cuda", version), ("cpu", f"{version}-cpu")):
        dry = make("-n", "image", "DOCKER=true", f"VARIANT={variant}")
        assert dry.returncode == 0, dry.stderr
        assert (
            f"build --build-arg VARIANT={variant} -t ghcr.io/pdserve/pdserve:{tag} ." in dry.stdout
        )


def test_make_image_without_docker_fails_with_a_clear_message() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make here")
    done = make("image", "DOCKER=/nonexistent/docker")
    assert done.returncode != 0
    assert "make image: '/nonexistent/docker' not found" in done.stderr


def test_dockerfile_builds_both_variants_with_the_cuda_extra_on_cuda() -> None:
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    stages = {stage: base for base, stage in re.findall(r"^FROM (\S+) AS (os-\w+)$", text, re.M)}
    assert stages == {"os-cuda": "${CUDA_BASE}", "os-cpu": "${CPU_BASE}"}
    assert args["VARIANT"] == "cuda"
    # cupy-cuda12x (the cuda extra) needs a CUDA 12 runtime, and torch is taken for it.
    assert args["CUDA_BASE"].startswith("nvidia/cuda:12.8") and "/whl/cu128" in text
    assert 'PDSERVE_EXTRAS="[cuda]"' in text and '".${PDSERVE_EXTRAS}"' in text
    assert "download.pytorch.org/whl/cpu" in text  # the CPU image pulls no CUDA wheels
    assert re.search(r"^FROM os-\$\{VARIANT\}$", text, re.M)
    # Everything the package needs at run time is copied in.
    for folder in ("engine", "kernels", "kvtransfer", "deployments", "cluster", "bench"):
        assert re.search(rf"^COPY .*\b{folder} {folder}$", text, re.M), folder
