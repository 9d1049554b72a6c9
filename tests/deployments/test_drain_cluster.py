"""Graceful drain on a real Serve app: the decode pool goes from two replicas to one while
streams run on both (Serve's scale-down path, driven the way an external scaler drives it),
and every stream still ends with all its tokens; the replica that stops first drains (it
stays STOPPING while it holds streams) and nothing is left held afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.deployments.ingress_harness import APP_NAME, app_config, stream_completion, wait_ready
from tests.support import free_port, wait_until
from tests.support.cluster import private_ray

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]

STREAMS = 6
MAX_TOKENS = 600  # long enough (several seconds on the tiny model) to outlast the scale-down
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


@contextmanager
def two_decode_replicas() -> Iterator[str]:
    """The app with two decode replicas of one CPU each on a private 2-CPU Ray instance, the
    scale-down grace period long enough for a whole stream, and Serve's external scaling
    API on (the replica count can be set from outside, as an autoscaler would)."""
    from ray import serve

    from pdserve.deployments.app import build_app
    from pdserve.deployments.config import AppConfig
    from pdserve.engine.testmodel import ensure_test_model

    model_dir = str(ensure_test_model("tiny"))
    cfg = app_config(model_dir)
    cfg["decode"].update(min_replicas=2, max_replicas=2)
    cfg["slo"] = {"ttft_ms": 60_000, "tpot_ms": 1_000}  # nothing is shed here
    cfg["graceful_shutdown_timeout_s"] = 60.0
    config = AppConfig.from_dict(cfg)
    port = free_port()
    with private_ray("pdserve-drain-"):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/", external_scaler_enabled=True)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
        yield url


def decode_states() -> dict[str, int]:
    from ray import serve

    from pdserve.deployments.app import DECODE_DEPLOYMENT

    app = serve.status().applications[APP_NAME]
    return dict(app.deployments[DECODE_DEPLOYMENT].replica_states)


def decode_replicas() -> dict[str, tuple[str, int | None]]:
    """replica id -> (state, requests it holds now: Serve's own count, None once gone)."""
    import ray
    from ray.serve.context import _get_global_client

    from pdserve.deployments.app import DECODE_DEPLOYMENT

    details = _get_global_client().get_serve_details()
    replicas = details["applications"][APP_NAME]["deployments"][DECODE_DEPLOYMENT]["replicas"]
    out: dict[str, tuple[str, int | None]] = {}
    for r in replicas:
        try:
            actor = ray.get_actor(r["actor_name"], namespace="serve")
            ongoing = ray.get(actor.get_num_ongoing_requests.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the replica exited meanwhile
            ongoing = None
        out[r["replica_id"]] = (str(r["state"]), ongoing)
    return out


def scale_decode(replicas: int) -> None:
    """What Serve's REST scaling API (and an external autoscaler) does: set the target."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    from pdserve.deployments.app import DECODE_DEPLOYMENT

    controller = _get_global_client()._controller
    ray.get(
        controller.update_deployment_replicas.remote(
            DeploymentID(name=DECODE_DEPLOYMENT, app_name=APP_NAME), replicas
        )
    )


async def streams_through_a_scale_down(url: str) -> tuple[list[dict], dict, list[dict]]:
    """Open the streams one after the other (each once the one before streams: the router
    then sees each placement, and spreads them over both replicas), note what each replica
    holds, scale decode to one replica, and poll the replicas until every stream ended."""
    timeline: list[dict] = []  # replica id -> (state, ongoing), per poll
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = []
        for _ in range(STREAMS):
            started = asyncio.Event()
            one = stream_completion(client, PROMPT, MAX_TOKENS, started)
            tasks.append(asyncio.create_task(one))
            await asyncio.wait_for(started.wait(), timeout=60)
        before = await asyncio.to_thread(decode_replicas)
        await asyncio.to_thread(scale_decode, 1)
        while not all(t.done() for t in tasks):
            timeline.append(await asyncio.to_thread(decode_replicas))
            await asyncio.sleep(0.2)
        results = [t.result() for t in tasks]
    return results, before, timeline


def test_a_scale_down_drains_the_stopping_replica_and_cuts_no_stream() -> None:
    from ray import serve

    from pdserve.deployments.app import DECODE_DEPLOYMENT

    with two_decode_replicas() as url:
        assert decode_states() == {"RUNNING": 2}
        results, before, timeline = asyncio.run(streams_through_a_scale_down(url))

        # Both replicas held streams when the scale-down came, so whichever Serve stopped
        # had streams to drain.
        assert len(before) == 2 and all(n and n >= 1 for _, n in before.values()), before
        # Every stream ended properly with all its tokens: none was cut by the scale-down.
        for r in results:
            assert r["status"] == 200 and r["error"] is None, r
            assert r["done"] and r["finish"] == "length" and r["tokens"] == MAX_TOKENS, r
        # The stopping replica drained: Serve held it STOPPING while it still held streams
        # (they then ended with all their tokens, above).
        draining = [
            n for poll in timeline for state, n in poll.values() if "STOPPING" in state and n
        ]
        assert draining, f"no replica seen STOPPING with streams: {timeline[:3]}"

        # One replica left, idle: no request, block or stream held.
        wait_until(
            lambda: decode_states() == {"RUNNING": 1},
            timeout=60,
            interval=0.5,
            what="one RUNNING decode replica left",
        )
        handle = serve.get_deployment_handle(DECODE_DEPLOYMENT, APP_NAME)
        report = handle.check_integrity.remote().result(timeout_s=60)
        assert report.idle, report
