"""Request migration on a real local cluster: two decode replicas serve greedy streams over
HTTP, one replica's process is SIGKILLed mid-stream, and every client stream still
completes with the text and usage of an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")

from pdserve.deployments.config import AppConfig  # noqa: E402
from tests.cluster.telemetry_scrape import node_samples  # noqa: E402
from tests.support import wait_until  # noqa: E402
from tests.support.cluster import PD, app_config  # noqa: E402
from tests.support.cluster import local_cluster as serve_on_local_cluster  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(400)]
NUM_STREAMS = 10
MAX_TOKENS = 96
REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"
MIGRATIONS = "ray_pdserve_request_migrations_total"
PROMPTS = [f"stream {i}: the river runs past the old mill" for i in range(NUM_STREAMS)]


def _config() -> AppConfig:
    data = app_config().model_dump(mode="json")
    data["decode"].update({"min_replicas": 2, "max_replicas": 2})
    # Every prompt, and every continuation, prefills on the decode replicas themselves.
    data["policy"]["local_prefill_max_tokens"] = 4096
    # Admission control must not shed any of the streams this test counts.
    data.setdefault("admission", {}).update({"on_slo_miss": "queue", "adaptive_concurrency": False})
    data["max_migrations"] = 2
    return AppConfig.from_dict(data)


@pytest.fixture(scope="module")
def pd() -> Iterator[PD]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv(REPORT_INTERVAL_ENV, "1000")  # Ray's agents export every second
        with serve_on_local_cluster(_config(), pool_cpus=2) as pd:
            yield pd


def _decode_replicas() -> dict[str, tuple[int, int]]:
    """Each decode replica's actor name -> (pid, streams it serves now)."""

    # Defined here so that Ray ships it by value (the replicas do not import this module).
    def open_streams(_replica_actor: Any) -> tuple[int, int]:
        from ray import serve

        return os.getpid(), serve.get_replica_context().servable_object.num_open_streams()

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and "DecodeServer" in a["name"]
    ]
    return {
        name: ray.get(
            ray.get_actor(name, namespace="serve").__ray_call__.remote(open_streams), timeout=60
        )
        for name in names
    }


async def _stream(client: httpx.AsyncClient, model: str, prompt: str, seen: asyncio.Event):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict[str, Any] = {"text": "", "usage": None, "error": None, "done": False}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                out["error"] = chunk.get("error") or out["error"]
                out["usage"] = chunk.get("usage") or out["usage"]
                for choice in chunk.get("choices") or []:
                    out["text"] += choice.get("text") or ""
                if out["text"]:
                    seen.set()
    return out


async def _first_text(seen: list[asyncio.Event], count: int) -> None:
    """Returns once ``count`` of the streams have text."""
    pending = {asyncio.ensure_future(e.wait()) for e in seen}
    try:
        while len(seen) - len(pending) < count:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in pending:
            wait.cancel()


def test_streams_survive_a_decode_replica_killed_mid_stream(pd: PD) -> None:
    assert len(_decode_replicas()) == 2

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=pd.http, timeout=300) as client:
            (model,) = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
            seen = [asyncio.Event() for _ in PROMPTS]
            tasks = [
                asyncio.create_task(_stream(client, model, p, e))
                for p, e in zip(PROMPTS, seen, strict=True)
            ]
            # Mid-burst: half the streams have text, the others may still wait for theirs.
            await asyncio.wait_for(_first_text(seen, NUM_STREAMS // 2), timeout=120)
            assert not all(t.done() for t in tasks), "streams ended before the kill"
            # The replica that holds the most streams dies.
            held = await asyncio.to_thread(_decode_replicas)
            pid, streams = max(held.values(), key=lambda pid_streams: pid_streams[1])
            assert streams > 0, held
            os.kill(pid, signal.SIGKILL)
            running = sum(not t.done() for t in tasks)
            print(f"SIGKILLed the decode replica serving {streams} of {running} running streams")
            print(f"streams per decode replica: {held}")
            killed = await asyncio.gather(*tasks)
            # The reference: the same streams, uninterrupted, after the pool recovered.
            quiet = [asyncio.Event() for _ in PROMPTS]
            reference = await asyncio.gather(
                *(_stream(client, model, p, e) for p, e in zip(PROMPTS, quiet, strict=True))
            )
            return killed, reference

    killed, reference = asyncio.run(run())
    for got, want in zip(killed, reference, strict=True):
        assert got["error"] is None and got["done"], got
        assert got["text"] == want["text"]
        assert got["usage"] == want["usage"]
        assert got["usage"]["completion_tokens"] == MAX_TOKENS
    # The streams of the killed replica were migrated, and counted by cause.
    ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]
    migrated = wait_until(
        lambda: {
            s.labels["cause"]: s.value
            for s in node_samples("127.0.0.2", ports)
            if s.name == MIGRATIONS and s.value > 0
        },
        60,
        interval=1.0,
        what="a migration counted",
    )
    print(f"streams migrated by cause: {migrated}")
