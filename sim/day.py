"""A simulated day of a large cluster, compressed into one hour, with pdserve's autoscaling:

    python -m pdserve.sim.day [--gpus 512] [--model llama-3-70b] [--gpu h100] [--tp 8]
        [--trace summarisation] [--base-rate 60] [--peak-rate 300] [--hours 1]
        [--autoscaling application|deployment] [--out-dir bench/results/sim-day]

Arrivals follow one diurnal cycle (trough, peak at mid-run, trough). Both pools scale with
the live autoscaling policies between their bounds, which split the cluster's GPUs
(``--prefill-share`` of the replicas may be prefill); ``--autoscaling`` picks the joint
application-level policy a Serve config deploys (default) or the per-pool policies of
``serve.run``. Prints the wall time, the report and
the replica counts over time; writes ``day.json`` and ``day.png`` (rate and replicas over
time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from pdserve.sim.config import SimSettings
from pdserve.sim.cost import roofline
from pdserve.sim.metrics import format_report
from pdserve.sim.scenario import gpu_app, simulate
from pdserve.sim.workload import diurnal, make_requests, trace, varying_rate_arrivals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.sim.day", description=__doc__)
    p.add_argument("--gpus", type=int, default=512)
    p.add_argument("--model", default="llama-3-70b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--link", default="infiniband")
    p.add_argument("--trace", default="summarisation")
    p.add_argument("--base-rate", type=float, default=60.0)
    p.add_argument("--peak-rate", type=float, default=300.0)
    p.add_argument("--hours", type=float, default=1.0)
    p.add_argument("--prefill-share", type=float, default=0.8)
    p.add_argument(
        "--decode-min", type=int, default=8, help="decode floor (see the report on seats)"
    )
    p.add_argument("--ttft-ms", type=float, default=3000.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--autoscaling", choices=("application", "deployment"), default="application")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/sim-day"))
    args = p.parse_args(argv)
    replicas = args.gpus // args.tp
    if replicas < 2 or not 0 < args.prefill_share < 1:
        p.error("need >= 2 replicas and 0 < --prefill-share < 1")
    max_p = max(1, round(replicas * args.prefill_share))
    max_d = replicas - max_p
    period = args.hours * 3600
    cost = roofline(args.model, args.gpu, tp=args.tp, link=args.link)
    rng = np.random.default_rng(args.seed)
    rate_at = diurnal(args.base_rate, args.peak_rate, period)
    arrivals = varying_rate_arrivals(rng, rate_at, args.peak_rate, period)
    requests = make_requests(trace(args.trace), arrivals, rng)
    start_p, start_d = max(1, max_p // 4), min(max(args.decode_min, max_d // 2), max_d)
    app = gpu_app(
        start_p,
        start_d,
        ttft_ms=args.ttft_ms,
        tpot_ms=args.tpot_ms,
        cost=cost,
        autoscale_to=(max_p, max_d),
    )
    app = app.model_copy(
        update={
            "prefill": app.prefill.model_copy(update={"min_replicas": 1}),
            "decode": app.decode.model_copy(update={"min_replicas": min(args.decode_min, max_d)}),
        }
    )
    settings = SimSettings(
        gpus_per_prefill_replica=args.tp,
        gpus_per_decode_replica=args.tp,
        replica_startup_s=60.0,
        autoscale_period_s=5.0,
        autoscaling_policy=args.autoscaling,
    )
    print(
        f"{args.gpus} x {args.gpu.upper()} = {replicas} replicas of {args.model} (tp={args.tp}),"
        f" at most {max_p} prefill + {max_d} decode; {args.trace} trace, "
        f"{len(requests)} requests over {period:.0f} s ({args.base_rate:g}-{args.peak_rate:g} "
        "req/s)",
        flush=True,
    )
    began, cpu = time.perf_counter(), time.process_time()
    report, cluster = simulate(app, requests, cost, cost, settings)
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    print(format_report("day", report))
    print(f"placements {report.placements}; events {cluster.loop.num_processed}")
    reasons = {f"{where}:{why}": n for (where, why), n in cluster.reasons.most_common()}
    print(f"policy decisions {reasons}; remote refused for lack of KV room {cluster.kv_refused}")
    decode = [d for _, _, d in report.timeline]
    print(f"decode replicas {min(decode, default=0)}..{max(decode, default=0)} "
          f"({args.autoscaling} autoscaling)")  # fmt: skip
    peak = max(report.timeline, key=lambda t: t[1] + t[2])
    print(f"peak replicas {peak[1]}P + {peak[2]}D = {(peak[1] + peak[2]) * args.tp} GPUs "
          f"at t={peak[0]:.0f} s; GPU-hours {report.gpu_seconds / 3600:.0f}")  # fmt: skip
    print(f"{'t (s)':>7}{'rate':>7}{'prefill':>9}{'decode':>8}")
    for t, n_p, n_d in report.timeline[:: max(1, len(report.timeline) // 12)]:
        print(f"{t:>7.0f}{rate_at(t):>7.0f}{n_p:>9}{n_d:>8}")
    print(
        f"simulated one {period:.0f} s day of {args.gpus} GPUs in {wall:.1f} s wall, "
        f"{cpu:.1f} s CPU ({1e6 * cpu / max(len(requests), 1):.0f} us per request)"
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    data = {"args": {k: str(v) for k, v in vars(args).items()}, "wall_s": wall, "cpu_s": cpu}
    data |= {"decisions": reasons, "kv_refused": cluster.kv_refused}
    data |= {"report": report.to_json()}
    (args.out_dir / "day.json").write_text(json.dumps(data, indent=2) + "\n")
    _plot(report.timeline, rate_at, args.tp, args.out_dir / "day.png")
    print(f"wrote {args.out_dir / 'day.json'} and day.png")
    return 0


def _plot(timeline, rate_at, tp: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [t for t, _, _ in timeline]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(ts, [p * tp for _, p, _ in timeline], label="prefill GPUs")
    ax.plot(ts, [d * tp for _, _, d in timeline], label="decode GPUs")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("GPUs")
    ax2 = ax.twinx()
    ax2.plot(ts, [rate_at(t) for t in ts], "k:", label="arrival rate")
    ax2.set_ylabel("req/s")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
