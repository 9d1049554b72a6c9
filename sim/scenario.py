"""Ready-made simulations: a GPU cluster's ``AppConfig`` from a few numbers, and one call
that runs requests through a ``SimCluster`` and summarises them.

GPU deployments use vLLM-like engine limits: a colocated replica chunks prefills at 2048
tokens per step next to up to 256 decodes; a prefill replica takes 8192-token steps; a
decode replica batches up to 256 sequences. KV capacity comes from the cost model.
"""

from __future__ import annotations

from pdserve.deployments.config import AppConfig
from pdserve.sim.cluster import Admission, SimCluster
from pdserve.sim.config import SimSettings
from pdserve.sim.cost import CostModel, RooflineCost, prefill_tokens_per_s
from pdserve.sim.metrics import SimReport, summarize
from pdserve.sim.request import SimRequest

COLOCATED_CHUNK = 2048
PREFILL_CHUNK = 8192
DECODE_SEQS = 256


def gpu_app(
    num_prefill: int,
    num_decode: int,
    *,
    ttft_ms: float,
    tpot_ms: float,
    cost: CostModel,
    autoscale_to: tuple[int, int] | None = None,
) -> AppConfig:
    """An ``AppConfig`` for ``num_prefill`` prefill + ``num_decode`` decode replicas
    (``num_prefill == 0``: colocated, every prompt prefilled by its decode replica).

    ``autoscale_to``: (max prefill, max decode) replicas for pdserve's autoscaling policies.
    """
    if num_decode < 1 or num_prefill < 0:
        raise ValueError(
            f"need >= 1 decode and >= 0 prefill replicas, got {num_prefill}:{num_decode}"
        )
    colocated = num_prefill == 0
    rate = prefill_tokens_per_s(cost, 2048, PREFILL_CHUNK)
    link = getattr(cost, "link", None)
    max_p, max_d = autoscale_to or (max(num_prefill, 1), num_decode)
    return AppConfig.from_dict(
        {
            "prefill": {
                "min_replicas": 0 if colocated else 1,
                "initial_replicas": num_prefill,
                "max_replicas": max(max_p, num_prefill, 1),
                "engine": {"max_num_batched_tokens": PREFILL_CHUNK, "max_num_seqs": 64},
            },
            "decode": {
                "min_replicas": 1,
                "initial_replicas": num_decode,
                "max_replicas": max(max_d, num_decode),
                "max_ongoing_requests": 4 * DECODE_SEQS,
                "engine": {
                    "max_num_batched_tokens": COLOCATED_CHUNK if colocated else 512,
                    "max_num_seqs": DECODE_SEQS,
                },
            },
            "slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms},
            "policy": {"mode": "always_local" if colocated else "auto"},
            "router": {
                "default_prefill_tokens_per_s": rate,
                "transfer_bytes_per_s": link.bytes_per_s if link is not None else 1e9,
            },
            "transport": {"timeout_s": 30.0},
            "autoscaling": autoscale_to is not None,
        }
    )


def simulate(
    app: AppConfig,
    requests: list[SimRequest],
    prefill_cost: CostModel,
    decode_cost: CostModel | None = None,
    settings: SimSettings | None = None,
    admission: Admission | None = None,
) -> tuple[SimReport, SimCluster]:
    """Run ``requests`` (fresh ones: they are filled in) and summarise against app.slo."""
    cluster = SimCluster(app, prefill_cost, decode_cost or prefill_cost, settings, admission)
    cluster.run(requests)
    report = summarize(
        requests,
        slo_ttft_s=app.slo.ttft_ms / 1000,
        slo_tpot_s=app.slo.tpot_ms / 1000,
        gpu_seconds=cluster.gpu_seconds(),
        placements=cluster.counts,
        timeline=cluster.timeline,
    )
    return report, cluster


def gpus_of(app: AppConfig, cost: CostModel) -> int:
    tp = cost.tp if isinstance(cost, RooflineCost) else 1
    return (app.prefill.start_replicas + app.decode.start_replicas) * tp
