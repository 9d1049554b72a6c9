"""The floor under a flood's 429s: ``bench.overload``'s client (the same 400 requests at
once, timed from each request's send) against servers that answer every request 429 at
once, in a process of their own:

- ``uvicorn``: a bare Starlette app on uvicorn (what any Python HTTP front costs);
- ``serve``: a bare Serve deployment on a private local Ray, reached through Serve's
  direct ingress (the ingress replica's own HTTP server, as ``pdserve up --direct-ingress``
  runs pdserve's), its app answering every request;
- ``serve-bounded``: the same with the deployment bounded as pdserve bounds its ingress
  (``--max-ongoing``, ``--max-queued``), so Serve itself answers most of the 429s.

Prints a table and writes JSON. Run from outside the checkout (``cd /tmp``, or
``python -P``); the Serve targets start a Ray instance of their own (2 CPUs, loopback, a
private temp dir), stopped at the end."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from pdserve.bench.overload import drive, format_table, pct, summarize

TARGETS = ("uvicorn", "serve", "serve-bounded")
ERROR = {"error": {"message": "overloaded (floor)", "type": "rate_limit_error", "code": 429}}


def _starlette_app() -> Any:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def refuse(_: Any) -> JSONResponse:
        return JSONResponse(ERROR, status_code=429, headers={"Retry-After": "1"})

    return Starlette(routes=[Route("/v1/completions", refuse, methods=["POST"])])


def serve_uvicorn() -> None:
    """Child process: the bare app on uvicorn, on a loopback port the OS gives; prints it."""
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(_starlette_app(), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def serve_ray(max_ongoing: int, max_queued: int) -> None:
    """Child process: the bare app as a Serve deployment behind direct ingress on a private
    Ray instance; prints its HTTP port, then serves until stdin closes."""
    import shutil
    import tempfile

    from pdserve.cluster.local import DIRECT_INGRESS_ENV

    os.environ.update(DIRECT_INGRESS_ENV)  # before Ray and Serve read their settings
    import ray
    from ray import serve

    from pdserve.cluster.ports import free_port
    from pdserve.cluster.serving import ingress_ports

    temp_dir = tempfile.mkdtemp(prefix="pdserve-floor-")
    ray.init(
        address="local",
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 * 2**20,
        log_to_driver=False,
    )
    try:
        app = _starlette_app()

        from ray.serve.config import BackpressureConfig

        backpressure = BackpressureConfig(status_code=429, retry_after_s=2.0)  # as pdserve's

        class Refuse:
            async def __call__(self, request: Any) -> Any:
                return await app.router.routes[0].endpoint(request)

        deployment = serve.deployment(
            max_ongoing_requests=max_ongoing,
            max_queued_requests=max_queued,
            backpressure_config=backpressure,
        )(Refuse)

        serve.start(http_options={"host": "127.0.0.1", "port": free_port("127.0.0.1")})
        serve.run(deployment.bind(), name="floor", route_prefix="/")
        port, _ = ingress_ports("floor", timeout_s=120)
        print(port, flush=True)
        sys.stdin.read()
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


async def raw_burst(url_host: str, port: int, n: int, model: str) -> list[tuple[int, float]]:
    """The cheapest client asyncio allows: ``n`` connections opened at once, one
    pre-encoded POST each; (status, seconds from the write to the status line) per request.
    What it saves against ``drive`` (aiohttp) is the client's own share of the latency."""
    body = json.dumps({"model": model, "prompt": "x" * 320, "max_tokens": 16}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url_host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()

    async def one() -> tuple[int, float]:
        reader, writer = await asyncio.open_connection(url_host, port)
        writer.write(head + body)
        sent = time.perf_counter()
        status = int((await reader.readline()).split()[1])
        took = time.perf_counter() - sent
        writer.close()
        return status, took

    return await asyncio.gather(*(one() for _ in range(n)))


def measure(args: argparse.Namespace, target: str, host: str, port: int) -> dict[str, Any]:
    """The burst from ``drive`` (aiohttp), then from ``raw_burst``, against one server."""
    url = f"http://{host}:{port}/v1/completions"
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    # Twice the rate the window needs, so that the cap, not the draw, sets the count.
    phases = [("burst", 2 * args.requests / args.spread_s, args.spread_s)]
    lag: list[tuple[float, float]] = []
    outcomes = asyncio.run(
        drive(url, args.model, ["x" * 320], phases, 16, 0.0, 0, args.requests, lag)
    )
    time.sleep(args.settle_s)
    raw = asyncio.run(raw_burst(host, port, args.requests, args.model))
    return {
        "target": target,
        "loadavg_before": loadavg,
        "summary": summarize(outcomes, 2.0),
        "raw_client": {
            "statuses": dict(collections.Counter(status for status, _ in raw)),
            "reject_p50_s": pct([t for status, t in raw if status == 429], 0.5),
            "reject_p99_s": pct([t for status, t in raw if status == 429], 0.99),
        },
        "client_loop_lag": {
            "p99_s": pct([v for _, v in lag], 0.99),
            "max_s": max(v for _, v in lag),
        },
    }


def run_target(args: argparse.Namespace, target: str) -> dict[str, Any]:
    child = [sys.executable, "-P", "-m", "pdserve.bench.reject_floor", "--child", target]
    child += ["--max-ongoing", str(args.max_ongoing), "--max-queued", str(args.max_queued)]
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.server_env)}
    proc = subprocess.Popen(
        child, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        time.sleep(args.settle_s)
        return measure(args, target, "127.0.0.1", port)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    p.add_argument(
        "--url",
        default=None,
        help="http://HOST:PORT of a running server (a pdserve ingress) to send the same "
        "bursts to, instead of the targets",
    )
    p.add_argument("--model", default="floor", help="the requests' model (a pdserve's, with --url)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--spread-s", type=float, default=0.05, help="the burst's send window")
    # pdserve's derived ingress bounds for the shipped configs (AppConfig.ingress_*_limit).
    p.add_argument("--max-ongoing", type=int, default=128, help="serve-bounded's bound")
    p.add_argument("--max-queued", type=int, default=64, help="serve-bounded's queue")
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the server's processes (e.g. a Ray Serve setting); repeatable",
    )
    p.add_argument("--settle-s", type=float, default=3.0, help="wait after the server starts")
    p.add_argument("--out", type=Path, default=Path("reject-floor.json"))
    p.add_argument("--child", choices=TARGETS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child == "uvicorn":
        serve_uvicorn()
        return 0
    if args.child is not None:
        bounded = args.child == "serve-bounded"
        serve_ray(args.max_ongoing if bounded else 10_000, args.max_queued if bounded else -1)
        return 0
    results = []
    for target in [args.url] if args.url else args.targets:
        if args.url:
            parts = urllib.parse.urlsplit(args.url)
            result = measure(args, target, parts.hostname or "127.0.0.1", parts.port or 80)
        else:
            result = run_target(args, target)
        results.append(result)
        lag = result["client_loop_lag"]
        print(f"\n{target}: loadavg before {result['loadavg_before']}, client loop lag {lag}")
        print(format_table(result["summary"]))
        print("the same burst from a raw asyncio client:", result["raw_client"])
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
