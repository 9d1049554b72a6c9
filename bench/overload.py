"""Overload benchmark: ``python -m pdserve.bench.overload`` (run it from outside the checkout,
e.g. ``cd /tmp``, or with ``python -P``).

Starts a real local cluster (``pdserve up --direct-ingress`` by default: ``--up-args``) with
a shipped config and drives it with open-loop Poisson arrivals (loopback only, bounded in
count and time):

- step: 1x -> ``--factor``x -> 1x the sustainable rate (measured first with a short
  closed-loop probe, or ``--base-rate``), a mix of interactive and batch requests
  (``x-pdserve-priority``);
- ramp (``--mode ramp``): 0.5x -> 4x -> 0.5x on a copy of the config with autoscaling on and
  ``decode.max_replicas: 2``, Serve's replica counts polled over time.

Per request it records the status, the time to the response headers (how fast a 429
came), Retry-After, TTFT and whether the stream ended properly. It prints a table and
writes ``overload-<mode>.json`` and ``<mode>.png`` (TTFT and admitted/shed rate over time) in
``--out-dir``, with the decode replica's predicted-vs-observed TTFT
(``DecodeServer.admission_report``) and its integrity after the run (no request, block or
transfer left), and Serve's logs of the run (controller, proxy, every replica) under
``serve-logs-<mode>/<node>/``. Targets: admitted interactive TTFT p99 <= 2x SLO in the
overload phase, 429 + Retry-After within 100 ms p99, 0 5xx, 0 lost, idle afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp  # Ray Serve's own dependency; far less CPU per streamed request than httpx
import httpx
import yaml

from pdserve.bench.serve_workload import PromptBuilder
from pdserve.bench.serving_systems import PdserveServer

REPO = Path(__file__).resolve().parents[1]
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=300.0)
SERVE_BACKPRESSURE = "Request dropped due to backpressure"  # Serve's queue bound's message


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds; ``sent`` since the run began)."""

    phase: str
    priority: str
    sent: float
    status: int | None = None
    # Latencies count from the request's send (its headers written to the socket, an
    # aiohttp trace): a flood's client spends its own time creating tasks and opening
    # connections first, which is the client's cost, not the server's (``send_wait_s``).
    headers_s: float | None = None  # time to the response headers
    send_wait_s: float | None = None  # from the request's task starting to its send
    retry_after: str | None = None
    ttft: float | None = None
    tokens: int = 0
    finished: bool = False  # [DONE] after a finish_reason
    finish_reason: str | None = None
    error: str | None = None
    # Who refused it: "pdserve" (admission control) or "proxy" (Serve's own queue bound
    # past the ingress's bounds: its "Request dropped due to backpressure", as plain text
    # or, through pdserve's EdgeGate, in the OpenAI error body).
    refused_by: str | None = None
    shed_reason: str | None = None  # admission control's reason, from its message
    shed_message: str | None = None  # the refusal's message (its drain time, its replica's)

    @property
    def admitted(self) -> bool:
        return self.status == 200

    @property
    def truncated(self) -> bool:
        """Admitted but cut short: no [DONE] after a ``length`` finish (every request asks
        for ``--output-len`` tokens ignoring EOS, so any other end is a cut stream)."""
        return self.admitted and not (self.finished and self.finish_reason == "length")

    @property
    def lost(self) -> bool:
        """Admitted but not streamed to the end, or no answer at all."""
        return (self.admitted and not self.finished) or self.status is None


def send_time_trace() -> aiohttp.TraceConfig:
    """A session trace that stamps each request's send (``perf_counter`` when its headers
    were written) into the ``trace_request_ctx`` dict ``send`` passes."""

    async def headers_sent(_: aiohttp.ClientSession, ctx: Any, __: Any) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx.setdefault("sent", time.perf_counter())

    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(headers_sent)
    return trace


def client_session(limit: int = 2000) -> aiohttp.ClientSession:
    """The bench's client: up to ``limit`` connections, requests stamped at their send."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit), trace_configs=[send_time_trace()]
    )


async def send(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], out: Outcome, began: float
) -> None:
    """One streamed request; latencies from its send when the session stamps it
    (``client_session``), else from this call."""
    start = time.perf_counter()
    stamp: dict[str, float] = {}
    headers = {"x-pdserve-priority": out.priority}
    try:
        async with client.post(
            url, json=body, headers=headers, timeout=REQUEST_TIMEOUT, trace_request_ctx=stamp
        ) as r:
            out.send_wait_s = stamp.get("sent", start) - start
            start = stamp.get("sent", start)
            out.status = r.status
            out.headers_s = time.perf_counter() - start
            out.retry_after = r.headers.get("retry-after")
            if r.status != 200:
                raw = await r.read()
                try:
                    message = str(json.loads(raw)["error"]["message"])
                    by_serve = message.startswith(SERVE_BACKPRESSURE)
                    out.refused_by = "proxy" if by_serve else "pdserve"
                    out.shed_message = message[:300]
                    if message.startswith("overloaded ("):
                        out.shed_reason = message[len("overloaded (") :].split(")")[0]
                except (ValueError, KeyError, TypeError):
                    out.refused_by = "proxy"
                return
            finish = None
            async for raw in r.content:  # one SSE line at a time
                line = raw.decode()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.finished = finish is not None
                    out.finish_reason = finish
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    out.error = str(obj["error"].get("message"))[:200]
                    break
                for choice in obj.get("choices") or []:
                    if choice.get("text"):
                        if out.ttft is None:
                            out.ttft = time.perf_counter() - start
                        out.tokens += 1
                    finish = choice.get("finish_reason") or finish
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        out.error = f"{type(err).__name__}: {err}"[:200]


async def drive(
    url: str,
    model: str,
    prompts: list[str],
    phases: list[tuple[str, float, float]],
    output_len: int,
    batch_fraction: float,
    seed: int,
    max_requests: int,
    client_lag: list[tuple[float, float]] | None = None,
) -> list[Outcome]:
    """Open-loop Poisson arrivals, phase by phase (name, rate req/s, seconds). With
    ``client_lag`` the client's own event-loop lag is sampled into it as (sent time, lag):
    a client that cannot keep up delays its sends and stretches every latency it reports."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    async with client_session() as client:
        began = time.perf_counter()
        lag_task = None
        if client_lag is not None:
            lag_task = asyncio.create_task(sample_loop_lag(client_lag, began))
        t = 0.0
        for name, rate, seconds in phases:
            end = t + seconds
            print(f"phase {name} at {rate:.2f} req/s begins at unix {time.time():.3f}", flush=True)
            while len(outcomes) < max_requests:
                t += rng.expovariate(rate)
                if t >= end:
                    t = end
                    break
                delay = began + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                priority = "batch" if rng.random() < batch_fraction else "interactive"
                out = Outcome(name, priority, time.perf_counter() - began)
                body = {
                    "model": model,
                    "prompt": prompts[len(outcomes) % len(prompts)],
                    "max_tokens": output_len,
                    "ignore_eos": True,
                    "temperature": 0.0,
                    "stream": True,
                }
                outcomes.append(out)
                tasks.append(asyncio.create_task(send(client, url, body, out, began)))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=600.0)
        if lag_task is not None:
            lag_task.cancel()
    return outcomes


def drive_in_process(
    kwargs: dict[str, Any],
) -> tuple[list[Outcome], list[tuple[float, float]]]:
    """``drive(**kwargs)`` with its client loop lag, run to the end (in a process of its
    own)."""
    lag: list[tuple[float, float]] = []
    return asyncio.run(drive(**kwargs, client_lag=lag)), lag


async def sample_loop_lag(
    samples: list[tuple[float, float]], began: float, period_s: float = 0.05
) -> None:
    """Append (seconds since ``began``, how late a ``period_s`` sleep woke) until cancelled."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period_s)
        now = time.perf_counter()
        samples.append((now - began, max(0.0, now - t - period_s)))


async def probe_rate(url: str, model: str, prompts: list[str], output_len: int, s: float) -> float:
    """Completed requests per second with 4 clients in a closed loop (the sustainable rate)."""
    done = 0
    stop = time.perf_counter() + s

    async def client_loop(client: aiohttp.ClientSession, i: int) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            out = Outcome("probe", "interactive", 0.0)
            body = {
                "model": model,
                "prompt": prompts[i % len(prompts)],
                "max_tokens": output_len,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
            }
            await send(client, url, body, out, 0.0)
            done += out.finished
            if not out.finished:
                print(f"probe request not completed: {out}", flush=True)
                await asyncio.sleep(0.5)
            i += 4

    began = time.perf_counter()
    async with client_session() as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(4)))
    return done / (time.perf_counter() - began)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(outcomes: list[Outcome], slo_s: float) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for phase in dict.fromkeys(o.phase for o in outcomes):
        for prio in ("interactive", "batch"):
            sel = [o for o in outcomes if o.phase == phase and o.priority == prio]
            if not sel:
                continue
            ok = [o for o in sel if o.admitted]
            shed = [o for o in sel if o.status == 429]
            ttfts = [o.ttft for o in ok if o.ttft is not None]
            rejects = {
                by: [
                    o.headers_s
                    for o in shed
                    if o.headers_s is not None and by in (o.refused_by, "")
                ]
                for by in ("", "proxy", "pdserve")
            }
            rows[f"{phase}/{prio}"] = {
                "sent": len(sel),
                "admitted": len(ok),
                "shed_429": len(shed),
                "shed_with_retry_after": sum(o.retry_after is not None for o in shed),
                "shed_by_proxy": sum(o.refused_by == "proxy" for o in shed),
                "shed_reasons": dict(
                    collections.Counter(o.shed_reason or o.refused_by or "?" for o in shed)
                ),
                "retry_after_values": sorted({o.retry_after for o in shed if o.retry_after}),
                "5xx": sum(1 for o in sel if o.status is not None and o.status >= 500),
                "lost": sum(o.lost for o in sel),
                "failed_or_truncated": sum(
                    o.truncated or o.status is None or o.status >= 500 for o in sel
                ),
                "ttft_p50_s": pct(ttfts, 0.5),
                "ttft_p99_s": pct(ttfts, 0.99),
                "slo_attainment": sum(t <= slo_s for t in ttfts) / len(ttfts) if ttfts else None,
                "reject_p50_s": pct(rejects[""], 0.5),
                "reject_p99_s": pct(rejects[""], 0.99),
                "reject_by_proxy_p50_s": pct(rejects["proxy"], 0.5),
                "reject_by_proxy_p99_s": pct(rejects["proxy"], 0.99),
                "reject_by_pdserve_p50_s": pct(rejects["pdserve"], 0.5),
                "reject_by_pdserve_p99_s": pct(rejects["pdserve"], 0.99),
                "send_wait_p99_s": pct(
                    [o.send_wait_s for o in sel if o.send_wait_s is not None], 0.99
                ),
            }
    return rows


def client_lag_by_phase(
    samples: list[tuple[float, float]], phases: list[tuple[str, float, float]]
) -> dict[str, dict[str, float | None]]:
    """The client's event-loop lag per phase (p99 and max, seconds)."""
    out: dict[str, dict[str, float | None]] = {}
    start = 0.0
    for name, _, seconds in phases:
        lags = [lag for t, lag in samples if start <= t < start + seconds]
        out[name] = {"p99_s": pct(lags, 0.99), "max_s": max(lags, default=None)}
        start += seconds
    return out


def format_table(rows: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))

    cols = [
        "sent",
        "admitted",
        "shed_429",
        "shed_by_proxy",
        "5xx",
        "lost",
        "failed_or_truncated",
        "ttft_p50_s",
        "ttft_p99_s",
        "slo_attainment",
        "reject_p50_s",
        "reject_p99_s",
        "send_wait_p99_s",
    ]
    lines = [f"{'phase/priority':<24}" + "".join(f"{c:>15}" for c in cols)]
    for name, row in rows.items():
        lines.append(f"{name:<24}" + "".join(f"{f(row[c]):>15}" for c in cols))
    return "\n".join(lines)


def write_plot(
    path: Path,
    outcomes: list[Outcome],
    replicas: list[Any],
    title: str,
    phases: list[tuple[str, float, float]] = (),  # type: ignore[assignment]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 3 if replicas else 2
    fig, axes = plt.subplots(n, 1, figsize=(10, 3 * n), sharex=True)
    for prio, color in (("interactive", "tab:blue"), ("batch", "tab:orange")):
        pts = [(o.sent, o.ttft) for o in outcomes if o.priority == prio and o.ttft is not None]
        if pts:
            axes[0].scatter(*zip(*pts, strict=True), s=6, color=color, label=f"{prio} TTFT")
    axes[0].set_ylabel("TTFT (s)")
    axes[0].legend(loc="upper right")
    end = max((o.sent for o in outcomes), default=0.0)
    bins = range(int(end) + 2)
    for label, sel, color in (
        ("admitted/s", [o.sent for o in outcomes if o.admitted], "tab:green"),
        ("shed (429)/s", [o.sent for o in outcomes if o.status == 429], "tab:red"),
    ):
        axes[1].hist(sel, bins=bins, histtype="step", color=color, label=label)
    axes[1].set_ylabel("requests per second")
    axes[1].legend(loc="upper left")
    if replicas:
        ts = [r["t"] for r in replicas]
        for key, style in (
            ("decode", "-"),
            ("decode_starting", ":"),
            ("decode_stopping", "--"),
            ("prefill", "-"),
        ):
            if any(key in r for r in replicas):
                ys = [r.get(key, 0) for r in replicas]
                label = key.replace("_", " ") + (" replicas" if "_" not in key else "")
                axes[2].step(ts, ys, where="post", linestyle=style, label=label)
        axes[2].set_ylabel("replicas (running)")
        axes[2].legend(loc="upper left")
    start = 0.0
    for name, _, seconds in phases:  # phase boundaries, named on the top panel
        for ax in axes:
            ax.axvline(start, color="grey", linewidth=0.6, linestyle="--")
        axes[0].annotate(f" {name}", (start, 1.0), xycoords=("data", "axes fraction"), va="top")
        start += seconds
    axes[-1].set_xlabel("seconds since start")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class ClusterView:
    """A Ray driver on the bench's cluster: replica counts, integrity, admission reports."""

    def __init__(self, state_dir: Path) -> None:
        from pdserve.cluster.serving import connect_driver
        from pdserve.cluster.state import load_state, ray_client_env

        state = load_state(state_dir)
        assert state is not None and state.serve is not None
        # Before Ray is imported: it reads its auth settings from the environment then.
        os.environ.update(ray_client_env(state))

        connect_driver(state)
        self.app = state.serve.app_name
        self.nodes = state.nodes

    def close(self) -> None:
        import ray

        ray.shutdown()

    def replicas(self) -> dict[str, int]:
        from ray import serve
        from ray.serve.schema import ReplicaState

        from pdserve.deployments.app import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT

        app = serve.status().applications.get(self.app)
        counts = {}
        for pool, name in (("decode", DECODE_DEPLOYMENT), ("prefill", PREFILL_DEPLOYMENT)):
            dep = app.deployments.get(name) if app is not None else None
            states = {} if dep is None else dep.replica_states
            counts[pool] = states.get(ReplicaState.RUNNING, 0)
            if pool == "decode":  # a scale-down drains: STOPPING until its streams end
                counts["decode_starting"] = states.get(ReplicaState.STARTING, 0)
                counts["decode_stopping"] = states.get(ReplicaState.STOPPING, 0)
        return counts

    def policy_log(self) -> list[str]:
        """The decode autoscaling policy's log lines (its sizing whenever it changed) from
        Serve's controller log on this machine, read before the cluster goes."""
        import glob

        import ray

        try:
            session = ray._private.worker.global_worker.node.get_session_dir_path()
        except Exception as err:  # noqa: BLE001 - a missing log must not fail the run
            return [f"(no session directory: {err!r})"]
        lines: list[str] = []
        for path in sorted(glob.glob(f"{session}/logs/serve/controller_*.log")):
            with open(path, errors="replace") as f:
                lines += [ln.rstrip() for ln in f if "pdserve decode autoscaling" in ln]
        return lines

    def keep_serve_logs(self, dest: Path) -> None:
        """Copy Serve's logs of this run (controller, proxy, every replica; each node keeps
        its own under its temp dir) to ``dest/<node>``: the nodes' temp dirs go with them."""
        import shutil

        for node in self.nodes:
            src = Path(node.temp_dir) / "session_latest" / "logs" / "serve"
            if src.is_dir():
                shutil.copytree(src, dest / node.name, dirs_exist_ok=True)

    def decode_reports(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(integrity, admission report) of a decode replica (after a ramp's scale-down,
        of the one left)."""
        from ray import serve

        from pdserve.deployments.app import DECODE_DEPLOYMENT

        handle = serve.get_deployment_handle(DECODE_DEPLOYMENT, self.app)
        integrity = handle.check_integrity.remote().result(timeout_s=30).model_dump()
        report = handle.admission_report.remote().result(timeout_s=30).model_dump()
        return [integrity], [report]


def run_phase_set(
    args: argparse.Namespace,
    config: Path,
    up_args: list[str],
    phases_x: list[tuple[str, float, float]],
    tag: str,
    prompts: list[str],
    base_rate: float | None,
) -> dict[str, Any]:
    cfg = yaml.safe_load(config.read_text())
    slo_s = cfg.get("slo", {}).get("ttft_ms", 2000) / 1000.0
    server = PdserveServer(
        tag,
        config,
        args.out_dir / f"state-{tag}",
        args.out_dir / f"{tag}.log",
        up_args=up_args,
        env=dict(kv.split("=", 1) for kv in args.server_env),
    )
    uptime_before = Path("/proc/loadavg").read_text().split()[:3]
    view: ClusterView | None = None
    try:
        url = start_with_retries(server, args.start_timeout_s, args.start_attempts)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        view = ClusterView(args.out_dir / f"state-{tag}")
        if base_rate is None:
            completions = f"{url}/v1/completions"
            base_rate = asyncio.run(
                probe_rate(completions, model, prompts, args.output_len, args.probe_s)
            )
        phases = [(n, max(0.05, x * base_rate), s) for n, x, s in phases_x]
        # This process's Ray driver just joined the cluster (Ray starts workers for a new
        # job): let that work end before the load starts, or it counts as the server's.
        time.sleep(args.settle_s)
        samples: list[dict[str, Any]] = []
        client_lag: list[tuple[float, float]] = []
        stop = [False]

        async def with_monitor() -> list[Outcome]:
            async def monitor() -> None:
                began = time.perf_counter()
                while not stop[0]:
                    counts = await asyncio.to_thread(view.replicas)
                    samples.append({"t": time.perf_counter() - began, **counts})
                    await asyncio.sleep(2.0)

            mon = asyncio.create_task(monitor())
            try:
                # The client runs in a process of its own: this one holds a Ray driver
                # (its threads, the monitor's calls), whose work would delay the client's
                # sends and its reading of every answer, and count as the server's.
                with ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn")
                ) as pool:
                    outcomes, lag = await asyncio.get_running_loop().run_in_executor(
                        pool,
                        drive_in_process,
                        {
                            "url": f"{url}/v1/completions",
                            "model": model,
                            "prompts": prompts,
                            "phases": phases,
                            "output_len": args.output_len,
                            "batch_fraction": args.batch_fraction,
                            "seed": args.seed,
                            "max_requests": args.max_requests,
                        },
                    )
                client_lag.extend(lag)
                return outcomes
            finally:
                stop[0] = True
                await mon

        outcomes = asyncio.run(with_monitor())
        idle_deadline = time.monotonic() + 60
        integrity, admission = view.decode_reports()
        while not all(_idle(i) for i in integrity) and time.monotonic() < idle_deadline:
            time.sleep(2)
            integrity, admission = view.decode_reports()
        policy_log = view.policy_log()
        view.keep_serve_logs(args.out_dir / f"serve-logs-{tag}")
    finally:
        if view is not None:
            view.close()  # before the cluster goes: a driver without its GCS exits
        server.stop()
    rows = summarize(outcomes, slo_s)
    errors = [abs(p - a) for rep in admission for p, a in rep["samples"]]
    result = {
        "tag": tag,
        "config": str(config),
        "slo_ttft_s": slo_s,
        "base_rate_rps": base_rate,
        "phases": [{"name": n, "rate_rps": r, "seconds": s} for n, r, s in phases],
        "loadavg_before": uptime_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "summary": rows,
        "client_loop_lag": client_lag_by_phase(client_lag, phases),
        "replicas_over_time": samples,
        "by_decode_replicas": by_decode_replicas(outcomes, samples, slo_s),
        "decode_policy_log": policy_log,
        "decode_integrity_after": integrity,
        "idle_after": all(_idle(i) for i in integrity),
        "median_abs_ttft_prediction_error_s": statistics.median(errors) if errors else None,
        "prediction_samples": len(errors),
        # (predicted, observed) TTFT of each admitted request the decode replicas scored.
        "ttft_prediction_pairs": [[p, a] for rep in admission for p, a in rep["samples"]],
        "requests": [asdict(o) for o in outcomes],
    }
    write_plot(
        args.out_dir / f"{tag}.png",
        outcomes,
        samples if tag == "ramp" else [],
        f"pdserve {tag}: {config.name}, 1x = {base_rate:.2f} req/s",
        phases,
    )
    return result


def start_with_retries(server: PdserveServer, timeout_s: float, attempts: int) -> str:
    """Start the cluster; on a busy machine Ray's node startup can time out, so retry."""
    for attempt in range(1, attempts + 1):
        try:
            return server.start(timeout_s=timeout_s)
        except Exception as err:  # noqa: BLE001 - reported, then retried or re-raised
            server.stop()
            if attempt == attempts:
                raise
            print(f"[{server.name}] start failed ({type(err).__name__}); retrying", flush=True)
    raise AssertionError("unreachable")


def _idle(report: dict[str, Any]) -> bool:
    return (
        report["num_unfinished"] == 0
        and report["num_free_blocks"] == report["num_total_blocks"]
        and not report["pending_transfers"]
        and report["num_streams"] == 0
    )


def replica_changes(samples: list[dict[str, Any]]) -> list[str]:
    """The decode pool's (running, starting, stopping) counts where they change."""
    out, last = [], None
    for c in samples:
        now = (c["decode"], c.get("decode_starting", 0), c.get("decode_stopping", 0))
        if now != last:
            out.append(f"{c['t']:.0f}s: {now[0]}/{now[1]}/{now[2]}")
            last = now
    return out


def by_decode_replicas(
    outcomes: list[Outcome], samples: list[dict[str, Any]], slo_s: float
) -> list[dict[str, Any]]:
    """The requests split where the running decode replica count changed (by the time they
    were sent): per stretch its replicas, what was sent, admitted and shed, TTFT p50/p99 of
    the admitted, the SLO attainment of the admitted and of all sent (goodput)."""
    cuts = [(0.0, samples[0]["decode"])] if samples else []
    for c in samples[1:]:
        if c["decode"] != cuts[-1][1]:
            cuts.append((c["t"], c["decode"]))
    rows = []
    for i, (start, replicas) in enumerate(cuts):
        end = cuts[i + 1][0] if i + 1 < len(cuts) else float("inf")
        sel = [o for o in outcomes if start <= o.sent < end]
        ttfts = [o.ttft for o in sel if o.admitted and o.ttft is not None]
        good = sum(t <= slo_s for t in ttfts)
        rows.append(
            {
                "from_s": round(start, 1),
                "decode_replicas": replicas,
                "sent": len(sel),
                "admitted": sum(o.admitted for o in sel),
                "shed_429": sum(o.status == 429 for o in sel),
                "failed_or_truncated": sum(
                    o.truncated or o.status is None or o.status >= 500 for o in sel
                ),
                "ttft_p50_s": pct(ttfts, 0.5),
                "ttft_p99_s": pct(ttfts, 0.99),
                "slo_attainment": good / len(ttfts) if ttfts else None,
                "goodput_of_sent": good / len(sel) if sel else None,
            }
        )
    return rows


def ramp_config(base: Path, out_dir: Path) -> Path:
    """The shipped config with autoscaling on and two decode replicas allowed; the grace
    period of a stopping replica sized to a whole stream under load, as the config's
    description asks (``max_tokens`` x TPOT objective, plus the TTFT objective, with room)."""
    cfg = yaml.safe_load(base.read_text())
    cfg["autoscaling"] = True
    cfg["graceful_shutdown_timeout_s"] = 30.0
    cfg["decode"].update(
        min_replicas=1, max_replicas=2, upscale_delay_s=5.0, downscale_delay_s=15.0
    )
    path = out_dir / f"ramp-{base.name}"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=REPO / "configs/local-2core-colocated.yaml")
    # Direct ingress by default: through Serve's proxy a flood's 429s queue behind its loop.
    p.add_argument("--up-args", default="--prefill-cpus 1 --decode-cpus 2 --direct-ingress")
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the cluster's processes only, not this driver's (e.g. a Ray Serve "
        "setting); repeatable",
    )
    p.add_argument("--base-rate", type=float, default=None, help="1x in req/s; None = probe")
    p.add_argument("--probe-s", type=float, default=15.0)
    p.add_argument("--factor", type=float, default=10.0)
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--prompt-len", type=int, default=80)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--batch-fraction", type=float, default=0.2)
    p.add_argument("--max-requests", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mode",
        choices=("step", "ramp"),
        default="step",
        help="step: 1x -> factor x -> 1x; ramp: 0.5x -> 4x -> 0.5x with autoscaling on "
        "(one cluster per run: a Ray driver connects to one cluster per process)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=5.0,
        help="wait after connecting to the cluster, before the first phase",
    )
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--start-attempts", type=int, default=3)
    p.add_argument("--out-dir", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from pdserve.engine.testmodel import ensure_test_model

    args = parse_args(argv)
    args.out_dir = args.out_dir or REPO / f"bench/results/overload-{time.strftime('%Y%m%d-%H%M%S')}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(ensure_test_model("small")), local_files_only=True)
    builder = PromptBuilder(tok, random.Random(args.seed))
    prompts = [builder.build(args.prompt_len)[0] for _ in range(64)]
    up_args = args.up_args.split()
    results: dict[str, Any] = {}
    if args.mode == "step":
        phases = [
            ("1x", 1.0, args.phase_s),
            (f"{args.factor:g}x", args.factor, args.phase_s),
            ("1x-after", 1.0, args.phase_s),
        ]
        config = args.config
    else:
        phases = [("0.5x", 0.5, 30.0), ("4x", 4.0, 90.0), ("0.5x-after", 0.5, 90.0)]
        config = ramp_config(args.config, args.out_dir)
    result = run_phase_set(args, config, up_args, phases, args.mode, prompts, args.base_rate)
    results[args.mode] = result
    print(
        f"\n{args.mode} {config.name}: 1x = {result['base_rate_rps']:.2f} req/s, "
        f"loadavg before {result['loadavg_before']} after {result['loadavg_after']}"
    )
    print(format_table(result["summary"]))
    print("429s by reason:", {k: v["shed_reasons"] for k, v in result["summary"].items()})
    lag = {k: v["p99_s"] for k, v in result["client_loop_lag"].items()}
    print(
        "client event-loop lag p99 per phase (s):", {k: v and round(v, 3) for k, v in lag.items()}
    )
    print(
        f"idle after: {result['idle_after']}; median |predicted - actual| TTFT: "
        f"{result['median_abs_ttft_prediction_error_s']} s over {result['prediction_samples']}"
    )
    if args.mode == "ramp":
        counts = result["replicas_over_time"]
        print(
            "decode replicas over time (t s: running/starting/stopping), changes only:",
            replica_changes(counts),
        )
        print("by running decode replicas (from the time sent):")
        for row in result["by_decode_replicas"]:
            print("  " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in row.items()))  # fmt: skip
        print("decode policy (controller log):", *result["decode_policy_log"], sep="\n  ")
    out = args.out_dir / f"overload-{args.mode}.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {out} and {args.out_dir / (args.mode + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
