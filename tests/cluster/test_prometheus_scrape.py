"""A real Prometheus scraping a real local cluster: every query of the chart's Grafana
dashboard returns a series, the dashboard's model variable lists the served model, and the
chart's alert and recording rules evaluate without error on the scraped data (the TTFT
bound's ``le`` matcher matches what Ray writes).

The cluster serves a mix that makes every dashboard series exist: remote and local
prefills, a repeated prompt (prefix cache hits), a batch request shed by a tiny queue-wait
bound, and a remote prefill whose prefill replica is frozen past the transfer deadline
(a KV transfer failure and a local fallback). Needs Debian's ``prometheus`` package.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        PROMETHEUS is None, reason="prometheus not installed (Debian: apt-get install prometheus)"
    ),
]
ray = pytest.importorskip("ray")
pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart's rules")

from pdserve.deployments.config import AppConfig  # noqa: E402
from tests.helm.rendering import CHART, render  # noqa: E402
from tests.support import free_port, wait_until  # noqa: E402
from tests.support.cluster import PD, app_config  # noqa: E402
from tests.support.cluster import local_cluster as serve_on_local_cluster  # noqa: E402

DASHBOARD = CHART / "dashboards" / "pdserve.json"
LONG_PROMPT = " ".join(["the river runs past the old mill to the sea"] * 12)
# Shares no prefix with LONG_PROMPT: nothing of it is cached on the decode replica.
FROZEN_PROMPT = " ".join(["a quiet harbour holds the fishing boats at dawn"] * 12)
SHORT_PROMPT = "the river runs past the old mill"
ROLES = "ingress|prefill|decode"
REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"


def _config() -> AppConfig:
    data = app_config().model_dump(mode="json")
    data["transport"]["timeout_s"] = 1.0  # a frozen prefill replica misses it quickly
    # Batch requests are shed (429) once they waited a microsecond: a shed series.
    data.setdefault("admission", {}).update(
        {"batch_max_queue_wait_s": 1e-6, "batch_shed_ttft_factor": 1e-6}
    )
    return AppConfig.from_dict(data)


@pytest.fixture(scope="module")
def pd() -> Iterator[PD]:
    # Ray's agent exports every 10 s by default; the nodes inherit this when they start.
    with pytest.MonkeyPatch.context() as env:
        env.setenv(REPORT_INTERVAL_ENV, "1000")
        with serve_on_local_cluster(_config(), pool_cpus=1) as pd:
            yield pd


def _complete(client: httpx.Client, model: str, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    return client.post("/v1/completions", json=body, **extra)


def _serve_the_mix(pd: PD) -> str:
    with httpx.Client(base_url=pd.http, timeout=120) as client:
        (model,) = [m["id"] for m in client.get("/v1/models").json()["data"]]
        for prompt in (LONG_PROMPT, LONG_PROMPT, SHORT_PROMPT, SHORT_PROMPT):
            reply = _complete(client, model, prompt)
            assert reply.status_code == 200, reply.text
        shed = _complete(client, model, SHORT_PROMPT, headers={"x-pdserve-priority": "batch"})
        assert shed.status_code == 429, shed.text
        # Freeze the prefill replica: the remote prefill misses its deadline and the decode
        # replica recomputes it locally; the client still gets its tokens.
        actor_name = pd.prefill.actor_name.remote().result(timeout_s=30)
        actor = ray.get_actor(actor_name, namespace="serve")
        pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        try:
            reply = _complete(client, model, FROZEN_PROMPT)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert reply.status_code == 200, reply.text
    return model


@pytest.fixture(scope="module")
def model(pd: PD) -> str:
    return _serve_the_mix(pd)


def _node_targets() -> list[str]:
    return [
        f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]
    ]


@pytest.fixture(scope="module")
def prometheus(pd: PD, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus on 127.0.0.1 scraping every node's metrics agent and the ingress's own
    /metrics every second, with the chart's rules loaded; stopped by pid."""
    assert PROMETHEUS is not None
    work = tmp_path_factory.mktemp("prometheus")
    (rule,) = render({"monitoring": {"prometheusRule": {"enabled": True}}})["PrometheusRule"]
    (work / "rules.yml").write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    ingress = urllib.parse.urlsplit(pd.http).netloc
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(work / "rules.yml")],
        "scrape_configs": [
            {"job_name": "ray-nodes", "static_configs": [{"targets": _node_targets()}]},
            {"job_name": "pdserve-api", "static_configs": [{"targets": [ingress]}]},
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    with (work / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address={address}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://{address}"

        def ready() -> bool:
            assert proc.poll() is None, (work / "prometheus.log").read_text()
            return _ready(url)

        try:
            wait_until(ready, 60, interval=0.2, what="Prometheus to answer /-/ready")
        except TimeoutError as err:
            raise AssertionError((work / "prometheus.log").read_text()) from err
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _api(url: str, path: str, **params: str) -> Any:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


def _dashboard_queries(model: str) -> list[tuple[str, str]]:
    """(panel title, query) with the dashboard's variables as Grafana fills them in: the
    model picked, every role, and a rate interval the scrape interval supports."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = (
                target["expr"]
                .replace("$model_name", model)
                .replace("$role", ROLES)
                .replace("$__rate_interval", "1m")
            )
            assert "$" not in expr, expr
            queries.append((panel["title"], expr))
    return queries


def test_every_dashboard_query_returns_a_series_from_the_real_scrape(
    model: str, prometheus: str
) -> None:
    queries = _dashboard_queries(model)

    def empty() -> list[tuple[str, str]]:
        return [(t, q) for t, q in queries if not _api(prometheus, "query", query=q)["result"]]

    # Ray's agents export every second, Prometheus scrapes every second.
    try:
        wait_until(lambda: not empty(), 60, interval=1.0, what="a series for every query")
    except TimeoutError as err:
        raise AssertionError(f"no series for: {empty()}") from err
    # The dashboard's model variable (label_values(... , model_name)) offers the model.
    values = _api(
        prometheus,
        "label/model_name/values",
        **{"match[]": "ray_pdserve_e2e_request_latency_seconds_count"},
    )
    assert model in values
    # The ingress's own registry is scraped too.
    api = _api(prometheus, "query", query=f'pdserve_api_requests_total{{model_name="{model}"}}')
    assert {r["metric"]["status"] for r in api["result"]} >= {"200", "429"}


def test_the_charts_rules_evaluate_on_the_real_scrape(pd: PD, model: str, prometheus: str) -> None:
    def evaluated_rules() -> list[dict[str, Any]]:
        """Every rule of the chart once each has been evaluated, else []."""
        rules = [r for g in _api(prometheus, "rules")["groups"] for r in g["rules"]]
        done = all(r.get("lastEvaluation", "").startswith("20") for r in rules)
        return rules if done else []

    rules = wait_until(evaluated_rules, 60, interval=1.0, what="every rule evaluated")
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # The TTFT bound's le matcher finds Ray's bucket: once the ingress's TTFT count has
    # been scraped and grows, the miss ratio is a number in [0, 1] (not an empty result).
    count = f'ray_pdserve_time_to_first_token_seconds_count{{role="ingress",model_name="{model}"}}'
    wait_until(
        lambda: _api(prometheus, "query", query=count)["result"],
        60,
        interval=1.0,
        what=f"{count} to be scraped",
    )
    with httpx.Client(base_url=pd.http, timeout=120) as client:
        for _ in range(3):
            assert _complete(client, model, SHORT_PROMPT).status_code == 200
    query = f'pdserve:ttft_slo_miss_ratio:rate5m{{model_name="{model}"}}'

    def ratio_number() -> list[dict[str, Any]]:
        ratio = _api(prometheus, "query", query=query)["result"]
        return ratio if ratio and ratio[0]["value"][1] != "NaN" else []

    ratio = wait_until(ratio_number, 30, interval=1.0, what="a TTFT miss ratio that is a number")
    assert 0 <= float(ratio[0]["value"][1]) <= 1, ratio
