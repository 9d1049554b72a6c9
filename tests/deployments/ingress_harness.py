"""A real pdserve Serve app for the ingress tests: one local Ray instance on 127.0.0.2,
Serve's HTTP and gRPC proxies on OS-chosen ports of 127.0.0.1 (or, with ``direct_ingress``,
no proxy: the ingress replica serves both itself), the tiny test model and the real engine
(no prefill pool: every request prefills on the decode replica)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

GRPC_SERVICER = "pdserve.deployments.grpc.pdserve_pb2_grpc.add_PDServeServicer_to_server"
HEALTH_SERVICER = "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"
APP_NAME = "pdserve"
MAX_MODEL_LEN = 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    ``direct_ingress``: Ray's processes start with the environment ``pdserve up
    --direct-ingress`` gives its nodes, and the URLs are the ingress replica's own."""
    import ray.serve  # noqa: F401  (Serve reads its settings at import: this driver keeps its own)

    from pdserve.cluster.local import DIRECT_INGRESS_ENV

    env = dict(DIRECT_INGRESS_ENV) if direct_ingress else {}
    # Ray's processes inherit the environment at ray.init.
    with _environ(env), _running_app(api, overrides, direct_ingress) as app:
        yield app


@contextmanager
def private_ray(prefix: str) -> Iterator[None]:
    """A private Ray instance (2 CPUs, node address 127.0.0.2) for the span of the block,
    with Serve shut down after it: address="local" never joins a cluster someone else
    started on this machine, and its own temp dir keeps it out of /tmp/ray (where
    `ray.init()` looks)."""
    import ray
    from ray import serve

    temp_dir = tempfile.mkdtemp(prefix=prefix)
    ray.init(
        address="local",
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.2",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


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
    http_port, grpc_port = free_port(), free_port()
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


async def stream_completion(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, first: asyncio.Event | None = None
) -> dict[str, Any]:
    """One streamed /v1/completions as a client sees it: status, time to the response
    headers, Retry-After, the error body of a refusal (``body``, or ``text`` when it is not
    JSON: Serve's own refusals are plain text), the completion tokens of the usage chunk,
    the last finish reason, an in-stream error and whether ``[DONE]`` came. ``first`` is
    set at the first chunk carrying text."""
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
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/ready did not answer 200 within {timeout_s}s")
