"""`pdserve up` on a GPU machine splits the visible GPUs between the prefill and decode
nodes (fabricated GPU lists: no GPU is needed), and each raylet sees only its share."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cluster import local
from pdserve.cluster.topology import ClusterSpec, visible_gpu_ids


def node_gpus(spec: ClusterSpec) -> dict[str, tuple[int, tuple[str, ...] | None]]:
    return {n.name: (n.num_gpus, n.gpu_ids) for n in spec.nodes()}


def test_eight_gpus_split_four_and_four_and_each_raylet_sees_its_own() -> None:
    spec = ClusterSpec.for_this_machine(gpus=[str(i) for i in range(8)])
    nodes = node_gpus(spec)
    assert nodes["prefill"] == (4, ("0", "1", "2", "3"))
    assert nodes["decode"] == (4, ("4", "5", "6", "7"))
    assert nodes["head"] == (0, None)
    decode = next(n for n in spec.nodes() if n.name == "decode")
    env = local._node_env(Path("/nonexistent/token"), decode)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_odd_counts_explicit_counts_and_uuids() -> None:
    assert node_gpus(ClusterSpec.for_this_machine(gpus=["0", "1", "2"]))["decode"] == (
        2,
        ("1", "2"),
    )
    uuids = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    spec = ClusterSpec.for_this_machine(gpus=uuids, prefill_gpus=1)
    assert node_gpus(spec)["prefill"] == (1, ("GPU-a",))
    assert node_gpus(spec)["decode"] == (3, ("GPU-b", "GPU-c", "GPU-d"))
    with pytest.raises(ValueError, match="machine shows 4 GPU"):
        ClusterSpec.for_this_machine(gpus=uuids, prefill_gpus=3, decode_gpus=2)


def test_one_gpu_is_shared_and_no_gpu_means_cpu_nodes() -> None:
    spec = ClusterSpec.for_this_machine(gpus=["0"])
    assert node_gpus(spec)["prefill"] == (1, None) and node_gpus(spec)["decode"] == (1, None)
    spec = ClusterSpec.for_this_machine(gpus=[])
    assert node_gpus(spec)["prefill"] == (0, None) and node_gpus(spec)["decode"] == (0, None)
    assert spec.gpu_split() == (None, None)  # the raylets inherit the machine's view


def test_visible_gpus_follow_cuda_visible_devices() -> None:
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}) == []
