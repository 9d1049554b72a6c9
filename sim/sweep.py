"""Colocated vs disaggregated on a GPU cluster of fixed size, simulated with the live
router and policy over the roofline model:

    python -m pdserve.sim.sweep [--model llama-3-8b] [--gpu h100] [--gpus 8] [--trace chat]
        [--ttft-ms 500] [--tpot-ms 100 50 35 25 20 15] [--out-dir bench/results/sim-sweep]

Every configuration (colocated on all GPUs, and each P:D split) is simulated once per
request rate on a grid; SLO attainment for each TPOT SLO is computed from the same runs
(the policy and routers use only the TTFT SLO, so a TPOT SLO does not change a run).
Per-GPU goodput, DistServe's metric, is the highest rate whose attainment stays >= the
target (interpolated on the grid), divided by the GPUs.

Prints the tables, writes ``sweep.json`` and ``sweep.png`` (goodput vs rate at one TPOT
SLO for every configuration; per-GPU goodput vs TPOT SLO, colocated vs the best split).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from pdserve.sim.cost import roofline
from pdserve.sim.request import SimRequest
from pdserve.sim.scenario import gpu_app, simulate
from pdserve.sim.workload import generate


def key(tpot_ms: float) -> str:
    return f"{tpot_ms:g}"


def attainment(reqs: list[SimRequest], ttft_s: float, tpot_s: float) -> float:
    ok = sum(
        1
        for r in reqs
        if r.ttft is not None and r.ttft <= ttft_s and (r.tpot is None or r.tpot <= tpot_s)
    )
    return ok / max(len(reqs), 1)


def max_rate(rates: list[float], goodput: list[float], target: float) -> float:
    """Highest rate before attainment first drops below ``target`` (linear in between)."""
    if not goodput or goodput[0] < target:
        return 0.0
    for i in range(1, len(rates)):
        if goodput[i] < target:
            g0, g1 = goodput[i - 1], goodput[i]
            return rates[i - 1] + (rates[i] - rates[i - 1]) * (g0 - target) / (g0 - g1)
    return rates[-1]


def configs(gpus: int, tp: int) -> list[tuple[int, int]]:
    replicas = gpus // tp
    return [(0, replicas)] + [(p, replicas - p) for p in range(1, replicas)]


def label(p: int, d: int) -> str:
    return f"colocated x{d}" if p == 0 else f"{p}P:{d}D"


def run_grid(args: argparse.Namespace) -> dict:
    cost = roofline(args.model, args.gpu, tp=args.tp, link=args.link)
    tpots = [t / 1e3 for t in args.tpot_ms]
    ttft = args.ttft_ms / 1e3
    rates = list(np.geomspace(args.min_rate, args.max_rate, args.num_rates))
    out: dict = {"rates": rates, "tpot_ms": args.tpot_ms, "configs": {}}
    for p, d in configs(args.gpus, args.tp):
        table: dict[str, list[float]] = {key(t): [] for t in args.tpot_ms}
        began = time.perf_counter()
        for rate in rates:
            n = int(min(args.max_requests, max(args.min_requests, rate * args.seconds)))
            reqs = generate(args.trace, rate, n, seed=args.seed)
            app = gpu_app(p, d, ttft_ms=args.ttft_ms, tpot_ms=min(args.tpot_ms), cost=cost)
            simulate(app, reqs, cost)
            for t_ms, t in zip(args.tpot_ms, tpots, strict=True):
                table[key(t_ms)].append(attainment(reqs, ttft, t))
        out["configs"][label(p, d)] = {"prefill": p, "decode": d, "goodput": table}
        print(f"  {label(p, d):<14} simulated in {time.perf_counter() - began:.1f} s", flush=True)
    return out


def summarise(grid: dict, gpus: int, target: float) -> dict:
    rates = grid["rates"]
    per_gpu: dict[str, dict[str, float]] = {}
    for name, c in grid["configs"].items():
        per_gpu[name] = {t: max_rate(rates, g, target) / gpus for t, g in c["goodput"].items()}
    curve = []
    for t in grid["tpot_ms"]:
        coloc = next(v[key(t)] for k, v in per_gpu.items() if k.startswith("colocated"))
        best_name, best = max(
            ((k, v[key(t)]) for k, v in per_gpu.items() if not k.startswith("colocated")),
            key=lambda kv: kv[1],
        )
        curve.append(
            {"tpot_ms": t, "colocated": coloc, "best_split": best_name, "disaggregated": best}
        )
    return {"per_gpu_goodput": per_gpu, "curve": curve}


def crossover(grid: dict, tpot_ms: float) -> float | None:
    """Lowest grid rate from which the best split's attainment beats colocated's."""
    rates, k = grid["rates"], key(tpot_ms)
    coloc = next(c for n, c in grid["configs"].items() if n.startswith("colocated"))
    splits = [c for n, c in grid["configs"].items() if not n.startswith("colocated")]
    for i, rate in enumerate(rates):
        best = max(c["goodput"][k][i] for c in splits)
        if best > coloc["goodput"][k][i] + 0.01:
            return rate
    return None


def plot(grid: dict, summary: dict, tpot_ms: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for name, c in grid["configs"].items():
        style = "k-o" if name.startswith("colocated") else "--"
        a.plot(grid["rates"], c["goodput"][key(tpot_ms)], style, label=name, markersize=3)
    a.set_xscale("log")
    a.set_xlabel("request rate (req/s)")
    a.set_ylabel("goodput (fraction within both SLOs)")
    a.set_title(f"goodput vs rate, TPOT SLO {tpot_ms:g} ms")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    curve = summary["curve"]
    xs = [c["tpot_ms"] for c in curve]
    b.plot(xs, [c["colocated"] for c in curve], "k-o", label="colocated")
    b.plot(xs, [c["disaggregated"] for c in curve], "r-s", label="best P:D split")
    for c in curve:
        b.annotate(c["best_split"], (c["tpot_ms"], c["disaggregated"]), fontsize=7)
    b.set_xscale("log")
    b.invert_xaxis()
    b.set_xlabel("TPOT SLO (ms), tightening to the right")
    b.set_ylabel("per-GPU goodput (req/s per GPU at >= 90% attainment)")
    b.set_title("per-GPU goodput vs TPOT SLO")
    b.legend()
    b.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.sim.sweep", description=__doc__)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--link", default="nvlink")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--trace", default="chat")
    p.add_argument("--ttft-ms", type=float, default=500.0)
    p.add_argument("--tpot-ms", type=float, nargs="+", default=[100, 50, 35, 25, 20, 15])
    p.add_argument("--plot-tpot-ms", type=float, default=25.0)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--min-rate", type=float, default=4.0)
    p.add_argument("--max-rate", type=float, default=640.0)
    p.add_argument("--num-rates", type=int, default=12)
    p.add_argument("--seconds", type=float, default=20.0, help="simulated arrivals per run")
    p.add_argument("--min-requests", type=int, default=400)
    p.add_argument("--max-requests", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/sim-sweep"))
    args = p.parse_args(argv)
    if args.gpus % args.tp or args.gpus // args.tp < 2:
        p.error("--gpus must be a multiple of --tp holding >= 2 replicas")
    if args.plot_tpot_ms not in args.tpot_ms:
        args.tpot_ms.append(args.plot_tpot_ms)
    args.tpot_ms = sorted(set(args.tpot_ms), reverse=True)
    began = time.perf_counter()
    grid = run_grid(args)
    summary = summarise(grid, args.gpus, args.target)
    title = (
        f"{args.model} on {args.gpus} x {args.gpu.upper()} (tp={args.tp}), {args.trace} trace, "
        f"TTFT SLO {args.ttft_ms:g} ms, attainment target {args.target:.0%}"
    )
    print(title)
    print(f"{'TPOT SLO':>9}{'colocated':>11}{'best split':>12}{'disagg':>9}{'ratio':>7}"
          f"{'disagg wins from':>18}")  # fmt: skip
    for c in summary["curve"]:
        cross = crossover(grid, c["tpot_ms"])
        c["crossover_rate"] = cross
        ratio = c["disaggregated"] / c["colocated"] if c["colocated"] else float("inf")
        print(
            f"{c['tpot_ms']:>7g}ms{c['colocated']:>11.2f}{c['best_split']:>12}"
            f"{c['disaggregated']:>9.2f}{ratio:>7.2f}"
            f"{(f'{cross:.1f} req/s' if cross else 'never'):>18}"
        )
    print("(per-GPU goodput in req/s per GPU)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "sweep.json").write_text(
        json.dumps({"title": title, "grid": grid, "summary": summary}, indent=2) + "\n"
    )
    plot(grid, summary, args.plot_tpot_ms, args.out_dir / "sweep.png", title)
    print(
        f"wrote {args.out_dir / 'sweep.json'} and sweep.png in {time.perf_counter() - began:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
