"""Chaos benchmark: ``python -m pdserve.bench.chaos`` (run it from outside the checkout, e.g.
``cd /tmp``, or with ``python -P``).

Starts a local cluster (``pdserve up`` + ``pdserve serve`` through
``bench.serving_systems.PdserveServer``, dashboard on: Ray's state API lists the replica
actors) or attaches to one (``--state-dir`` of a running ``pdserve up``), drives it with a
closed loop of mixed streaming requests (completions and chat, prompt and output lengths
drawn from ranges, greedy and seeded) for ``--duration-s``, and every ``--kill-every-s``
SIGKILLs the process of one replica of the chosen pool (``--kill prefill|decode|random``;
the pid comes from ``ray.util.state.list_actors``). It reports requests completed, streams
migrated (the ingress's ``pdserve_request_migrations`` counter), failures before and after
the first token, 5xx, the time until Serve runs the pool's replica count again after each
kill, and the KV blocks still held once the load has stopped; prints a table, writes
``chaos.json`` in ``--out-dir`` and exits 1 when a request was lost after its first token,
came back short, or got a 5xx. Loopback only; it stops what it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from pdserve.bench.cluster_probe import (
    DEPLOYMENTS,
    Pool,
    kv_usage_by_replica,
    migrations_by_cause,
    replica_processes,
    running_replicas,
)
from pdserve.bench.mixed_load import LoadMix, Outcome, int_range, pct, stream_request
from pdserve.bench.serving_systems import PdserveServer
from pdserve.cluster.state import ClusterState, load_state

POOLS: tuple[Pool, ...] = ("prefill", "decode")
# The default application: the tiny model, one prefill and two decode replicas, so a
# killed decode replica's streams have another replica to move to at once. Long prompts
# prefill remotely; admission queues instead of shedding (a 429 is not what is measured).
DEFAULT_APP: dict[str, Any] = {
    "name": "pdserve",
    "model": {"test_model": "tiny", "dtype": "float32", "device": "cpu"},
    "prefill": {
        "min_replicas": 1,
        "max_replicas": 1,
        "num_cpus": 1,
        "engine": {"num_kv_blocks": 1024, "max_num_seqs": 16, "max_model_len": 1024},
    },
    "decode": {
        "min_replicas": 2,
        "max_replicas": 2,
        "num_cpus": 1,
        "engine": {"num_kv_blocks": 1024, "max_num_seqs": 16, "max_model_len": 1024},
    },
    "policy": {"local_prefill_max_tokens": 32},
    "admission": {"on_slo_miss": "queue", "adaptive_concurrency": False},
    "slo": {"ttft_ms": 60000},
    "autoscaling": False,
    "max_migrations": 3,
    "observability": {"tracing_exporter": "none", "metrics_enabled": True},
}
DEFAULT_UP_ARGS = "--prefill-cpus 1 --decode-cpus 2 --no-pin-cpus"
METRICS_INTERVAL_ENV = {"RAY_metrics_report_interval_ms": "2000"}


@dataclass
class Kill:
    """One SIGKILL and how long its pool took to run as many replicas as before."""

    at_s: float
    pool: Pool
    replica: str
    pid: int
    replicas_before: int
    recovered_after_s: float | None = None  # None: not within the bound


class LocalCluster:
    """The cluster the bench runs against: started here (and stopped) or attached to."""

    def __init__(self, args: argparse.Namespace, tag: str = "chaos") -> None:
        self.server: PdserveServer | None = None
        if args.state_dir is not None:
            self.state_dir = Path(args.state_dir)
            return
        config = args.config or _write_default_config(args.out_dir / f"{tag}-app.yaml")
        self.state_dir = args.out_dir / "state"
        self.server = PdserveServer(
            tag,
            Path(config),
            self.state_dir,
            args.out_dir / "cluster.log",
            up_args=args.up_args.split(),
            env=METRICS_INTERVAL_ENV,
            dashboard=True,
        )

    def start(self, timeout_s: float) -> tuple[ClusterState, str]:
        from pdserve.cluster.serving import connect_driver
        from pdserve.cluster.state import ray_client_env

        if self.server is not None:
            self.server.start(timeout_s)
        state = load_state(self.state_dir)
        if state is None or state.serve is None or state.dashboard_url is None:
            raise SystemExit(
                f"no served cluster with a dashboard recorded in {self.state_dir} "
                "(start one with `pdserve up` (without --no-dashboard) and `pdserve serve`)"
            )
        # Before Ray is imported: it reads its address and token from the environment then.
        os.environ.update(ray_client_env(state))
        connect_driver(state)
        return state, state.serve.http_url

    def stop(self) -> None:
        import ray

        ray.shutdown()  # before the cluster goes: a driver without its GCS exits
        if self.server is not None:
            self.server.stop()


def _write_default_config(path: Path) -> Path:
    path.write_text(yaml.safe_dump(DEFAULT_APP, sort_keys=False))
    return path


async def closed_loop(
    url: str,
    model: str,
    mix: LoadMix,
    concurrency: int,
    duration_s: float,
    seed: int,
    began: float,
    outcomes: list[Outcome],
) -> None:
    """``concurrency`` clients, each sending its next request as the last one ends, until
    ``duration_s`` has passed; the requests in flight then run to their end."""
    stop_at = began + duration_s

    async def client_loop(client: aiohttp.ClientSession, rng: random.Random) -> None:
        while time.perf_counter() < stop_at:
            out = Outcome(mix.sample(rng), time.perf_counter() - began)
            outcomes.append(out)
            await stream_request(client, url, model, out, began)
            if out.failed:
                await asyncio.sleep(0.2)  # a failing pool must not be flooded by retries

    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as client:
        await asyncio.gather(
            *(client_loop(client, random.Random(seed * 1000 + i)) for i in range(concurrency))
        )


async def killer(
    state: ClusterState,
    target: str,
    every_s: float,
    duration_s: float,
    recover_timeout_s: float,
    rng: random.Random,
    began: float,
    kills: list[Kill],
) -> None:
    """SIGKILL one replica of the target pool every ``every_s`` (the first after one period)
    while the load runs; after each, wait for the pool to run as many replicas as before."""
    next_at = every_s
    while next_at < duration_s - 1.0:
        await asyncio.sleep(max(0.0, began + next_at - time.perf_counter()))
        kill = await asyncio.to_thread(_kill_one, state, target, rng, began)
        next_at += every_s
        if kill is None:
            continue
        kills.append(kill)
        print(f"[chaos] t={kill.at_s:.1f}s killed {kill.pool} pid {kill.pid}", flush=True)
        kill.recovered_after_s = await asyncio.to_thread(
            _wait_recovered, state, kill, recover_timeout_s, began
        )
        print(f"[chaos] {kill.pool} recovered after {kill.recovered_after_s}s", flush=True)


def _kill_one(state: ClusterState, target: str, rng: random.Random, began: float) -> Kill | None:
    procs = replica_processes(state)
    pools = [p for p in POOLS if any(r.pool == p for r in procs)]
    pool: Pool
    if target == "random":
        pool = rng.choice(pools or list(POOLS))
    else:
        pool = "prefill" if target == "prefill" else "decode"
    candidates = [r for r in procs if r.pool == pool]
    if not candidates:
        print(f"[chaos] no alive {pool} replica to kill", flush=True)
        return None
    victim = rng.choice(candidates)
    before = len(running_replicas(state).get(DEPLOYMENTS[pool], []))
    os.kill(victim.pid, signal.SIGKILL)
    return Kill(time.perf_counter() - began, pool, victim.name, victim.pid, before)


def _wait_recovered(
    state: ClusterState, kill: Kill, timeout_s: float, began: float
) -> float | None:
    """Seconds from the kill until Serve runs ``replicas_before`` replicas of the pool,
    none of them the killed process; None past ``timeout_s``."""
    deployment = DEPLOYMENTS[kill.pool]
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        try:
            pids = [r.pid for r in running_replicas(state).get(deployment, [])]
        except OSError:
            pids = []  # the dashboard may be slow to answer while a worker dies
        if kill.pid not in pids and len(pids) >= kill.replicas_before:
            return round(time.perf_counter() - began - kill.at_s, 2)
        time.sleep(0.5)
    return None


def kv_held_at_end(state: ClusterState, timeout_s: float) -> dict[str, Any]:
    """Once the load has stopped: the KV blocks the pools' integrity reports still hold (the
    verdict: ``idle``) and every running replica's KV usage gauge, polled until all are
    zero or ``timeout_s`` passes."""
    from ray import serve

    app = state.serve.app_name if state.serve is not None else "pdserve"
    deadline = time.monotonic() + timeout_s
    while True:
        running = running_replicas(state)
        ids = [r.replica_id for pool in POOLS for r in running.get(DEPLOYMENTS[pool], [])]
        gauges = kv_usage_by_replica(state, ids)
        held: dict[str, int] = {}
        for pool in POOLS:
            deployment = DEPLOYMENTS[pool]
            replicas = len(running.get(deployment, []))
            if not replicas:
                continue
            handle = serve.get_deployment_handle(deployment, app)
            # Several calls, as the router may spread them; that each replica was asked is not
            # guaranteed, so every running replica's own gauge is read (by name) as well.
            reports = [
                handle.check_integrity.remote().result(timeout_s=30) for _ in range(3 * replicas)
            ]
            held[pool] = max(r.num_total_blocks - r.num_free_blocks for r in reports)
        idle = all(v == 0 for v in held.values())
        # The gauges follow the replicas' stats a few seconds late: wait for them too.
        gauges_zero = all(v == 0 for v in gauges.values())
        if (idle and gauges_zero) or time.monotonic() > deadline:
            return {
                "kv_blocks_held": held,
                "kv_usage_gauges": gauges,
                "idle": idle,
            }
        time.sleep(2.0)


def summarize(
    outcomes: list[Outcome], kills: list[Kill], migrated: dict[str, float]
) -> dict[str, Any]:
    done = [o for o in outcomes if o.ended is not None]
    completed = [o for o in done if not o.failed and not o.disconnected]
    failed = [o for o in done if o.failed]
    recoveries = [k.recovered_after_s for k in kills if k.recovered_after_s is not None]
    return {
        "requests": len(done),
        "completed": len(completed),
        "migrated": int(sum(migrated.values())),
        "migrated_by_cause": migrated,
        "failed_before_first_token": sum(not o.after_first_token for o in failed),
        "failed_after_first_token": sum(o.after_first_token for o in failed),
        "short_streams": sum(o.short for o in done),
        "http_429": sum(o.status == 429 for o in done),
        "server_errors_5xx": sum(o.server_error for o in done),
        "kills": len(kills),
        "kills_not_recovered": sum(k.recovered_after_s is None for k in kills),
        "recover_s_p50": pct(recoveries, 0.5),
        "recover_s_max": max(recoveries) if recoveries else None,
        "ttft_s_p50": _round(pct([o.ttft for o in completed if o.ttft is not None], 0.5)),
        "ttft_s_p99": _round(pct([o.ttft for o in completed if o.ttft is not None], 0.99)),
        "failure_samples": sorted({o.error or f"status {o.status}" for o in failed})[:10],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def passed(summary: dict[str, Any], kv: dict[str, Any]) -> bool:
    return (
        summary["failed_after_first_token"] == 0
        and summary["server_errors_5xx"] == 0
        and summary["short_streams"] == 0
        and kv["idle"]
    )


def format_table(summary: dict[str, Any], kills: list[Kill], kv: dict[str, Any]) -> str:
    keys = [k for k in summary if k not in ("failure_samples", "migrated_by_cause")]
    width = max(len(k) for k in keys)
    lines = [f"{k.ljust(width)}  {summary[k]}" for k in keys]
    lines.append(f"{'kv_blocks_held_at_end'.ljust(width)}  {kv['kv_blocks_held']}")
    lines += ["", "  t_s    pool     pid      recovered_after_s"]
    lines += [f"  {k.at_s:6.1f} {k.pool:8} {k.pid:<8} {k.recovered_after_s}" for k in kills]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=120.0, help="how long the load runs")
    parser.add_argument("--kill", choices=["prefill", "decode", "random"], default="decode")
    parser.add_argument("--kill-every-s", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=6, help="closed-loop clients")
    parser.add_argument("--max-tokens", default="8:128", help="output tokens LO:HI")
    parser.add_argument("--prompt-words", default="4:300", help="prompt words LO:HI")
    parser.add_argument("--seeded", type=float, default=0.3, help="fraction of seeded requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, default=None, help="app config (default: tiny)")
    parser.add_argument("--up-args", default=DEFAULT_UP_ARGS, help="arguments of `pdserve up`")
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="attach to this running cluster instead"
    )
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--recover-timeout-s", type=float, default=120.0)
    parser.add_argument("--idle-timeout-s", type=float, default=90.0)
    parser.add_argument("--out-dir", type=Path, default=Path("chaos-out"))
    args = parser.parse_args(argv)
    if args.duration_s <= 0 or args.kill_every_s <= 0 or args.concurrency < 1:
        parser.error("--duration-s and --kill-every-s must be > 0, --concurrency >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    mix = LoadMix(
        prompt_words=int_range(args.prompt_words, "--prompt-words"),
        max_tokens=int_range(args.max_tokens, "--max-tokens"),
        seeded=args.seeded,
    )
    cluster = LocalCluster(args)
    outcomes: list[Outcome] = []
    kills: list[Kill] = []
    try:
        state, url = cluster.start(args.start_timeout_s)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        migrated_before = migrations_by_cause(state)
        rng = random.Random(args.seed)

        async def run() -> None:
            began = time.perf_counter()
            await asyncio.gather(
                closed_loop(
                    url, model, mix, args.concurrency, args.duration_s, args.seed, began, outcomes
                ),
                killer(
                    state,
                    args.kill,
                    args.kill_every_s,
                    args.duration_s,
                    args.recover_timeout_s,
                    rng,
                    began,
                    kills,
                ),
            )

        asyncio.run(run())
        kv = kv_held_at_end(state, args.idle_timeout_s)
        # The ingress exports its counter every few seconds: the last migrations need one.
        time.sleep(float(METRICS_INTERVAL_ENV["RAY_metrics_report_interval_ms"]) / 1000 * 3)
        after = migrations_by_cause(state)
        migrated = {c: after[c] - migrated_before.get(c, 0.0) for c in after}
    finally:
        cluster.stop()
    summary = summarize(outcomes, kills, migrated)
    ok = passed(summary, kv)
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "summary": summary,
        "kills": [asdict(k) for k in kills],
        "kv_at_end": kv,
        "passed": ok,
        "requests": [
            {**asdict(o), "spec": asdict(o.spec), "texts": None}
            for o in outcomes
            if o.failed or o.short
        ],
    }
    (args.out_dir / "chaos.json").write_text(json.dumps(result, indent=2))
    print(format_table(summary, kills, kv))
    print(f"{'PASS' if ok else 'FAIL'}; JSON in {args.out_dir / 'chaos.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
