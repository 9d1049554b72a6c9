"""A real pdserve Serve app for the ingress tests: one local Ray instance on 127.0.0.2,
Serve's HTTP and gRPC proxies on OS-chosen ports of 127.0.0.1 (or, with ``direct_ingress``,
no proxy: the ingress replica serves both itself), the tiny test model and the real engine
(no prefill pool: every request prefills on the decode replica)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.cluster.ports import free_port_all_interfaces
from pdserve.deployments.edge_bound import STREAMS_HEADER
from tests.support import free_port, wait_until
from tests.support.cluster import private_ray

GRPC_SERVICER = "pdserve.deployments.grpc.pdserve_pb2_grpc.add_PDServeServicer_to_server"
HEALTH_SERVICER = "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"
APP_NAME = "pdserve"
MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class ServeApp:
    http_url: str
    grpc_target: str
    model_dir: str
    model_name: str

    def decode_handle(self) -> Any:
        from ray import serve

        from pdserve.deployments.app import DECODE_DEPLOYMENT

        return serve.get_deployment_handle(DECODE_DEPLOYMENT, APP_NAME)


def app_config(model_dir: str, api: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "api": api or {},
        "name": APP_NAME,
        "model": {"path": model_dir, "name": "tiny"},
        "policy": {"mode": "always_local"},
        "decode": {
            "node_labels": {},
            "num_cpus": 1,
            "engine": {"num_kv_blocks": 160, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8},
        },
        "autoscaling": False,
    }


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def running_app(
    api: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    direct_ingress: bool = False,
) -> Iterator[ServeApp]:
    """The app, with ``api`` as its ``APIConfig`` (keys, limits; None = defaults) and
    ``overrides`` replacing top-level ``AppConfig`` fields (e.g. ``slo``, ``policy``).
    Ray's processes start with the Serve settings ``pdserve up`` gives its nodes (with
    ``direct_ingress``: ``pdserve up --direct-ingress``'s, and the URLs are the ingress
    replica's own)."""
    import ray.serve  # noqa: F401  (Serve reads its settings at import: this driver keeps its own)

    from pdserve.cluster.local import serve_env

    env = serve_env(direct_ingress)
    # Ray's processes inherit the environment at ray.init.
    with _environ(env), _running_app(api, overrides, direct_ingress) as app:
        yield app


@contextmanager
def _running_app(
    api: dict[str, Any] | None, overrides: dict[str, Any] | None, direct_ingress: bool
) -> Iterator[ServeApp]:
    from ray import serve

    from pdserve.cluster.serving import ingress_ports
    from pdserve.deployments.app import build_app
    from pdserve.deployments.config import AppConfig
    from pdserve.engine.testmodel import ensure_test_model

    model_dir = str(ensure_test_model("tiny"))
    # Serve's gRPC proxy binds every interface, whatever the HTTP host is.
    http_port, grpc_port = free_port(), free_port_all_interfaces()
    with private_ray("pdserve-ingress-"):
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options={
                "port": grpc_port,
                "grpc_servicer_functions": [GRPC_SERVICER, HEALTH_SERVICER],
            },
        )
        config = AppConfig.from_dict({**app_config(model_dir, api), **(overrides or {})})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        if direct_ingress:
            http_port, direct_grpc = ingress_ports(APP_NAME, timeout_s=60)
            grpc_port = direct_grpc or grpc_port
        app = ServeApp(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", model_dir, "tiny")
        wait_ready(app.http_url)
        yield app


# What the ingress tells Serve's proxy, removed before any client sees it.
INTERNAL_RESPONSE_HEADERS = (STREAMS_HEADER,)


async def stream_completion(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, first: asyncio.Event | None = None
) -> dict[str, Any]:
    """One streamed /v1/completions as a client sees it: status, time to the response
    headers, Retry-After, pdserve's internal headers that reached it (none should), the
    error body of a refusal (``body``, or ``text`` when it is not JSON: Serve's own
    refusals are plain text), the completion tokens of the usage chunk, the last finish
    reason, an in-stream error and whether ``[DONE]`` came. ``first`` is set at the first
    chunk carrying text."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.perf_counter()
    out: dict[str, Any] = {"tokens": 0, "done": False, "finish": None, "error": None}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        out["status"] = resp.status_code
        out["headers_s"] = time.perf_counter() - began
        out["retry_after"] = resp.headers.get("retry-after")
        out["internal_headers"] = [h for h in resp.headers if h in INTERNAL_RESPONSE_HEADERS]
        if resp.status_code != 200:
            raw = await resp.aread()
            try:
                out["body"] = json.loads(raw)
            except ValueError:
                out["text"] = raw.decode()
            return out
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    out["error"] = chunk["error"]
                if chunk.get("usage"):  # the last chunk: the tokens the client received
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    if choice.get("text") and first is not None:
                        first.set()
                    out["finish"] = choice.get("finish_reason") or out["finish"]
    return out


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    """Until ``url``'s readiness route answers 200 (both pools have a ready replica)."""

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout_s, interval=0.5, what=f"{url}/ready to answer 200")


def wait_decode_report(
    app: ServeApp, done: Callable[[Any], bool], what: str, timeout_s: float = 30.0
) -> Any:
    """Poll the decode replica's integrity report until ``done(report)``; returns that
    report (the timeout's message names ``what``)."""
    decode = app.decode_handle()

    def report() -> Any:
        got = decode.check_integrity.remote().result(timeout_s=timeout_s)
        return got if done(got) else None

    return wait_until(report, timeout_s, interval=0.2, what=what)


def no_request_held(report: Any) -> bool:
    """The decode replica holds no unfinished request and no open stream."""
    return report.num_unfinished == 0 and report.num_streams == 0
