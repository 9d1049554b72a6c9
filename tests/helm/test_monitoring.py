"""Monitoring shipped with the chart: the Grafana dashboard, the PrometheusRule alerts and the
PodMonitors, and the Ray dashboard's Grafana/Prometheus wiring on the head. Every query must
name a metric pdserve exports (deployments/metrics.py, as Ray's metrics agent renames it)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")

from pdserve.deployments import metrics  # noqa: E402
from tests.helm.rendering import CHART, VALUE_SETS, pod_specs, render  # noqa: E402

DASHBOARD = CHART / "dashboards" / "pdserve.json"
MONITORING = {
    "monitoring": {
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "dashboard": {"enabled": True},
    }
}
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"}


def exported_families() -> set[str]:
    """Every Prometheus series name pdserve's metrics appear under on a Ray node."""
    probe = metrics.ServingMetrics(model_name="m", role="decode", replica="r", enabled=False)
    names: set[str] = set()
    for name, kind in probe.kinds.items():
        family = metrics.exported_name(name, kind)
        if kind == "histogram":
            names |= {f"{family}_bucket", f"{family}_sum", f"{family}_count"}
        else:
            names.add(family)
    return names


SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
RAY_NAME = re.compile(r"\bray_[a-z0-9_]+\b")


def unknown_metrics(expr: str, known: set[str]) -> list[str]:
    """Metric names in a PromQL expression that pdserve does not export, and pdserve
    selectors without a role matcher (the dashboards and alerts filter by pool)."""
    problems = [name for name in RAY_NAME.findall(expr) if name not in known]
    for name, matchers in SELECTOR.findall(expr):
        if name in ("by", "without", "on", "ignoring", "group_left", "group_right"):
            continue
        if not name.startswith("ray_pdserve_"):
            problems.append(name)
        elif "role" not in matchers:
            problems.append(f"{name} (no role matcher)")
    return problems


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_name_check_catches_a_metric_that_is_not_exported() -> None:
    known = exported_families()
    assert "ray_pdserve_time_to_first_token_seconds_bucket" in known
    assert "ray_pdserve_prefill_fallbacks_total" in known
    assert unknown_metrics('rate(ray_pdserve_ttft_bucket{role="decode"}[5m])', known)
    assert unknown_metrics('rate(ray_vllm_num_requests_running{role="decode"}[5m])', known)
    assert unknown_metrics("sum(ray_pdserve_kv_cache_usage_perc{model_name='x'})", known)
    assert not unknown_metrics('sum(ray_pdserve_kv_cache_usage_perc{role="decode"})', known)


def test_dashboard_is_grafana_json_on_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "pdserve"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert set(variables["role"]["query"].split(",")) == {"ingress", "prefill", "decode"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    known = exported_families()
    for panel in dashboard["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["title"]
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys() and grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert unknown_metrics(target["expr"], known) == [], panel["title"]
            assert 'role=~"$role"' in target["expr"], panel["title"]
    # What an operator of a disaggregated cluster looks at, each on some panel.
    queries = "\n".join(dashboard_queries(dashboard))
    for family in (
        "time_to_first_token_seconds",
        "request_time_per_output_token_seconds",
        "inter_token_latency_seconds",
        "num_requests_running",
        "kv_cache_usage_perc",
        "kv_transfer_bytes_total",
        "kv_transfer_seconds_bucket",
        "disagg_decisions_total",
        "prefill_fallbacks_total",
        "requests_shed_total",
    ):
        assert f"ray_pdserve_{family}" in queries, family


def test_dashboard_ships_in_a_configmap_only_when_enabled() -> None:
    (config_map,) = render(MONITORING)["ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["pdserve.json"]) == json.loads(DASHBOARD.read_text())
    assert "ConfigMap" not in render()


def test_alerts_query_exported_metrics_with_the_charts_slo_and_bounds() -> None:
    values = {**MONITORING, "pools": {"decode": {"maxReplicas": 12}}}
    (rule,) = render(values)["PrometheusRule"]
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    known = exported_families()
    recorded = {r["record"] for r in rules if "record" in r}
    for r in rules:
        expr = r["expr"]
        for name in recorded:  # recording rules are defined here, not exported
            expr = expr.replace(name, "")
        assert unknown_metrics(expr, known) == [], r.get("alert") or r.get("record")
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert {
        "PdserveTTFTSLOBurnFast",
        "PdserveTTFTSLOBurnSlow",
        "PdservePrefillFallbacksRising",
        "PdservePoolAtMaxReplicas",
        "PdserveRequestsShed",
    } <= alerts
    # The burn counts requests over the SLO (app.slo.ttft_ms = 500) at a histogram bound.
    assert 0.5 in metrics.LATENCY_BUCKETS_S
    (five_min,) = [r for r in rules if r.get("record") == "pdserve:ttft_slo_miss_ratio:rate5m"]
    assert 'le=~"0.5(\\\\.0)?"' in five_min["expr"]
    assert re.fullmatch(r"0.5(\.0)?", "0.5") and re.fullmatch(r"0.5(\.0)?", "0.50") is None
    at_max = {
        r["labels"]["pool"]: r["expr"]
        for r in rules
        if r.get("alert") == "PdservePoolAtMaxReplicas"
    }
    assert at_max["decode"].strip().endswith(">= 12") and at_max["prefill"].strip().endswith(">= 4")
    # The chart's copy of the TTFT buckets is the metrics module's.
    template = (CHART / "templates" / "prometheusrule.yaml").read_text()
    (listed,) = re.findall(r"\$buckets := list ([0-9. ]+)", template)
    assert [float(x) for x in listed.split()] == metrics.LATENCY_BUCKETS_S


def test_ttft_bound_is_the_largest_bucket_within_the_slo() -> None:
    values = {**MONITORING, "app": {"slo": {"ttft_ms": 300}}}
    (rule,) = render(values)["PrometheusRule"]
    (five_min,) = [
        r
        for group in rule["spec"]["groups"]
        for r in group["rules"]
        if r.get("record") == "pdserve:ttft_slo_miss_ratio:rate5m"
    ]
    assert 'le=~"0.25(\\\\.0)?"' in five_min["expr"]


def test_pod_monitors_scrape_head_and_workers() -> None:
    manifests = render(VALUE_SETS["hub-id-with-token-secret"])
    monitors = {m["metadata"]["name"]: m for m in manifests["PodMonitor"]}
    assert set(monitors) == {"demo-pdserve-head", "demo-pdserve-worker"}
    svc = manifests["RayService"][0]
    pods = pod_specs(svc)
    head_ports = {p["name"] for p in pods["head"]["containers"][0]["ports"]}
    worker_ports = {p["name"] for p in pods["decode"]["containers"][0]["ports"]}
    for name, monitor in monitors.items():
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        selector = monitor["spec"]["selector"]["matchLabels"]
        node_type = "head" if name.endswith("head") else "worker"
        assert selector["ray.io/node-type"] == node_type
        template_labels = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"][
            "labels"
        ]
        assert {k: v for k, v in selector.items() if k != "ray.io/node-type"}.items() <= (
            template_labels.items()
        )
        ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
        assert ports <= (head_ports if node_type == "head" else worker_ports)
        assert "metrics" in ports
    assert "PodMonitor" not in render()


def test_ray_dashboard_is_wired_to_grafana_and_prometheus() -> None:
    svc = render(VALUE_SETS["hub-id-with-token-secret"])["RayService"][0]
    env = {e["name"]: e.get("value") for e in pod_specs(svc)["head"]["containers"][0]["env"]}
    assert env["RAY_GRAFANA_HOST"] == "http://prometheus-grafana.prometheus-system.svc:80"
    assert env["RAY_PROMETHEUS_HOST"].endswith(":9090")
    plain = pod_specs(render()["RayService"][0])["head"]["containers"][0]["env"]
    assert "RAY_GRAFANA_HOST" not in {e["name"] for e in plain}
