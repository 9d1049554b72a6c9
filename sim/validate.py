"""Validate the simulator against the real local cluster.

    python -m pdserve.sim.validate measure --config configs/local-2core-colocated.yaml \\
        --rates 0.75 1.5 --num-requests 40 --out-dir bench/results/sim-validate
    python -m pdserve.sim.validate compare --profile bench/results/sim-profile.json \\
        --run coloc@0.75=configs/local-2core-colocated.yaml:DIR/summary.json ...

``measure`` starts a real cluster (``pdserve up`` / ``serve`` / ``down``, always stopped),
runs ``bench.serve --save-requests`` once per rate (bounded by --num-requests and
--max-duration-s; each rate with its own seed: the engines cache prompt prefixes, and a
run that repeated the previous one's prompts would prefill almost nothing) and leaves one
``summary.json`` per rate, with a ``cpu.json``: the CPU time of every thread during the run
and during an idle spell before the runs, by the CPUs it may use and its niceness
(``sim.cpu_account``), and the cluster's CPU plan. ``compare`` replays each run's
requests (send times, prompt and output lengths) through the simulator, configured by the
same YAML and calibrated by a ``pdserve.sim.profile`` step profile, and prints predicted
vs measured TTFT and TPOT p50/p90 with the relative error; JSON goes next to it. Where the
CPU plan leaves a pool's engine on the CPUs the serving processes share, its steps get
what the serving path leaves of them (``sim.shared_cpu``), at the CPU cost per request the
``cpu.json`` of the config's runs measured (``--no-shared-cpu``: at the profiled speed).

Other jobs on the machine (threads allowed on every CPU) compete with both engines; they
are recorded in ``cpu.json`` (``cpus=0,1;nice0`` and each CPU's busy time), not modelled.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pdserve.cluster.topology import ClusterSpec
from pdserve.deployments.config import AppConfig
from pdserve.sim.admission import LiveAdmission, live_admission_available
from pdserve.sim.config import SharedCpuSettings, SimSettings
from pdserve.sim.cost import ProfileCost, StepProfile
from pdserve.sim.cpu_account import CpuSnapshot
from pdserve.sim.scenario import simulate
from pdserve.sim.shared_cpu import measured_settings
from pdserve.sim.workload import replay

PDSERVE = [sys.executable, "-m", "pdserve.cluster.cli"]


def _run(cmd: list[str], timeout_s: float) -> str:
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def measure(args: argparse.Namespace) -> int:
    from pdserve.engine.testmodel import ensure_test_model  # torch: only for measuring

    tokenizer = str(ensure_test_model("small"))
    out_dir = Path(args.out_dir)
    with tempfile.TemporaryDirectory(prefix="pdserve-validate-") as state:
        try:
            _run([*PDSERVE, "up", "--state-dir", state, "--prefill-cpus", "1",
                  "--decode-cpus", "2"], 300)  # fmt: skip
            _run([*PDSERVE, "serve", str(args.config), "--state-dir", state], 900)
            recorded = json.loads(_run([*PDSERVE, "status", "--json", "--state-dir", state], 60))
            serve = recorded["serve"]
            url = f"http://{serve['http_host']}:{serve['http_port']}"
            url += serve["route_prefix"].rstrip("/")
            plan = ClusterSpec.for_this_machine(prefill_cpus=1, decode_cpus=2).cpu_plan()
            # What the cluster's own daemons use of the CPUs with nothing to serve.
            before = CpuSnapshot.take()
            time.sleep(args.idle_s)
            idle = CpuSnapshot.take().since(before)
            for i, rate in enumerate(args.rates):
                run_dir = out_dir / f"{Path(args.config).stem}-rate{rate:g}"
                before = CpuSnapshot.take()
                _run(
                    [sys.executable, "-m", "pdserve.bench.serve", "--endpoint", f"pdserve={url}",
                     "--tokenizer", tokenizer, "--request-rate", str(rate),
                     "--num-requests", str(args.num_requests), "--max-duration-s",
                     str(args.max_duration_s), "--prompt-len", args.prompt_len,
                     "--output-len", args.output_len, "--warmup", "2", "--seed", str(args.seed + i),
                     "--save-requests", "--no-plot", "--request-timeout-s", "120",
                     "--out-dir", str(run_dir)],
                    args.max_duration_s + 300,
                )  # fmt: skip
                usage = CpuSnapshot.take().since(before)
                cpu = {"plan": plan.model_dump() if plan else None, "idle": idle, "run": usage}
                (run_dir / "cpu.json").write_text(json.dumps(cpu, indent=2) + "\n")
                print(f"measured {run_dir / 'summary.json'} and cpu.json", flush=True)
        finally:
            subprocess.run([*PDSERVE, "down", "--state-dir", state], timeout=300, check=False)
    return 0


def _pcts(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    p50, p90 = np.percentile(np.asarray(values), (50, 90))
    return float(p50), float(p90)


def compare_one(
    config: Path, summary: Path, prefill: StepProfile, decode: StepProfile, s: SimSettings
) -> dict:
    app = AppConfig.from_yaml(config)
    run = replay(summary)
    # The decode servers run issue 18's admission control; so does the simulation.
    admission = LiveAdmission(app) if live_admission_available() else None
    report, cluster = simulate(
        app, run.requests, ProfileCost(prefill), ProfileCost(decode), s, admission
    )
    sim_ttft = [r.ttft for r in run.requests if r.ttft is not None]
    sim_tpot = [r.tpot for r in run.requests if r.tpot is not None]
    rows = {}
    for metric, measured, predicted in (
        ("ttft", run.measured_ttft, sim_ttft),
        ("tpot", run.measured_tpot, sim_tpot),
    ):
        m50, m90 = _pcts(measured)
        p50, p90 = _pcts(predicted)
        rows[metric] = {
            "measured_p50": m50,
            "measured_p90": m90,
            "predicted_p50": p50,
            "predicted_p90": p90,
            "error_p50": (p50 - m50) / m50,
            "error_p90": (p90 - m90) / m90,
        }
    rows["placements"] = dict(cluster.counts)
    rows["measured_failed"] = len(run.requests) - len(run.measured_ttft)
    rows["requests"] = len(run.requests)
    return rows


def compare(args: argparse.Namespace) -> int:
    profiles = {}
    for spec in args.profile:
        key, _, path = spec.rpartition("=")
        profiles[key] = StepProfile.load(path)
    settings = SimSettings(rpc_s=args.rpc_ms / 1e3, ingress_s=args.ingress_ms / 1e3)
    runs = [_parse_run(spec) for spec in args.run]
    shared = {} if args.no_shared_cpu else _shared_cpu_by_run(runs, args.cpu_cost_from_others)
    for name, cpu in shared.items():
        print(
            f"{name}: {'/'.join(cpu.roles)} on {cpu.num_cpus} shared CPU(s); serving path "
            f"{cpu.s_per_request * 1e3:.0f} ms CPU per request, daemons {cpu.background:.1%} "
            "(measured, cpu.json)"
        )
    results = {}
    header = (
        f"{'run':<18}{'metric':<6}{'meas p50':>10}{'sim p50':>10}{'err':>8}"
        f"{'meas p90':>10}{'sim p90':>10}{'err':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, config, summary in runs:
        base = name.split("@")[0]
        pools = []
        for role in ("prefill", "decode"):
            found = [profiles.get(k) for k in (f"{base}:{role}", base, "")]
            profile = next((f for f in found if f is not None), None)
            if profile is None:
                raise ValueError(
                    f"no --profile for the {role} pool of run {name!r} (give "
                    f"{base}:{role}=FILE, {base}=FILE or a default FILE)"
                )
            pools.append(profile)
        run_settings = settings.model_copy(update={"shared_cpu": shared.get(name)})
        rows = compare_one(config, summary, pools[0], pools[1], run_settings)
        rows["shared_cpu"] = shared[name].model_dump() if name in shared else None
        results[name] = rows
        print(
            f"{name:<18}simulated placements {rows['placements']}; "
            f"measured failed/shed {rows['measured_failed']}"
        )
        for metric in ("ttft", "tpot"):
            r = rows[metric]
            print(
                f"{name:<18}{metric:<6}{r['measured_p50'] * 1e3:>10.0f}"
                f"{r['predicted_p50'] * 1e3:>10.0f}{r['error_p50']:>+8.0%}"
                f"{r['measured_p90'] * 1e3:>10.0f}{r['predicted_p90'] * 1e3:>10.0f}"
                f"{r['error_p90']:>+8.0%}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _parse_run(spec: str) -> tuple[str, Path, Path]:
    name, _, rest = spec.partition("=")
    config, _, summary = rest.partition(":")
    return name, Path(config), Path(summary)


def _shared_cpu_by_run(
    runs: list[tuple[str, Path, Path]], from_others: bool
) -> dict[str, SharedCpuSettings]:
    """Per run, the shared-CPU model measured over the runs of its config (their
    ``cpu.json``), or with ``from_others`` over the config's other runs only, so that
    nothing measured during a run goes into its own prediction but its send times."""
    measured: dict[str, tuple[Path, dict, int]] = {}
    for name, config, summary in runs:
        cpu = summary.parent / "cpu.json"
        if cpu.exists():
            n = len(replay(summary).requests)
            measured[name] = (config, json.loads(cpu.read_text()), n)
    out = {}
    for name, config, _ in runs:
        found = [
            (cpu, n)
            for other, (c, cpu, n) in measured.items()
            if c == config and not (from_others and other == name)
        ]
        settings = measured_settings(AppConfig.from_yaml(config), found)
        if settings is not None:
            out[name] = settings
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.sim.validate", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="run bench.serve against a real local cluster")
    m.add_argument("--config", type=Path, required=True)
    m.add_argument("--rates", type=float, nargs="+", required=True)
    m.add_argument("--num-requests", type=int, default=40)
    m.add_argument("--max-duration-s", type=float, default=120.0)
    m.add_argument("--prompt-len", default="uniform:64:512")
    m.add_argument("--output-len", default="fixed:32")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--idle-s", type=float, default=10.0, help="CPU use of the idle cluster")
    m.add_argument("--out-dir", default=f"bench/results/sim-validate-{time.strftime('%H%M%S')}")
    c = sub.add_parser("compare", help="predicted vs measured")
    c.add_argument("--profile", action="append", required=True,
                   help="FILE (default), NAME=FILE for runs named NAME@..., or "
                   "NAME:prefill=FILE / NAME:decode=FILE for one pool")  # fmt: skip
    c.add_argument("--run", action="append", required=True, help="NAME=CONFIG:SUMMARY")
    c.add_argument("--rpc-ms", type=float, default=1.0, help="one process hop")
    c.add_argument("--ingress-ms", type=float, default=3.0, help="ingress parse + tokenize")
    c.add_argument("--out", default="bench/results/sim-validate.json")
    c.add_argument(
        "--no-shared-cpu",
        action="store_true",
        help="ignore cpu.json: every engine computes at its profiled speed",
    )
    c.add_argument(
        "--cpu-cost-from-others",
        action="store_true",
        help="predict each run with the serving CPU cost of its config's other runs only",
    )
    args = p.parse_args(argv)
    return measure(args) if args.command == "measure" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
