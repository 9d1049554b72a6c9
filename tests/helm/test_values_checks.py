"""Values the chart derives and refuses: the accelerator label is the one Ray gives the GPU,
and contradictions in the values fail `helm install` with a message instead of deploying
pods that never become ready (templates/_validate.tpl, values.schema.json)."""

from __future__ import annotations

import re

import pytest

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")

from pdserve.deployments.config import ACCELERATOR_LABEL_KEY, AppConfig  # noqa: E402
from tests.helm.rendering import app_args, groups, rayservice, render  # noqa: E402

# --- the accelerator label is what Ray sets on the node ---------------------------------------

# GPU Feature Discovery's nvidia.com/gpu.product is the NVML device name with spaces
# turned into dashes (MIG and time-slicing append suffixes).
NVML_NAMES = [
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 NVL",
    "NVIDIA H200",
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA A100-SXM4-40GB-MIG-1g.5gb",
    "NVIDIA L4",
    "NVIDIA L40S",
    "Tesla T4",
    "Tesla V100-SXM2-16GB",
    "NVIDIA A10G",
    "NVIDIA B200",
    "NVIDIA GH200 480GB",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition",
    "NVIDIA RTX A6000",
    "NVIDIA GeForce RTX 4090",
]


def test_accelerator_type_from_gpu_product_matches_rays_own_naming() -> None:
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

    for nvml_name in NVML_NAMES:
        product = nvml_name.replace(" ", "-")
        expected = NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(nvml_name)
        values = {"pools": {"prefill": {"gpuProduct": product}}}
        assert groups(rayservice(values))["prefill"]["labels"][ACCELERATOR_LABEL_KEY] == (
            expected
        ), nvml_name


def test_accelerator_type_without_gfd_labels_comes_from_the_value() -> None:
    # e.g. GKE, whose nodes carry cloud.google.com/gke-accelerator instead of GFD labels.
    values = {
        "pools": {
            "decode": {
                "gpuProduct": "",
                "acceleratorType": "H100",
                "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
            }
        }
    }
    svc = rayservice(values)
    decode = groups(svc)["decode"]
    assert decode["labels"][ACCELERATOR_LABEL_KEY] == "H100"
    assert decode["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"
    }
    assert AppConfig.from_dict(app_args(svc)).decode.accelerator_type == "H100"


# --- contradictions fail at render time --------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"pools": {"decode": {"minReplicas": 0}}}, "/pools/decode/minReplicas"),
        ({"pools": {"prefill": {"cpus": 12}}}, "pools.prefill.cpus=12 exceeds the pod's CPU"),
        (
            {
                "pools": {
                    "decode": {
                        "resources": {"requests": {"cpu": "7500m"}, "limits": {"cpu": "7500m"}}
                    }
                }
            },
            "pools.decode.cpus=8 exceeds",
        ),
        ({"pools": {"decode": {"gpus": 2}}}, "pools.decode.gpus=2: gpus is per rank"),
        (
            {"pools": {"prefill": {"tensorParallelSize": 2}}},
            "pools.prefill: cpus=8 per rank x tensorParallelSize=2 = 16 CPUs exceeds the pod's "
            "CPU limit 10",
        ),
        (
            {
                "pools": {
                    "decode": {
                        "tensorParallelSize": 2,
                        "cpus": 4,
                        "resources": {"limits": {"cpu": "10", "nvidia.com/gpu": 1}},
                    }
                }
            },
            "pools.decode.resources.limits.nvidia.com/gpu=1 contradicts gpus x "
            "tensorParallelSize = 1 x 2 = 2",
        ),
        (
            {"pools": {"prefill": {"resources": {"requests": {"nvidia.com/gpu": "4"}}}}},
            "pools.prefill.resources.requests.nvidia.com/gpu=4 contradicts",
        ),
        ({"pools": {"decode": {"tensorParallelSize": 0}}}, "/pools/decode/tensorParallelSize"),
        (
            {"app": {"decode": {"tensor_parallel_size": 2}}},
            "app.decode.tensor_parallel_size is set by the chart",
        ),
        (
            {"head": {"resources": {"limits": {"cpu": "2", "memory": "4Gi"}}}},
            "head.resources: requests.cpu (4) exceeds limits.cpu (2)",
        ),
        (
            {"pools": {"prefill": {"resources": {"requests": {"memory": "80Gi"}}}}},
            "pools.prefill.resources: requests.memory (80Gi) exceeds limits.memory (64Gi)",
        ),
        ({"pools": {"prefill": {"resources": {"limits": {"cpu": "10x"}}}}}, "unknown suffix"),
        ({"pools": {"prefill": {"acceleratorType": "H200"}}}, "contradicts gpuProduct"),
        ({"pools": {"prefill": {"gpus": 0}}}, "gpuProduct/acceleratorType set but gpus is 0"),
        ({"pools": {"decode": {"minReplicas": 9}}}, "minReplicas (9) exceeds maxReplicas"),
        ({"app": {"decode": {"max_replicas": 3}}}, "app.decode.max_replicas is set by the chart"),
        ({"app": {"graceful_shutdown_timeout_s": 9}}, "drain.timeoutSeconds"),
        ({"app": {"policy": {"mode": "always_local"}}}, "set it to 0"),
        ({"image": {"variant": "cpu"}}, "the CPU image has no CUDA"),
        (
            {"app": {"model": {"hf_id": None, "path": "/models/x"}}},
            "modelStorage.volume mounts nothing",
        ),
        (
            {
                "app": {"model": {"hf_id": None, "path": "/data/x"}},
                "modelStorage": {"volume": {"mountPath": "/models", "hostPath": {"path": "/m"}}},
            },
            "not under modelStorage.volume.mountPath",
        ),
        (
            {"modelStorage": {"volume": {"mountPath": "/m", "hostPath": {"path": "/m"}}}},
            "takes its weights from hub",
        ),
        (
            {"app": {"model": {"hf_id": None}}, "modelStorage": {"hfTokenSecret": {"name": "t"}}},
            "hfTokenSecret is set but app.model.hf_id is not",
        ),
        ({"app": {"model": {"cache_dir": "/tmp/x"}}}, "modelStorage.cache.mountPath"),
        (
            {"app": {"model": {"uri": "s3://b/m"}}},
            "app.model.hf_id and app.model.uri are set together",
        ),
        (
            {"upgradeStrategy": "NewClusterWithIncrementalUpgrade"},
            "needs incrementalUpgrade.gatewayClassName",
        ),
        (
            {
                "upgradeStrategy": "NewClusterWithIncrementalUpgrade",
                "incrementalUpgrade": {"gatewayClassName": "istio"},
                "autoscaling": {"enabled": False},
            },
            "needs autoscaling.enabled",
        ),
        ({"serviceUnhealthySecondThreshold": 900}, "serviceUnhealthySecondThreshold"),
        (
            {"app": {"prefill": {"engine": {"kv_cache_dtype": "int8"}}}},
            'app.prefill.engine.kv_cache_dtype="int8" and app.decode.engine.kv_cache_dtype="auto"',
        ),
    ],
)
def test_contradictions_fail_at_render_time(values: dict, message: str) -> None:
    with pytest.raises(
        (helm_python.HelmValuesError, helm_python.HelmError), match=re.escape(message)
    ):
        render(values)


def test_gpus_per_rank_check_is_in_step_with_the_app_config() -> None:
    # The chart refuses gpus > 1 because a rank drives one GPU; AppConfig refuses the same
    # num_gpus at tensor_parallel_size > 1, and the rendered pool carries both fields.
    with pytest.raises(ValueError, match="num_gpus is per rank"):
        AppConfig.from_dict({"decode": {"tensor_parallel_size": 2, "num_gpus": 2}})
    args = app_args(rayservice({"pools": {"decode": {"tensorParallelSize": 2, "cpus": 4}}}))
    assert (args["decode"]["num_gpus"], args["decode"]["tensor_parallel_size"]) == (1, 2)
    assert AppConfig.from_dict(args).gpus_per_replica("decode") == 2
