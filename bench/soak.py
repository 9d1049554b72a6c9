"""Soak benchmark: ``python -m pdserve.bench.soak`` (run it from outside the checkout, e.g.
``cd /tmp``, or with ``python -P``).

A long run at a steady fraction of capacity: on a local cluster it starts (or attaches to,
as ``bench.chaos`` does) it first measures capacity with a short closed loop (or takes
``--rate``), then sends open-loop Poisson arrivals at ``--load`` (0.7) of it for
``--duration-s``: completions and chat of mixed lengths, with a share of clients that
disconnect mid-stream, of ``n`` = 2 requests and of JSON-mode requests. Every
``--sample-every-s`` it samples the RSS and open file descriptors of every replica process
and the ingress (psutil, else /proc), each replica's KV usage, and the latency percentiles
of the requests that ended since the last sample. After the load it waits for the KV caches
to empty. Output in ``--out-dir``: ``soak.json`` (samples, windows, verdict),
``soak-processes.csv``, ``soak.png`` and a printed table. Verdict: RSS and fds of every
process grow < 5% from just after warm-up to the end, KV usage back to 0 when idle, TTFT
p99 of the last 5 minutes (``--edge-window-s``) at most 20% above the first 5 minutes'.
Exit 1 when it fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from pdserve.bench.chaos import DEFAULT_UP_ARGS, POOLS, LocalCluster, kv_held_at_end
from pdserve.bench.cluster_probe import (
    DEPLOYMENTS,
    ReplicaProcess,
    kv_usage_by_replica,
    replica_processes,
    running_replicas,
    sample_process,
)
from pdserve.bench.mixed_load import LoadMix, Outcome, int_range, pct, stream_request
from pdserve.cluster.state import ClusterState

GROWTH_LIMIT = 0.05
P99_LIMIT = 0.20


@dataclass(frozen=True)
class ProcessRow:
    t_s: float
    pool: str
    pid: int
    rss_mib: float
    open_fds: int


async def probe_capacity(
    url: str, model: str, mix: LoadMix, concurrency: int, seconds: float, seed: int
) -> float:
    """Requests per second completed by ``concurrency`` closed-loop clients."""
    rng = random.Random(seed)
    done = 0
    began = time.perf_counter()
    stop_at = began + seconds

    async def client_loop(client: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            out = Outcome(mix.sample(rng), time.perf_counter() - began)
            await stream_request(client, url, model, out, began)
            done += not out.failed

    async with aiohttp.ClientSession() as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return done / (time.perf_counter() - began)


async def open_loop(
    url: str,
    model: str,
    mix: LoadMix,
    rate: float,
    duration_s: float,
    seed: int,
    began: float,
    outcomes: list[Outcome],
) -> None:
    """Poisson arrivals at ``rate`` for ``duration_s``; then the requests in flight end."""
    rng = random.Random(seed)
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000)) as client:
        t = rng.expovariate(rate)
        while t < duration_s:
            await asyncio.sleep(max(0.0, began + t - time.perf_counter()))
            out = Outcome(mix.sample(rng), time.perf_counter() - began)
            outcomes.append(out)
            tasks.append(asyncio.create_task(stream_request(client, url, model, out, began)))
            t += rng.expovariate(rate)
        await asyncio.gather(*tasks)


def sample_once(
    state: ClusterState, procs: list[ReplicaProcess], t_s: float
) -> tuple[list[ProcessRow], dict[str, float]]:
    rows = []
    for proc in procs:
        got = sample_process(proc.pid)
        if got is not None:
            rows.append(ProcessRow(t_s, proc.pool, proc.pid, got.rss_bytes / 2**20, got.open_fds))
    running = running_replicas(state)
    ids = [r.replica_id for pool in POOLS for r in running.get(DEPLOYMENTS[pool], [])]
    return rows, kv_usage_by_replica(state, ids)


def latency_window(outcomes: list[Outcome], lo: float, hi: float) -> dict[str, Any]:
    """Percentiles of the requests that ended in [lo, hi) and were answered in full."""
    ended = [o for o in outcomes if o.ended is not None and lo <= o.ended < hi]
    ok = [o for o in ended if not o.failed and not o.disconnected and o.ttft is not None]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    return {
        "t_s": hi,
        "ended": len(ended),
        "completed": len(ok),
        "failed": sum(o.failed for o in ended),
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
    }


async def sampler(
    state: ClusterState,
    every_s: float,
    began: float,
    load_done: asyncio.Event,
    outcomes: list[Outcome],
    rows: list[ProcessRow],
    kv: list[dict[str, Any]],
    windows: list[dict[str, Any]],
) -> None:
    procs = await asyncio.to_thread(replica_processes, state)
    last = 0.0
    while not load_done.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(load_done.wait(), timeout=every_s)
        now = time.perf_counter() - began
        got, usage = await asyncio.to_thread(sample_once, state, procs, now)
        rows.extend(got)
        kv.append({"t_s": now, **usage})
        windows.append(latency_window(outcomes, last, now))
        last = now


def growth(rows: list[ProcessRow], warmup_s: float, span_s: float) -> list[dict[str, Any]]:
    """Per process: mean RSS and fds over ``span_s`` right after warm-up and at the end."""
    out = []
    for pid in sorted({r.pid for r in rows}):
        mine = [r for r in rows if r.pid == pid]
        end = max(r.t_s for r in mine)
        base = [r for r in mine if warmup_s <= r.t_s < warmup_s + span_s]
        tail = [r for r in mine if r.t_s > end - span_s]
        if not base or not tail:
            continue
        rss0, rss1 = (statistics.fmean(r.rss_mib for r in s) for s in (base, tail))
        fd0, fd1 = (statistics.fmean(r.open_fds for r in s) for s in (base, tail))
        out.append(
            {
                "pool": mine[0].pool,
                "pid": pid,
                "rss_mib_after_warmup": round(rss0, 1),
                "rss_mib_end": round(rss1, 1),
                "rss_growth": round(rss1 / rss0 - 1, 4),
                "fds_after_warmup": round(fd0, 1),
                "fds_end": round(fd1, 1),
                "fds_growth": round(fd1 / fd0 - 1, 4),
            }
        )
    return out


def verdict(
    outcomes: list[Outcome],
    procs: list[dict[str, Any]],
    kv_idle: dict[str, Any],
    end_s: float,
    edge_s: float,
) -> dict[str, Any]:
    """The soak's checks; ``edge_s`` is the span of "the first / last minutes" compared."""
    first = latency_window(outcomes, 0.0, edge_s)["ttft_p99_s"]
    last = latency_window(outcomes, end_s - edge_s, end_s + 1e9)["ttft_p99_s"]
    ratio = None if not first or last is None else round(last / first, 3)
    worst_rss = max((p["rss_growth"] for p in procs), default=None)
    worst_fds = max((p["fds_growth"] for p in procs), default=None)
    checks = {
        "rss_flat": worst_rss is not None and worst_rss < GROWTH_LIMIT,
        "fds_flat": worst_fds is not None and worst_fds < GROWTH_LIMIT,
        "kv_zero_when_idle": bool(kv_idle["idle"]),
        "p99_stable": ratio is not None and ratio <= 1 + P99_LIMIT,
    }
    return {
        **checks,
        "passed": all(checks.values()),
        "worst_rss_growth": worst_rss,
        "worst_fds_growth": worst_fds,
        "ttft_p99_first_window_s": first,
        "ttft_p99_last_window_s": last,
        "p99_ratio_last_to_first": ratio,
        "kv_when_idle": kv_idle,
    }


def write_plot(path: Path, rows: list[ProcessRow], kv: list[dict[str, Any]], windows) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    for pid in sorted({r.pid for r in rows}):
        mine = [r for r in rows if r.pid == pid]
        label = f"{mine[0].pool} {pid}"
        axes[0].plot([r.t_s for r in mine], [r.rss_mib for r in mine], label=label)
        axes[1].plot([r.t_s for r in mine], [r.open_fds for r in mine], label=label)
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].set_ylabel("open fds")
    axes[0].legend(fontsize=7)
    for replica in sorted({k for s in kv for k in s if k != "t_s"}):
        axes[2].plot(
            [s["t_s"] for s in kv if replica in s], [s[replica] for s in kv if replica in s]
        )
    axes[2].set_ylabel("KV usage per replica")
    for key in ("ttft_p50_s", "ttft_p99_s"):
        pts = [(w["t_s"], w[key]) for w in windows if w[key] is not None]
        axes[3].plot([p[0] for p in pts], [p[1] for p in pts], label=key)
    axes[3].set_ylabel("TTFT (s)")
    axes[3].set_xlabel("seconds since the load began")
    axes[3].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def format_table(summary: dict[str, Any], procs: list[dict[str, Any]], result: dict) -> str:
    lines = [f"{k:28} {v}" for k, v in summary.items()]
    lines += [f"{k:28} {v}" for k, v in result.items() if k != "kv_when_idle"]
    lines += ["", "  pool     pid      rss MiB (warm -> end)   fds (warm -> end)"]
    lines += [
        f"  {p['pool']:8} {p['pid']:<8} {p['rss_mib_after_warmup']:>8} -> {p['rss_mib_end']:<8}"
        f" ({p['rss_growth']:+.1%})  {p['fds_after_warmup']} -> {p['fds_end']}"
        f" ({p['fds_growth']:+.1%})"
        for p in procs
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--rate", type=float, default=None, help="req/s (default: measured)")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of capacity")
    parser.add_argument("--probe-s", type=float, default=60.0, help="capacity probe length")
    parser.add_argument("--probe-concurrency", type=int, default=8)
    parser.add_argument("--warmup-s", type=float, default=300.0)
    parser.add_argument(
        "--edge-window-s", type=float, default=300.0, help="first/last span whose p99 compare"
    )
    parser.add_argument("--sample-every-s", type=float, default=10.0)
    parser.add_argument("--max-tokens", default="8:128", help="output tokens LO:HI")
    parser.add_argument("--prompt-words", default="4:300", help="prompt words LO:HI")
    parser.add_argument("--disconnect", type=float, default=0.1)
    parser.add_argument("--multi-n", type=float, default=0.1)
    parser.add_argument("--json-mode", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, default=None, help="app config (default: tiny)")
    parser.add_argument("--up-args", default=DEFAULT_UP_ARGS, help="arguments of `pdserve up`")
    parser.add_argument("--state-dir", type=Path, default=None, help="attach to this cluster")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--idle-timeout-s", type=float, default=120.0)
    parser.add_argument("--out-dir", type=Path, default=Path("soak-out"))
    args = parser.parse_args(argv)
    if args.duration_s <= 0 or not 0 < args.load <= 1 or args.sample_every_s <= 0:
        parser.error("--duration-s and --sample-every-s must be > 0, --load in (0, 1]")
    if args.rate is not None and args.rate <= 0:
        parser.error(f"--rate must be > 0, got {args.rate}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    words = int_range(args.prompt_words, "--prompt-words")
    tokens = int_range(args.max_tokens, "--max-tokens")
    mix = LoadMix(
        words, tokens, disconnect=args.disconnect, multi_n=args.multi_n, json_mode=args.json_mode
    )
    cluster = LocalCluster(args, tag="soak")
    outcomes: list[Outcome] = []
    rows: list[ProcessRow] = []
    kv: list[dict[str, Any]] = []
    windows: list[dict[str, Any]] = []
    try:
        state, url = cluster.start(args.start_timeout_s)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        capacity = None
        rate = args.rate
        if rate is None:
            probe_mix = LoadMix(words, tokens, multi_n=args.multi_n, json_mode=args.json_mode)
            capacity = asyncio.run(
                probe_capacity(
                    url, model, probe_mix, args.probe_concurrency, args.probe_s, args.seed + 1
                )
            )
            rate = max(0.01, args.load * capacity)
        print(f"[soak] capacity {capacity} req/s; sending {rate:.3f} req/s", flush=True)

        async def run() -> float:
            began = time.perf_counter()
            load_done = asyncio.Event()
            watch = asyncio.create_task(
                sampler(state, args.sample_every_s, began, load_done, outcomes, rows, kv, windows)
            )
            await open_loop(url, model, mix, rate, args.duration_s, args.seed, began, outcomes)
            load_done.set()
            await watch
            return time.perf_counter() - began

        end_s = asyncio.run(run())
        kv_idle = kv_held_at_end(state, args.idle_timeout_s)
    finally:
        cluster.stop()
    procs = growth(rows, args.warmup_s, max(60.0, 6 * args.sample_every_s))
    result = verdict(outcomes, procs, kv_idle, min(end_s, args.duration_s), args.edge_window_s)
    summary = {
        "capacity_rps": capacity,
        "rate_rps": rate,
        "requests": len(outcomes),
        "completed": sum(not o.failed and not o.disconnected for o in outcomes),
        "disconnected": sum(o.disconnected for o in outcomes),
        "failed": sum(o.failed for o in outcomes),
        "server_errors_5xx": sum(o.server_error for o in outcomes),
        "n2_requests": sum(o.spec.n > 1 for o in outcomes),
        "json_mode_requests": sum(o.spec.json_mode for o in outcomes),
        "json_mode_unparsable": sum(_bad_json(o) for o in outcomes),
    }
    plotted = write_plot(args.out_dir / "soak.png", rows, kv, windows)
    with (args.out_dir / "soak-processes.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "pool", "pid", "rss_mib", "open_fds"])
        writer.writerows([r.t_s, r.pool, r.pid, round(r.rss_mib, 2), r.open_fds] for r in rows)
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "summary": summary,
        "verdict": result,
        "processes": procs,
        "kv_samples": kv,
        "latency_windows": windows,
        "plot": "soak.png" if plotted else None,
        "failures": [
            {**asdict(o), "spec": asdict(o.spec), "texts": None} for o in outcomes if o.failed
        ][:50],
    }
    (args.out_dir / "soak.json").write_text(json.dumps(report, indent=2))
    print(format_table(summary, procs, result))
    print(f"{'PASS' if result['passed'] else 'FAIL'}; results in {args.out_dir}")
    return 0 if result["passed"] else 1


def _bad_json(out: Outcome) -> bool:
    """A JSON-mode request that finished on its own (not at max_tokens) must parse."""
    if out.spec.n != 1 or not out.spec.json_mode or not out.finished:
        return False
    if out.completion_tokens is None:
        return False
    if out.completion_tokens >= out.spec.max_tokens * out.spec.n:
        return False  # cut at max_tokens: an unfinished object is what was asked for
    try:
        return not all(isinstance(json.loads(t), dict) for t in out.texts.values())
    except ValueError:
        return True


if __name__ == "__main__":
    sys.exit(main())
