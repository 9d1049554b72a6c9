"""Measure a real local cluster for the simulator's validation (``pdserve.sim.validate``).

    python -P -m pdserve.bench.sim_validate measure --config configs/local-2core-colocated.yaml \\
        --rates 0.3 0.6 --num-requests 60 --max-duration-s 240 --out-dir DIR
    python -P -m pdserve.bench.sim_validate compare --profile bench/results/sim-profile.json \\
        --run coloc@0.75=configs/local-2core-colocated.yaml:DIR/summary.json ...

``measure`` starts a real cluster (``pdserve up`` / ``serve`` / ``down``, always stopped),
runs ``bench.serve --save-requests`` once per rate (bounded by --num-requests and
--max-duration-s; each rate with its own seed: the engines cache prompt prefixes, and a
run that repeated the previous one's prompts would prefill almost nothing) and leaves one
``summary.json`` per rate, with a ``warmup.json`` (the prompt and output lengths of the
warm-up requests bench.serve sent first) and a ``cpu.json``: the CPU time of every thread
during the run and during an idle spell before the runs, by the CPUs it may use and its
niceness (``sim.cpu_account``), the cluster's CPU plan, and a ``calibration`` of the
serving path taken after the runs: batches of --calibration-requests requests, one at a
time, with 64-token prompts and 1 or 1 + --calibration-tokens output tokens, with
--calibration-prompt-token prompts and 1 output token, and the long one again
--calibration-streams at a time (with the streams per decode step it measured).

``compare`` is ``pdserve.sim.validate``'s: the simulator replays what ``measure`` left.
This module sits in ``bench`` because it drives a cluster and ``bench.serve``; the
simulator itself imports nothing from ``bench``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.serve_workload import LengthDist, build_workload
from pdserve.cluster.topology import ClusterSpec
from pdserve.sim import validate
from pdserve.sim.cpu_account import CpuSnapshot
from pdserve.sim.shared_cpu import streams_per_step

# -P: never the working directory first on sys.path (a checkout's root would shadow Hugging
# Face's `kernels`, which transformers imports, with pdserve's own folder of that name).
PYTHON = [sys.executable, "-P"]
PDSERVE = [*PYTHON, "-m", "pdserve.cluster.cli"]
WARMUP = validate.WARMUP
CALIBRATION_PROMPT = 64  # tokens: remote in the disaggregated config, cheap to prefill


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
            runs: dict[Path, dict] = {}
            for i, rate in enumerate(args.rates):
                run_dir = out_dir / f"{Path(args.config).stem}-rate{rate:g}"
                before = CpuSnapshot.take()
                _run(
                    [*PYTHON, "-m", "pdserve.bench.serve", "--endpoint", f"pdserve={url}",
                     "--tokenizer", tokenizer, "--request-rate", str(rate),
                     "--num-requests", str(args.num_requests), "--max-duration-s",
                     str(args.max_duration_s), "--prompt-len", args.prompt_len,
                     "--output-len", args.output_len, "--warmup", str(WARMUP),
                     "--seed", str(args.seed + i),
                     "--save-requests", "--no-plot", "--request-timeout-s", "120",
                     "--out-dir", str(run_dir)],
                    args.max_duration_s + 300,
                )  # fmt: skip
                usage = CpuSnapshot.take().since(before)
                warm = _warmup_requests(tokenizer, args, rate, args.seed + i)
                (run_dir / "warmup.json").write_text(json.dumps(warm, indent=2) + "\n")
                runs[run_dir] = {
                    "plan": plan.model_dump() if plan else None,
                    "idle": idle,
                    "run": usage,
                }
                (run_dir / "cpu.json").write_text(json.dumps(runs[run_dir], indent=2) + "\n")
                print(f"measured {run_dir / 'summary.json'}, warmup.json and cpu.json", flush=True)
            calibration = _calibrate(
                url, tokenizer, out_dir / f"{Path(args.config).stem}-calibration", args
            )
            for run_dir, cpu in runs.items():
                cpu["calibration"] = calibration
                (run_dir / "cpu.json").write_text(json.dumps(cpu, indent=2) + "\n")
            print(f"calibrated the serving CPU: {_calibration_line(calibration)}", flush=True)
        finally:
            subprocess.run([*PDSERVE, "down", "--state-dir", state], timeout=300, check=False)
    return 0


def _warmup_requests(tokenizer: str, args: argparse.Namespace, rate: float, seed: int) -> list:
    """The prompt and output lengths of the warm-up requests ``bench.serve`` sent first (the
    first ``WARMUP`` of the workload it builds from the same arguments)."""
    from transformers import AutoTokenizer

    workload = build_workload(
        AutoTokenizer.from_pretrained(tokenizer, local_files_only=True),
        num_requests=args.num_requests + WARMUP,
        prompt_len=LengthDist.parse(args.prompt_len),
        output_len=LengthDist.parse(args.output_len),
        rate=rate,
        seed=seed,
    )
    return [
        {"prompt_tokens": r.prompt_tokens, "output_tokens": r.max_tokens} for r in workload[:WARMUP]
    ]


def _calibrate(url: str, tokenizer: str, out_dir: Path, args: argparse.Namespace) -> dict:
    """The serving path's CPU per request, per output token and per prompt token
    (``sim.shared_cpu``): batches of ``--calibration-requests`` requests, each between two
    ``CpuSnapshot`` s: one at a time, "short" (64-token prompts, 1 output token), "long"
    (the same prompts, 1 + ``--calibration-tokens`` output tokens) and "prompt"
    (``--calibration-prompt``-token prompts, 1 output token); then "streams", the long
    batch's shape ``--calibration-streams`` at a time (the decode batch streams that many
    tokens per step: what the serving path spends per step rather than per token). Run
    after the measured runs, so they do not change what those saw."""
    batches = [
        ("short", CALIBRATION_PROMPT, 1, 1),
        ("long", CALIBRATION_PROMPT, 1 + args.calibration_tokens, 1),
        ("prompt", args.calibration_prompt, 1, 1),
    ]
    if args.calibration_streams > 1:
        batches.append(
            ("streams", CALIBRATION_PROMPT, 1 + args.calibration_tokens, args.calibration_streams)
        )
    out = {}
    for j, (name, prompt, tokens, concurrency) in enumerate(batches):
        before = CpuSnapshot.take()
        _run(
            [*PYTHON, "-m", "pdserve.bench.serve", "--endpoint", f"pdserve={url}",
             "--tokenizer", tokenizer, "--concurrency", str(concurrency),
             "--num-requests", str(args.calibration_requests),
             "--prompt-len", f"fixed:{prompt}", "--output-len", f"fixed:{tokens}",
             "--warmup", "0", "--seed", str(1000 + 100 * j + args.seed), "--no-plot",
             "--save-requests", "--request-timeout-s", "120", "--out-dir", str(out_dir / name)],
            600,
        )  # fmt: skip
        usage = CpuSnapshot.take().since(before)
        saved = json.loads((out_dir / name / "summary.json").read_text())
        summary = saved["summaries"][0]
        out[name] = {
            "requests": summary["completed"],
            "failed": summary["failed"],
            "prompt_tokens": prompt,
            "output_tokens": tokens,
            "concurrency": concurrency,
            "streams_per_step": streams_per_step(next(iter(saved["requests"].values()))),
            # The interval between a request's tokens (one request at a time: the decode
            # replica's step at batch 1, as the client sees it).
            "tpot_mean_s": (summary.get("tpot") or {}).get("mean"),
            "usage": usage,
        }
    return out


def _calibration_line(calibration: dict) -> str:
    return ", ".join(
        f"{name}: {b['requests']} requests x {b['output_tokens']} tokens in "
        f"{b['usage']['wall_s']:.1f} s ({b['failed']} failed)"
        for name, b in calibration.items()
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.sim_validate", description=__doc__)
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
    m.add_argument("--calibration-requests", type=int, default=12,
                   help="requests per serving-CPU calibration batch")  # fmt: skip
    m.add_argument("--calibration-tokens", type=int, default=48,
                   help="extra output tokens of the long calibration batch")  # fmt: skip
    m.add_argument("--calibration-prompt", type=int, default=448,
                   help="prompt tokens of the prompt calibration batch")  # fmt: skip
    m.add_argument("--calibration-streams", type=int, default=4,
                   help="concurrency of the streams calibration batch (the long batch's "
                   "requests, this many at a time; 1: none)")  # fmt: skip
    m.add_argument("--out-dir", default=f"bench/results/sim-validate-{time.strftime('%H%M%S')}")
    validate.add_compare_arguments(sub.add_parser("compare", help="predicted vs measured"))
    args = p.parse_args(argv)
    return measure(args) if args.command == "measure" else validate.compare(args)


if __name__ == "__main__":
    sys.exit(main())
