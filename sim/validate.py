"""Validate the simulator against runs measured on the real local cluster.

    python -m pdserve.sim.validate compare --profile bench/results/sim-profile.json \\
        --run coloc@0.75=configs/local-2core-colocated.yaml:DIR/summary.json ...

The runs come from ``python -P -m pdserve.bench.sim_validate measure`` (``bench`` drives the
cluster; this module only reads what it left: ``summary.json``, ``warmup.json``, ``cpu.json``).

``compare`` replays each run (the warm-up requests one at a time, then the measured ones at
their send times, prompt and output lengths) through the simulator, configured by the same
YAML and calibrated by a ``pdserve.sim.profile`` step profile, and prints predicted vs
measured TTFT and TPOT p50/p90 with the relative error over the requests that both the
cluster and the simulation served, the requests each one shed or failed side by side, the
same over each one's own served requests, and a check of the CPU model against the run's
own accounting; JSON goes next to it. The serving path's CPU on the shared CPUs (per
request, per prompt token, per streamed output token and per decode step that streams:
from the calibration), the daemons' (idle spell) and the prefill process's own
per-request work besides its steps (its CPU in the calibration less the profile's
compute) drive ``sim.shared_cpu`` (``--no-shared-cpu``: every engine at its profiled
speed, tokens streamed at once). Every decode step also pays the decode
replica's engine-loop overhead (``cost.LoopOverheadCost``: the calibration's one-at-a-time
mean TPOT less the decode profile's step; ``--no-loop-overhead``: none). Take the profiles
next to the runs: a shared machine's speed drifts (docs/simulator.md).

Other jobs on the machine (threads allowed on every CPU) compete with both engines; they
are recorded in ``cpu.json`` (``cpus=0,1;nice0`` and each CPU's busy time), not modelled.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np

from pdserve.deployments.config import AppConfig, PoolRole
from pdserve.sim.cluster import LiveAdmission, SimCluster
from pdserve.sim.config import ROLES, SharedCpuSettings, SimSettings
from pdserve.sim.cost import (
    CostModel,
    LoopOverheadCost,
    ProfileCost,
    StepProfile,
    loop_overhead_s,
    prefill_s,
)
from pdserve.sim.cpu_account import engine_cpu_s, serving_cpu_s
from pdserve.sim.request import SimRequest
from pdserve.sim.shared_cpu import measured_settings, streams_per_step
from pdserve.sim.workload import replay

WARMUP = 2  # bench.serve's unmeasured requests before each run (replayed by the simulation)


def _pcts(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    p50, p90 = np.percentile(np.asarray(values), (50, 90))
    return float(p50), float(p90)


def _warmup(summary: Path) -> list[SimRequest]:
    """The run's warm-up requests (``warmup.json`` from ``measure``; none for older runs)."""
    path = summary.parent / "warmup.json"
    if not path.exists():
        return []
    return [
        SimRequest(-1 - i, 0.0, w["prompt_tokens"], w["output_tokens"])
        for i, w in enumerate(json.loads(path.read_text()))
    ]


def _reason(error: str | None) -> str:
    """'ttft_slo' from a 429's message 'overloaded (ttft_slo): ...', else the error's kind."""
    text = error or "unknown"
    if "overloaded (" in text:
        return text.split("overloaded (", 1)[1].split(")", 1)[0]
    return text.split(":", 1)[0]


def _errors(measured: list[float], predicted: list[float]) -> dict:
    m50, m90 = _pcts(measured)
    p50, p90 = _pcts(predicted)
    return {
        "measured_p50": m50,
        "measured_p90": m90,
        "predicted_p50": p50,
        "predicted_p90": p90,
        "error_p50": (p50 - m50) / m50,
        "error_p90": (p90 - m90) / m90,
        "count": len(measured),
    }


def compare_one(
    config: Path,
    summary: Path,
    prefill: StepProfile,
    decode: StepProfile,
    s: SimSettings,
    helper: StepProfile | None = None,
    loop_overhead: float = 0.0,
) -> dict:
    """Replay one run (its warm-up first, one at a time, then its requests at their send
    times) and compare, over the requests both the cluster and the simulation admitted
    (``ttft`` / ``tpot``) and over each one's own admitted requests (``all``), with the
    requests each one shed or failed side by side. ``loop_overhead``: seconds the decode
    replicas' engine loop adds to each profiled step (``cost.LoopOverheadCost``)."""
    app = AppConfig.from_yaml(config)
    run = replay(summary)
    records = {
        r["index"]: r for r in next(iter(json.loads(summary.read_text())["requests"].values()))
    }
    # The decode servers run their admission control; so does the simulation.
    admission = LiveAdmission(app)
    # The pools whose engines add helper threads on the shared CPUs (the colocated config's
    # decode engine), with the profile measured with the helpers, when given.
    helpers: dict[PoolRole, CostModel] = {
        role: LoopOverheadCost(ProfileCost(helper), loop_overhead)
        for role in ROLES
        if helper is not None and s.shared_cpu is not None and app.pool(role).cpu.helper_threads
    }
    decode_cost = LoopOverheadCost(ProfileCost(decode), loop_overhead)
    cluster = SimCluster(app, ProfileCost(prefill), decode_cost, s, admission, helper_costs=helpers)
    start = cluster.warm_up(_warmup(summary))
    for req in run.requests:
        req.arrival += start
    cluster.run(run.requests)
    served = {r.rid: r for r in run.requests if r.ttft is not None}
    ok = {i for i, r in records.items() if r.get("ok") and r.get("ttft") is not None}
    both = sorted(ok & served.keys())
    rows: dict = {}
    for metric in ("ttft", "tpot"):
        pairs = [
            (records[i][metric], getattr(served[i], metric))
            for i in both
            if records[i][metric] is not None and getattr(served[i], metric) is not None
        ]
        rows[metric] = _errors([m for m, _ in pairs], [p for _, p in pairs])
    rows["all"] = {
        metric: _errors(
            [records[i][metric] for i in ok if records[i][metric] is not None],
            [v for r in served.values() if (v := getattr(r, metric)) is not None],
        )
        for metric in ("ttft", "tpot")
    }
    measured_failed = {i: _reason(r.get("error")) for i, r in records.items() if i not in ok}
    simulated_failed = {r.rid: r.placement or "failed" for r in run.requests if r.rid not in served}
    rows["placements"] = dict(cluster.counts)
    rows["measured_failed"] = len(measured_failed)
    rows["measured_failed_by_reason"] = dict(Counter(measured_failed.values()))
    rows["simulated_failed"] = len(simulated_failed)
    rows["failed_both"] = sorted(measured_failed.keys() & simulated_failed.keys())
    rows["failed_only_measured"] = sorted(measured_failed.keys() - simulated_failed.keys())
    rows["failed_only_simulated"] = sorted(simulated_failed.keys() - measured_failed.keys())
    rows["requests"] = len(run.requests)
    rows["admitted_by_both"] = len(both)
    rows["warmup"] = len(_warmup(summary))
    rows["helper_threads_modelled"] = sorted(helpers)
    return rows


def cpu_check(
    app: AppConfig,
    summary: Path,
    shared: SharedCpuSettings,
    prefill: StepProfile,
) -> dict | None:
    """The run's measured CPU on the shared CPUs against what the calibrated model implies
    for the requests the cluster served (a check of the model, not an input to it)."""
    path = summary.parent / "cpu.json"
    if not path.exists():
        return None
    cpu = json.loads(path.read_text())
    cpus = tuple(cpu["plan"]["shared_cpus"])
    usage, idle = cpu["run"], cpu["idle"]
    records = next(iter(json.loads(summary.read_text())["requests"].values()))
    warm = _warmup(summary)
    ok = [r for r in records if r.get("ok")]
    sent = len(records) + len(warm)
    tokens = sum(r["output_tokens"] for r in ok) + sum(w.output_tokens for w in warm)
    prompt = sum(r["prompt_tokens"] for r in records) + sum(w.prompt_tokens for w in warm)
    wall = usage["wall_s"]
    streams = streams_per_step(records) or 1.0  # the run's tokens per decode step, measured
    out = {
        # Busy CPU time not in any thread alive at both ends of the run: the benchmark
        # client (a few seconds) and whatever else ran meanwhile (a quiet-machine check).
        "other_s": sum(usage["cpu_busy_s"].values()) - sum(usage["groups_s"].values()),
        "serving_measured_s": serving_cpu_s(usage, cpus) - shared.background * len(cpus) * wall,
        "serving_model_s": shared.s_per_request * sent
        + shared.s_per_output_token * tokens
        + shared.s_per_decode_step * tokens / streams
        + shared.s_per_prompt_token * prompt,
    }
    if "prefill" in shared.roles:
        chunk = app.prefill.engine.max_num_batched_tokens
        cost = ProfileCost(prefill)
        prompts = [r["prompt_tokens"] for r in ok] + [w.prompt_tokens for w in warm]
        out["engine_measured_s"] = (
            engine_cpu_s(usage, cpus) - engine_cpu_s(idle, cpus) / idle["wall_s"] * wall
        )
        out["engine_model_s"] = sum(prefill_s(cost, n, chunk) for n in prompts) + (
            shared.engine_s_per_request * len(prompts)
            + shared.engine_s_per_prompt_token * sum(prompts)
        )
    return out


def compare(args: argparse.Namespace) -> int:
    profiles = {}
    for spec in args.profile:
        key, _, path = spec.rpartition("=")
        profiles[key] = StepProfile.load(path)
    settings = SimSettings(rpc_s=args.rpc_ms / 1e3, ingress_s=args.ingress_ms / 1e3)
    runs = [_parse_run(spec) for spec in args.run]
    pools = {name: _profiles_of(name, profiles) for name, _, _ in runs}
    shared = (
        {} if args.no_shared_cpu else _shared_cpu_by_run(runs, pools, args.cpu_cost_from_others)
    )
    for name, cpu in shared.items():
        print(
            f"{name}: {'/'.join(cpu.roles)} on {cpu.num_cpus} shared CPU(s); serving path "
            f"{cpu.s_per_request * 1e3:.0f} ms CPU per request + "
            f"{cpu.s_per_output_token * 1e3:.2f} ms per output token + "
            f"{cpu.s_per_decode_step * 1e3:.2f} ms per decode step + "
            f"{cpu.s_per_prompt_token * 1e3:.3f} ms per prompt token; engine process "
            f"{cpu.engine_s_per_request * 1e3:.0f} ms per request + "
            f"{cpu.engine_s_per_prompt_token * 1e3:.3f} ms per prompt token besides its "
            "steps; daemons "
            f"{cpu.background:.1%} (measured, cpu.json)"
        )
    results = {}
    header = (
        f"{'run':<18}{'metric':<6}{'meas p50':>10}{'sim p50':>10}{'err':>8}"
        f"{'meas p90':>10}{'sim p90':>10}{'err':>8}"
    )
    print("over the requests both admitted (ms):")
    print(header)
    print("-" * len(header))
    for name, config, summary in runs:
        prefill, decode = pools[name]
        run_settings = settings.model_copy(update={"shared_cpu": shared.get(name)})
        helper = profiles.get(f"{name.split('@')[0]}:helper")
        overhead = 0.0 if args.no_loop_overhead else _loop_overhead(summary, decode)
        rows = compare_one(config, summary, prefill, decode, run_settings, helper, overhead)
        rows["loop_overhead_s"] = overhead
        print(f"{name:<18}decode engine loop {overhead * 1e3:.2f} ms per step besides the profile")
        rows["shared_cpu"] = shared[name].model_dump() if name in shared else None
        if name in shared:
            app = AppConfig.from_yaml(config)
            rows["cpu_check"] = cpu_check(app, summary, shared[name], prefill)
        results[name] = rows
        print(
            f"{name:<18}admitted by both {rows['admitted_by_both']}/{rows['requests']}; "
            f"failed: measured {rows['measured_failed']} {rows['measured_failed_by_reason']}, "
            f"simulated {rows['simulated_failed']} {rows['placements']}; both "
            f"{rows['failed_both']}, only measured {rows['failed_only_measured']}, only "
            f"simulated {rows['failed_only_simulated']}"
        )
        if rows.get("cpu_check"):
            c = rows["cpu_check"]
            line = (
                f"{name:<18}CPU check: serving path measured {c['serving_measured_s']:.1f} s, "
                f"model {c['serving_model_s']:.1f} s; other processes {c['other_s']:.1f} s"
            )
            if "engine_measured_s" in c:
                line += (
                    f"; prefill process measured {c['engine_measured_s']:.1f} s, model "
                    f"{c['engine_model_s']:.1f} s"
                )
            print(line)
        for label, table in (("", rows), ("all ", rows["all"])):
            for metric in ("ttft", "tpot"):
                r = table[metric]
                print(
                    f"{name:<18}{label + metric:<6}{r['measured_p50'] * 1e3:>10.0f}"
                    f"{r['predicted_p50'] * 1e3:>10.0f}{r['error_p50']:>+8.0%}"
                    f"{r['measured_p90'] * 1e3:>10.0f}{r['predicted_p90'] * 1e3:>10.0f}"
                    f"{r['error_p90']:>+8.0%}"
                )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _loop_overhead(summary: Path, decode: StepProfile) -> float:
    """The decode replica's engine-loop overhead per step (``cost.loop_overhead_s``) from
    the run's calibration (``cpu.json``): the long batch's mean TPOT, one request at a time,
    less the decode profile's step; 0 when not measured."""
    path = summary.parent / "cpu.json"
    calibration = json.loads(path.read_text()).get("calibration") if path.exists() else None
    long = (calibration or {}).get("long") or {}
    if not long.get("tpot_mean_s"):
        return 0.0
    return loop_overhead_s(
        ProfileCost(decode), long["tpot_mean_s"], long["prompt_tokens"], long["output_tokens"]
    )


def _profiles_of(name: str, profiles: dict[str, StepProfile]) -> tuple[StepProfile, StepProfile]:
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
    return pools[0], pools[1]


def _parse_run(spec: str) -> tuple[str, Path, Path]:
    name, _, rest = spec.partition("=")
    config, _, summary = rest.partition(":")
    return name, Path(config), Path(summary)


def _shared_cpu_by_run(
    runs: list[tuple[str, Path, Path]],
    pools: dict[str, tuple[StepProfile, StepProfile]],
    from_others: bool,
) -> dict[str, SharedCpuSettings]:
    """Per run, the shared-CPU model measured over the runs of its config (their
    ``cpu.json``), or with ``from_others`` over the config's other runs only, so that
    nothing measured during a run goes into its own prediction but its send times (the
    calibration batches, run after all the rates, count for every run)."""
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
        app = AppConfig.from_yaml(config)
        cost = ProfileCost(pools[name][0])
        chunk = app.prefill.engine.max_num_batched_tokens
        settings = measured_settings(app, found, partial(prefill_s, cost, chunk=chunk))
        if settings is not None:
            out[name] = settings
    return out


def add_compare_arguments(c: argparse.ArgumentParser) -> None:
    """The ``compare`` command's options (also ``pdserve.bench.sim_validate compare``'s)."""
    c.add_argument("--profile", action="append", required=True,
                   help="FILE (default), NAME=FILE for runs named NAME@..., or "
                   "NAME:prefill=FILE / NAME:decode=FILE for one pool; NAME:helper=FILE: "
                   "measured with the pool's helper threads (sim.profile --helper-threads), "
                   "for a pool that has them")  # fmt: skip
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
    c.add_argument(
        "--no-loop-overhead",
        action="store_true",
        help="time the decode steps by the profile alone (no engine-loop overhead per step "
        "from the calibration's one-at-a-time TPOT)",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.sim.validate", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    add_compare_arguments(sub.add_parser("compare", help="predicted vs measured"))
    return compare(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
