"""pdserve disaggregated vs pdserve colocated vs vLLM's CPU server, one command, one run.

``python -m pdserve.bench.compare_serving`` serves the same model with each system in turn (never
two at once: on a small machine they would fight for the same cores), runs the same seeded
``pdserve.bench.serve`` workloads against each (fixed concurrency 8 and 32, and a mix of long and
short prompts), stops each server by pid and writes one combined table, ``compare.json``
and ``compare.png`` under ``--out-dir``. It ends with the targets of a 2-core machine:
pdserve (the recommended configuration) at least vLLM's output tokens/s at concurrency 8
and 32 with a TTFT p50 no worse than vLLM's; with long prompts mixed in, disaggregated
TPOT p99 below colocated TPOT p99. The pdserve configs and cluster splits default to the
ones shipped in ``configs/`` (``--recommended`` names the one checked against vLLM).

Besides latency and throughput it reports where the CPU went while each workload ran: the
server's own process trees (CPU ms per output token, cores used) and everything else on
the machine. On a shared machine the wall-clock numbers move with other people's load; the
CPU cost per token does not.

vLLM runs from its own venv (``--vllm-python``) and is skipped, with a line saying so,
when that Python is not given or not there. This module never signals a process by name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.serve import Endpoint, RunOptions, run_endpoint
from pdserve.bench.serve_metrics import RequestRecord, Summary, summarize
from pdserve.bench.serve_workload import BenchRequest, LengthDist, build_workload
from pdserve.bench.serving_systems import (
    PdserveServer,
    Server,
    ServerError,
    VLLMServer,
    machine_busy_seconds,
    pin_this_process,
    tree_cpu_seconds,
)
from pdserve.kernels.cpu.cpus import current_thread_cpus

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DISAGG, COLOC, VLLM = "pdserve-disagg", "pdserve-coloc", "vllm"
BUSY_CORES = 0.25  # other users' load above which the report warns


@dataclass(frozen=True)
class Workload:
    """One ``pdserve.bench.serve`` run: the same requests go to every system."""

    name: str
    num_requests: int
    prompt_len: str
    output_len: str
    concurrency: int

    def requests(self, tokenizer: Any, seed: int, warmup: int) -> list[BenchRequest]:
        return build_workload(
            tokenizer,
            num_requests=self.num_requests + warmup,
            prompt_len=LengthDist.parse(self.prompt_len),
            output_len=LengthDist.parse(self.output_len),
            rate=None,
            seed=seed,
        )


@dataclass(frozen=True)
class CPUUse:
    """Where the machine's CPU went during one workload (contention makes wall-clock numbers
    of a shared machine unreliable; CPU seconds per token are not)."""

    server_cpu_s: float  # user+sys CPU of the server's process trees
    machine_busy_s: float  # all cores, everything running
    wall_s: float
    client_cpu_s: float = 0.0  # this process: the load generator

    @property
    def client_cores(self) -> float:
        return self.client_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def server_cores(self) -> float:
        return self.server_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def other_cores(self) -> float:
        """Cores busy with anything but the server and the load generator (other users)."""
        other = self.machine_busy_s - self.server_cpu_s - self.client_cpu_s
        return max(0.0, other / self.wall_s) if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class Measurement:
    system: str
    workload: str
    summary: Summary | None  # None when the system could not be measured
    note: str = ""
    cpu: CPUUse | None = None

    @property
    def cpu_ms_per_token(self) -> float | None:
        if self.cpu is None or self.summary is None or not self.summary.total_output_tokens:
            return None
        return 1000 * self.cpu.server_cpu_s / self.summary.total_output_tokens


def default_workloads(scale: float, output_len: int, long_prompt: int) -> list[Workload]:
    """Sized so that ``scale=1`` compares the three systems in minutes on a small CPU machine
    (run times in docs/benchmarks.md)."""

    def n(base: int, at_least: int) -> int:
        return max(at_least, round(base * scale))

    return [
        Workload("c8", n(48, 8), "fixed:128", f"fixed:{output_len}", 8),
        Workload("c32", n(128, 32), "fixed:128", f"fixed:{output_len}", 32),
        Workload("mixed-long", n(48, 8), f"mix:128:{long_prompt}:0.25", f"fixed:{output_len}", 8),
    ]


def measure(
    server: Server,
    workloads: list[Workload],
    prepared: dict[str, tuple[list[BenchRequest], list[BenchRequest]]],
    opts: RunOptions,
    start_timeout_s: float,
    start_attempts: int = 1,
) -> tuple[list[Measurement], float | None]:
    """Start ``server``, run every workload against it, stop it; returns the measurements
    and the start-up time (None when it did not come up)."""
    t0 = time.monotonic()
    url = None
    for attempt in range(1, start_attempts + 1):
        try:
            url = server.start(start_timeout_s)
            break
        except (ServerError, TimeoutError, OSError) as err:
            print(
                f"[{server.name}] did not start (attempt {attempt}/{start_attempts}): {err}",
                flush=True,
            )
            server.stop()
        except BaseException:  # SIGTERM (SystemExit) or Ctrl-C mid-start: leave nothing up
            server.stop()
            raise
    if url is None:
        return [Measurement(server.name, w.name, None, "did not start") for w in workloads], None
    startup = time.monotonic() - t0
    print(f"[{server.name}] ready at {url} after {startup:.1f} s", flush=True)
    out: list[Measurement] = []
    # The load generator shares the machine: keep it off the CPUs the server reserved for
    # its engine (vLLM's OpenMP threads, pdserve's engine CPUs), as a real client would be.
    engine = server.engine_cpus()
    client = set(current_thread_cpus()) - engine
    restore = pin_this_process(client if engine and client else set())
    if engine and client:
        print(f"[{server.name}] engine CPUs {sorted(engine)}; load generator on {sorted(client)}")
    try:
        for w in workloads:
            warm, measured = prepared[w.name]
            run_opts = RunOptions(**{**asdict(opts), "concurrency": w.concurrency})
            # Warm-up first, outside the CPU window: only the measured requests count.
            asyncio.run(run_endpoint(Endpoint(server.name, url), [], run_opts, warmup=warm))
            roots = server.root_pids()
            cpu0, busy0, own0 = tree_cpu_seconds(roots), machine_busy_seconds(), time.process_time()
            t = time.monotonic()
            records, duration = asyncio.run(
                run_endpoint(Endpoint(server.name, url), measured, run_opts)
            )
            cpu = CPUUse(
                tree_cpu_seconds(roots) - cpu0,
                machine_busy_seconds() - busy0,
                time.monotonic() - t,
                client_cpu_s=time.process_time() - own0,
            )
            summary = summarize(server.name, records, duration)
            m = Measurement(server.name, w.name, summary, cpu=cpu)
            out.append(m)
            print(
                f"[{server.name}] {w.name}: {_one_line(summary)}, {_cpu_line(m)} "
                f"({cpu.wall_s:.0f} s)",
                flush=True,
            )
    finally:
        restore()
        server.stop()
    return out, startup


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _one_line(s: Summary) -> str:
    return (
        f"{s.completed}/{s.completed + s.failed} ok, {s.output_throughput:.1f} out tok/s, "
        f"TTFT p50 {_ms(s.ttft.p50 if s.ttft else None)} ms, "
        f"TPOT p99 {_ms(s.tpot.p99 if s.tpot else None)} ms"
    )


def _cpu_line(m: Measurement) -> str:
    if m.cpu is None:
        return "CPU -"
    per_tok = m.cpu_ms_per_token
    return (
        f"server {m.cpu.server_cores:.2f} cores, others {m.cpu.other_cores:.2f} cores, "
        f"{'-' if per_tok is None else f'{per_tok:.1f}'} CPU ms/token"
    )


COLUMNS = (
    ("ok/sent", lambda s: f"{s.completed}/{s.completed + s.failed}"),
    ("out tok/s", lambda s: f"{s.output_throughput:.1f}"),
    ("TTFT p50", lambda s: _ms(s.ttft and s.ttft.p50)),
    ("TTFT p99", lambda s: _ms(s.ttft and s.ttft.p99)),
    ("TPOT p50", lambda s: _ms(s.tpot and s.tpot.p50)),
    ("TPOT p99", lambda s: _ms(s.tpot and s.tpot.p99)),
    ("ITL p99", lambda s: _ms(s.itl and s.itl.p99)),
    ("E2E p50", lambda s: _ms(s.e2e and s.e2e.p50)),
)


CPU_COLUMNS = (
    ("CPU ms/tok", lambda m: "-" if m.cpu_ms_per_token is None else f"{m.cpu_ms_per_token:.1f}"),
    ("srv cores", lambda m: "-" if m.cpu is None else f"{m.cpu.server_cores:.2f}"),
    ("other cores", lambda m: "-" if m.cpu is None else f"{m.cpu.other_cores:.2f}"),
)


def format_table(results: list[Measurement]) -> str:
    """One row per (workload, system); latencies in ms; CPU use of the server and of
    everything else on the machine (the load generator included) while it ran."""
    header = ["workload", "system", *(c for c, _ in COLUMNS), *(c for c, _ in CPU_COLUMNS)]
    rows = []
    for m in results:
        cells = [fn(m.summary) for _, fn in COLUMNS] if m.summary else ["-"] * len(COLUMNS)
        cells += [fn(m) for _, fn in CPU_COLUMNS]
        if m.note:
            cells[-1] = m.note
        rows.append([m.workload, m.system, *cells])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _get(results: list[Measurement], system: str, workload: str) -> Summary | None:
    for m in results:
        if m.system == system and m.workload == workload:
            return m.summary
    return None


def check_targets(results: list[Measurement], recommended: str) -> list[dict[str, Any]]:
    """The comparison's targets (docs/benchmarks.md), each with the two numbers compared and
    whether it holds (``passed`` is None when a side is missing)."""
    checks: list[dict[str, Any]] = []

    def add(what: str, ours: float | None, theirs: float | None, higher_is_better: bool) -> None:
        passed = None
        if ours is not None and theirs is not None:
            passed = ours >= theirs if higher_is_better else ours <= theirs
        checks.append({"target": what, "ours": ours, "reference": theirs, "passed": passed})

    for wl in ("c8", "c32"):
        mine, ref = _get(results, recommended, wl), _get(results, VLLM, wl)
        add(
            f"{wl}: {recommended} out tok/s >= vllm",
            mine.output_throughput if mine else None,
            ref.output_throughput if ref else None,
            True,
        )
        add(
            f"{wl}: {recommended} TTFT p50 <= vllm",
            mine.ttft.p50 if mine and mine.ttft else None,
            ref.ttft.p50 if ref and ref.ttft else None,
            False,
        )
    dis, col = _get(results, DISAGG, "mixed-long"), _get(results, COLOC, "mixed-long")
    tp = [x.tpot.p99 if x and x.tpot else None for x in (dis, col)]
    add("mixed-long: disagg TPOT p99 < coloc TPOT p99", tp[0], tp[1], False)
    if tp[0] is not None and tp[1] is not None and tp[0] == tp[1]:
        checks[-1]["passed"] = False  # strictly below
    return checks


def format_checks(checks: list[dict[str, Any]]) -> str:
    def num(v: float | None, target: str) -> str:
        if v is None:
            return "-"
        return f"{v:.1f}" if "tok/s" in target else f"{v * 1000:.0f} ms"

    out = []
    for c in checks:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[c["passed"]]
        out.append(
            f"  {verdict}  {c['target']}: {num(c['ours'], c['target'])} vs "
            f"{num(c['reference'], c['target'])}"
        )
    return "\n".join(out)


def write_plot(path: Path, results: list[Measurement], workloads: list[Workload]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    systems = list(dict.fromkeys(m.system for m in results))
    panels = [
        ("output tokens/s", lambda s: s.output_throughput),
        ("TTFT p50 (ms)", lambda s: s.ttft.p50 * 1000 if s.ttft else np.nan),
        ("TPOT p99 (ms)", lambda s: s.tpot.p99 * 1000 if s.tpot else np.nan),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    x = np.arange(len(workloads))
    width = 0.8 / max(1, len(systems))
    for ax, (title, pick) in zip(axes, panels, strict=True):
        for i, system in enumerate(systems):
            vals = [
                (lambda s: pick(s) if s else np.nan)(_get(results, system, w.name))
                for w in workloads
            ]
            ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=system)
        ax.set_xticks(x, [w.name for w in workloads])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.compare_serving",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="model directory; default: the generated 'small' test model",
    )
    p.add_argument("--disagg-config", type=Path, default=CONFIG_DIR / "local-2core-disagg.yaml")
    p.add_argument("--coloc-config", type=Path, default=CONFIG_DIR / "local-2core-colocated.yaml")
    p.add_argument(
        "--disagg-up-args",
        default="--prefill-cpus 1 --decode-cpus 2",
        help="flags of `pdserve up` for the disaggregated cluster",
    )
    p.add_argument(
        "--coloc-up-args",
        default="--prefill-cpus 1 --decode-cpus 2",
        help="flags of `pdserve up` for the colocated cluster (its prefill node stays empty)",
    )
    p.add_argument(
        "--pdserve-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for `pdserve up` (its Ray nodes), e.g. RAY_worker_niceness=0",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of a venv with vLLM (e.g. /work/vllm-venv/bin/python); "
        "vLLM is skipped without it",
    )
    p.add_argument(
        "--vllm-args",
        default="--max-model-len 4096",
        help="extra flags of vLLM's api_server; without a --dtype among them, vLLM gets the "
        "dtype pdserve's 'auto' resolves to for this model on this machine (bfloat16 only "
        "with native bf16, else float32), so both compute in the same precision",
    )
    p.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for vLLM (default: VLLM_CPU_KVCACHE_SPACE=2, "
        "VLLM_CPU_OMP_THREADS_BIND=auto)",
    )
    p.add_argument(
        "--systems",
        default=f"{DISAGG},{COLOC},{VLLM}",
        help="comma-separated subset, measured in this order",
    )
    p.add_argument(
        "--recommended",
        choices=[DISAGG, COLOC],
        default=COLOC,
        help="the pdserve system the vLLM targets are checked for",
    )
    p.add_argument(
        "--scale", type=float, default=1.0, help="multiplies every workload's request count"
    )
    p.add_argument("--workloads", default="c8,c32,mixed-long", help="comma-separated subset")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument(
        "--long-prompt-len",
        type=int,
        default=1536,
        help="long prompts of the mixed workload (tokens; short ones are 128)",
    )
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--start-attempts",
        type=int,
        default=2,
        help="tries to start each server (a failed try is stopped first)",
    )
    p.add_argument(
        "--max-duration-s",
        type=float,
        default=240.0,
        help="per workload: stop sending new requests after this long",
    )
    p.add_argument(
        "--out-dir", type=Path, default=None, help="default: bench/results/compare-<time>"
    )
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.scale <= 0:
        p.error("--scale must be > 0")
    if args.start_attempts < 1:
        p.error("--start-attempts must be >= 1")
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.system_list) - {DISAGG, COLOC, VLLM}
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}")
    known = {
        w.name: w for w in default_workloads(args.scale, args.output_len, args.long_prompt_len)
    }
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not names or set(names) - set(known):
        p.error(f"--workloads: choose from {', '.join(known)}")
    args.workload_list = [known[n] for n in names]
    for flag in ("vllm_env", "pdserve_env"):
        for item in getattr(args, flag):
            if "=" not in item:
                p.error(f"--{flag.replace('_', '-')} {item!r}: use KEY=VALUE")
    return args


def compute_dtype(model_dir: str) -> str:
    """The dtype pdserve's engine computes in for ``model_dir`` on this CPU ('auto')."""
    import torch

    from pdserve.engine.loader import load_model_config, resolve_dtype

    ckpt = load_model_config(model_dir).checkpoint_dtype
    return str(resolve_dtype("auto", ckpt, torch.device("cpu"))).removeprefix("torch.")


def build_servers(args: argparse.Namespace, model_dir: str, out_dir: Path) -> list[Server]:
    servers: list[Server] = []
    for name in args.system_list:
        if name == VLLM:
            py = args.vllm_python
            if not py or not Path(py).is_file():
                print(
                    f"[vllm] skipped: --vllm-python {py or '(not given)'} is not a file", flush=True
                )
                continue
            env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
            extra = args.vllm_args.split()
            if not any(a == "--dtype" or a.startswith("--dtype=") for a in extra):
                extra += ["--dtype", compute_dtype(model_dir)]
            env.update(dict(item.split("=", 1) for item in args.vllm_env))
            servers.append(
                VLLMServer(
                    VLLM,
                    py,
                    model_dir,
                    out_dir / "vllm.log",
                    Path(model_dir).name,
                    env=env,
                    extra_args=extra,
                )
            )
        else:
            disagg = name == DISAGG
            servers.append(
                PdserveServer(
                    name,
                    args.disagg_config if disagg else args.coloc_config,
                    state_dir=out_dir / f"state-{name}",
                    log_path=out_dir / f"{name}.log",
                    up_args=(args.disagg_up_args if disagg else args.coloc_up_args).split(),
                    env=dict(item.split("=", 1) for item in args.pdserve_env),
                )
            )
    return servers


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from pdserve.deployments.config import AppConfig

    for path in (args.disagg_config, args.coloc_config):
        AppConfig.from_yaml(path)  # a bad config fails before anything starts
    if args.model_dir is None:
        from pdserve.engine.testmodel import ensure_test_model

        args.model_dir = str(ensure_test_model("small"))
    out_dir = args.out_dir or Path(f"bench/results/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    prepared: dict[str, tuple[list[BenchRequest], list[BenchRequest]]] = {}
    for i, w in enumerate(args.workload_list):
        reqs = w.requests(tokenizer, args.seed + i, args.warmup)
        prepared[w.name] = (reqs[: args.warmup], reqs[args.warmup :])
    opts = RunOptions(max_duration_s=args.max_duration_s)
    results: list[Measurement] = []
    startup: dict[str, float | None] = {}
    began = time.monotonic()
    load: dict[str, float] = {}
    for server in build_servers(args, args.model_dir, out_dir):
        load[server.name] = os.getloadavg()[0]
        print(f"[{server.name}] starting (1-min load average {load[server.name]:.1f})", flush=True)
        got, startup[server.name] = measure(
            server, args.workload_list, prepared, opts, args.start_timeout_s, args.start_attempts
        )
        results.extend(got)
    results.sort(
        key=lambda m: (
            [w.name for w in args.workload_list].index(m.workload),
            args.system_list.index(m.system),
        )
    )
    checks = check_targets(results, args.recommended)
    report: dict[str, Any] = {
        "model_dir": args.model_dir,
        "workloads": [asdict(w) for w in args.workload_list],
        "systems": args.system_list,
        "recommended": args.recommended,
        "configs": {DISAGG: str(args.disagg_config), COLOC: str(args.coloc_config)},
        "startup_s": startup,
        "load_average_at_start": load,
        "pdserve_env": args.pdserve_env,
        "vllm_env": args.vllm_env,
        "wall_s": time.monotonic() - began,
        "results": [
            {
                "system": m.system,
                "workload": m.workload,
                "note": m.note,
                "summary": m.summary.to_json() if m.summary else None,
                "cpu": None
                if m.cpu is None
                else asdict(m.cpu)
                | {
                    "server_cores": m.cpu.server_cores,
                    "other_cores": m.cpu.other_cores,
                    "client_cores": m.cpu.client_cores,
                    "cpu_ms_per_output_token": m.cpu_ms_per_token,
                },
            }
            for m in results
        ],
        "targets": checks,
    }
    print("\n" + format_table(results))
    print(
        "\nstart-up: "
        + ", ".join(f"{k} {'-' if v is None else f'{v:.0f} s'}" for k, v in startup.items())
    )
    print(f"targets (recommended: {args.recommended}):\n{format_checks(checks)}")
    busy = [m for m in results if m.cpu is not None and m.cpu.other_cores > BUSY_CORES]
    if busy:
        worst = max(m.cpu.other_cores for m in busy if m.cpu is not None)
        print(
            f"note: other work on the machine used up to {worst:.2f} cores during "
            f"{len(busy)} of {len(results)} measurements; wall-clock numbers are skewed, "
            "compare CPU ms/tok"
        )
    (out_dir / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "compare.txt").write_text(format_table(results) + "\n\n" + format_checks(checks))
    print(f"\nwrote {out_dir / 'compare.json'}")
    if not args.no_plot and results:
        write_plot(out_dir / "compare.png", results, args.workload_list)
        print(f"wrote {out_dir / 'compare.png'}")
    return report


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through `finally`: the servers started get stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    report = run(parse_args(argv))
    measured = [r for r in report["results"] if r["summary"] and r["summary"]["completed"] > 0]
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Measurement", "RequestRecord", "Workload", "check_targets", "format_table", "main"]
