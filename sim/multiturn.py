"""Prefix-aware vs prefix-blind routing on multi-turn chat at cluster scale, simulated with
the live routers, policy and prefix index over the roofline model:

    python -m pdserve.sim.multiturn [--model llama-3-8b] [--gpu h100] [--prefill 8]
        [--decode 8] [--rates 20 40 60] [--conversations 600] [--out-dir DIR]

Every request rate (requests per second over all turns) runs the same seeded conversations
(``prefix.multiturn_requests``) against one fixed-size cluster twice, ``router.prefix_aware``
on and off; with ``--autoscale-to P D`` the pools autoscale from their start sizes up to
that many replicas, so the GPU-seconds show what each routing needs to serve the load.
Prints a table per rate and writes ``multiturn.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdserve.deployments.config import AppConfig
from pdserve.sim.cost import CostModel, roofline
from pdserve.sim.metrics import Percentiles
from pdserve.sim.prefix import ConversationSpec, multiturn_requests
from pdserve.sim.request import SimRequest
from pdserve.sim.scenario import gpu_app, simulate


def with_routing(app: AppConfig, prefix_aware: bool, **router: Any) -> AppConfig:
    """``app`` with ``router.prefix_aware`` set, and any other router fields given."""
    changed = app.router.model_copy(update={"prefix_aware": prefix_aware, **router})
    return app.model_copy(update={"router": changed})


def run_mode(
    app: AppConfig, requests: list[SimRequest], cost: CostModel, name: str
) -> dict[str, Any]:
    """Simulate ``requests`` (fresh ones) on ``app``; the report plus the multi-turn view."""
    report, cluster = simulate(app, requests, cost)
    n = max(len(requests), 1)
    # GPU-seconds the engines spent computing, per pool: what the routing saves even where
    # the cluster's size (and so its provisioned GPU-seconds) is fixed.
    busy = {
        role: 1000 * sum(r.engine.busy_s * r.gpus for r in replicas) / n
        for role, replicas in (
            (role, [r for r in cluster.retired + cluster.pools[role] if r.role == role])
            for role in ("prefill", "decode")
        )
    }
    done = [r for r in requests if r.ttft is not None]
    first = [r.ttft for r in done if r.turn == 1 and r.ttft is not None]
    later = [r.ttft for r in done if r.turn >= 2 and r.ttft is not None]
    prompt = sum(r.prompt_tokens for r in done)
    later_prompt = sum(r.prompt_tokens for r in done if r.turn >= 2)
    p1, p2 = Percentiles.of(first), Percentiles.of(later)
    return {
        "routing": name,
        "goodput": report.goodput,
        "gpu_seconds_per_1k": report.gpu_seconds_per_1k,
        "busy_gpu_seconds_per_1k": busy,
        "completed": report.completed,
        "num_requests": report.num_requests,
        "ttft": asdict(report.ttft) if report.ttft else None,
        "tpot": asdict(report.tpot) if report.tpot else None,
        "ttft_turn1": asdict(p1) if p1 else None,
        "ttft_later_turns": asdict(p2) if p2 else None,
        "hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else None,
        "hit_rate_later_turns": (
            sum(r.cached_tokens for r in done if r.turn >= 2) / later_prompt
            if later_prompt
            else None
        ),
        "kv_bytes_per_request": cluster.kv_transfer_tokens * cost.kv_bytes_per_token / n,
        "placements": report.placements,
        "routing_decisions": {
            f"{pool}:{why}": n for (pool, why), n in cluster.prefix_reasons.items()
        },
        # Autoscaling's (time, prefill replicas, decode replicas) steps: the most it ran.
        "replicas_peak": {
            "prefill": max((p for _, p, _ in cluster.timeline), default=None),
            "decode": max((d for _, _, d in cluster.timeline), default=None),
        },
    }


def format_rows(rate: float, rows: list[dict[str, Any]]) -> str:
    def ms(p: dict[str, float] | None, key: str) -> str:
        return "-" if p is None else f"{p[key] * 1e3:.0f}"

    lines = [f"rate {rate:g} req/s"]
    for r in rows:
        hit = "-" if r["hit_rate_later_turns"] is None else f"{r['hit_rate_later_turns']:.0%}"
        lines.append(
            f"  {r['routing']:<6} goodput {r['goodput']:6.1%}"
            f"  GPU-s/1k {r['gpu_seconds_per_1k']:5.0f}"
            f" (busy P {r['busy_gpu_seconds_per_1k']['prefill']:4.0f}"
            f" D {r['busy_gpu_seconds_per_1k']['decode']:4.0f})"
            f"  TTFT p50/p99 turn1 {ms(r['ttft_turn1'], 'p50')}/{ms(r['ttft_turn1'], 'p99')} ms"
            f"  turns>=2 {ms(r['ttft_later_turns'], 'p50')}/{ms(r['ttft_later_turns'], 'p99')} ms"
            f"  hit turns>=2 {hit}  KV MB/req {r['kv_bytes_per_request'] / 1e6:.1f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--link", default=None, help="KV link (default: the cost model's)")
    p.add_argument("--prefill", type=int, default=8, help="prefill replicas at the start")
    p.add_argument("--decode", type=int, default=8, help="decode replicas at the start")
    p.add_argument("--autoscale-to", type=int, nargs=2, default=None, metavar=("P", "D"))
    p.add_argument("--rates", type=float, nargs="+", default=[20.0, 40.0, 60.0])
    p.add_argument("--conversations", type=int, default=600)
    p.add_argument("--turns", type=int, nargs=2, default=[2, 8], metavar=("MIN", "MAX"))
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--num-system-prompts", type=int, default=16)
    p.add_argument("--context-len", type=int, nargs=2, default=[1000, 3000])
    p.add_argument("--user-len", type=int, nargs=2, default=[50, 200])
    p.add_argument("--output-len", type=int, nargs=2, default=[50, 200])
    p.add_argument("--think-s", type=float, default=10.0)
    p.add_argument("--prefix-weight", type=float, default=None, help="router.prefix_weight")
    p.add_argument(
        "--prefix-max-imbalance", type=int, default=None, help="router.prefix_max_imbalance"
    )
    p.add_argument("--ttft-ms", type=float, default=500.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kwargs = {"link": args.link} if args.link else {}
    cost = roofline(args.model, args.gpu, **kwargs)
    base = gpu_app(
        args.prefill,
        args.decode,
        ttft_ms=args.ttft_ms,
        tpot_ms=args.tpot_ms,
        cost=cost,
        autoscale_to=tuple(args.autoscale_to) if args.autoscale_to else None,
    )
    router = {
        field: value
        for field, value in (
            ("prefix_weight", args.prefix_weight),
            ("prefix_max_imbalance", args.prefix_max_imbalance),
        )
        if value is not None
    }
    bs = base.decode.engine.block_size
    mean_turns = (args.turns[0] + args.turns[1]) / 2
    out: dict[str, Any] = {"args": vars(args), "rates": {}}
    for rate in args.rates:
        spec = ConversationSpec(
            conversation_rate=rate / mean_turns, num_conversations=args.conversations,
            min_turns=args.turns[0], max_turns=args.turns[1], system_len=args.system_len,
            num_system_prompts=args.num_system_prompts, context_len=tuple(args.context_len),
            user_len=tuple(args.user_len), output_len=tuple(args.output_len),
            think_s=args.think_s, seed=args.seed,
        )  # fmt: skip
        rows = []
        for name, aware in (("aware", True), ("blind", False)):
            began = time.perf_counter()
            row = run_mode(
                with_routing(base, aware, **router), multiturn_requests(spec, bs), cost, name
            )
            row["wall_s"] = time.perf_counter() - began
            rows.append(row)
        out["rates"][f"{rate:g}"] = rows
        print(format_rows(rate, rows), flush=True)
    out_dir = Path(args.out_dir or f"bench/results/sim-multiturn-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "multiturn.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {out_dir / 'multiturn.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
