"""`pdserve serve` refuses, with the reason, a pool whose replica no node can hold (a
tensor-parallel replica needs all its ranks' CPUs and GPUs on one labelled node), instead
of leaving Serve waiting for it forever."""

from __future__ import annotations

from pdserve.cluster.serving import NodeCapacity, unplaceable_pools
from pdserve.deployments.config import AppConfig

NODES = [
    NodeCapacity("head", {}, {"CPU": 0.0}),
    NodeCapacity("p", {"pdserve.io/pool": "prefill"}, {"CPU": 2.0}),
    NodeCapacity("d", {"pdserve.io/pool": "decode"}, {"CPU": 1.0}),
]


def _config(prefill_tp: int, decode_tp: int) -> AppConfig:
    return AppConfig.from_dict(
        {
            "model": {"test_model": "tiny", "device": "cpu"},
            "prefill": {"num_cpus": 1, "tensor_parallel_size": prefill_tp},
            "decode": {"num_cpus": 1, "tensor_parallel_size": decode_tp},
        }
    )


def test_replicas_that_fit_their_labelled_node_pass() -> None:
    assert unplaceable_pools(_config(2, 1), NODES) == []


def test_a_tp_replica_larger_than_every_node_is_named() -> None:
    [problem] = unplaceable_pools(_config(1, 2), NODES)
    assert problem.startswith("decode: a replica needs 2 CPU and 0 GPU on one node")
    assert "tensor_parallel_size 2" in problem and "d (1 CPU, 0 GPU)" in problem
    # The prefill node has 2 CPUs, but its label is not the decode pool's.
    assert "p (" not in problem


def test_no_node_with_the_pool_label() -> None:
    [problem] = unplaceable_pools(_config(1, 1), NODES[:2])
    assert problem.startswith("decode:") and problem.endswith("nodes: none match")
