"""The chart's PrometheusRule through Prometheus's own tool: ``promtool check rules`` accepts
the rendered groups, and ``promtool test rules`` evaluates every alert and recording rule on
synthetic series, some that must fire and some that must not (promtool fails a test when
an alert fires that the test does not list, or a listed one does not)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)"
)

from tests.helm.rendering import render  # noqa: E402

VALUES = {
    "monitoring": {"prometheusRule": {"enabled": True}},
    "app": {"slo": {"ttft_ms": 500}},
    "pools": {"prefill": {"maxReplicas": 4}, "decode": {"maxReplicas": 8}},
}
TTFT = "ray_pdserve_time_to_first_token_seconds"


def _rules() -> list[dict[str, Any]]:
    (rule,) = render(VALUES)["PrometheusRule"]
    return rule["spec"]["groups"]


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def _expected(groups: list[dict[str, Any]], alert: str, labels: dict[str, str]) -> dict:
    """The alert as Prometheus would send it: the rule's labels plus ``labels`` and its
    annotations with ``{{ $labels.x }}`` filled in."""
    (rule,) = [
        r
        for g in groups
        for r in g["rules"]
        if r.get("alert") == alert
        and labels.get("pool", r["labels"].get("pool")) == r["labels"].get("pool")
    ]
    exp_labels = {**rule["labels"], **labels}

    def fill(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: exp_labels[m.group(1)], text)

    annotations = {k: fill(v) for k, v in rule["annotations"].items()}
    return {"exp_labels": exp_labels, "exp_annotations": annotations}


def _ttft_series() -> list[dict[str, str]]:
    """Three models over two hours: 50% of first tokens past the 0.5 s bound ("slow"),
    12.5% ("warm": only the six-hour burn), none ("fast")."""
    series = []
    for model, within in (("slow", 4), ("warm", 7), ("fast", 8)):
        for le, per_min in (("0.5", within), ("+Inf", 8)):
            labels = {"model_name": model, "role": "ingress", "replica": "r1", "le": le}
            series.append(_series(f"{TTFT}_bucket", labels, f"0+{per_min}x120"))
        count = {"model_name": model, "role": "ingress", "replica": "r1"}
        series.append(_series(f"{TTFT}_count", count, "0+8x120"))
        # Decode-side TTFT must not count: only the ingress sees the client's wait.
        decode = {**count, "role": "decode"}
        series.append(_series(f"{TTFT}_count", decode, "0+800x120"))
    return series


def _disagg_series() -> list[dict[str, str]]:
    """Model "bad": 10% of remote prefills fall back, transfers fail, requests are shed;
    model "ok": 1% fall back, nothing fails or is shed."""
    series = []
    for model, fallbacks, failures, shed in (("bad", 10, 2, 3), ("ok", 1, 0, 0)):
        base = {"model_name": model, "role": "decode", "replica": "d1"}
        remote = {**base, "decision": "remote"}
        series.append(_series("ray_pdserve_disagg_decisions_total", remote, "0+100x60"))
        series.append(_series("ray_pdserve_prefill_fallbacks_total", base, f"0+{fallbacks}x60"))
        series.append(_series("ray_pdserve_kv_transfer_failures_total", base, f"0+{failures}x60"))
        shed_labels = {**base, "role": "ingress", "reason": "ttft_slo", "priority": "batch"}
        series.append(_series("ray_pdserve_requests_shed_total", shed_labels, f"0+{shed}x60"))
    return series


def _capacity_series() -> list[dict[str, str]]:
    """Eight decode replicas (the pool's maximum) and three prefill replicas (of four)."""
    series = []
    for role, replicas in (("decode", 8), ("prefill", 3)):
        for i in range(replicas):
            labels = {"model_name": "m", "role": role, "replica": f"{role}-{i}"}
            series.append(_series("ray_pdserve_num_requests_running", labels, "1x40"))
    return series


def _unit_tests(groups: list[dict[str, Any]]) -> dict[str, Any]:
    def alert(name: str, at: str, firing: list[dict[str, str]]) -> dict[str, Any]:
        return {
            "eval_time": at,
            "alertname": name,
            "exp_alerts": [_expected(groups, name, labels) for labels in firing],
        }

    ratio = "round(pdserve:ttft_slo_miss_ratio:rate5m, 0.001)"
    return {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": _ttft_series(),
                "promql_expr_test": [
                    {
                        "expr": ratio,
                        "eval_time": "30m",
                        "exp_samples": [
                            {"labels": f'{{model_name="{m}"}}', "value": v}
                            for m, v in (("fast", 0), ("slow", 0.5), ("warm", 0.125))
                        ],
                    }
                ],
                "alert_rule_test": [
                    alert("PdserveTTFTSLOBurnFast", "1m", []),  # not yet: for 2m
                    alert("PdserveTTFTSLOBurnFast", "30m", [{"model_name": "slow"}]),
                    alert("PdserveTTFTSLOBurnSlow", "10m", []),  # not yet: for 15m
                    alert(
                        "PdserveTTFTSLOBurnSlow",
                        "90m",
                        [{"model_name": "slow"}, {"model_name": "warm"}],
                    ),
                ],
            },
            {
                "interval": "1m",
                "input_series": _disagg_series(),
                "alert_rule_test": [
                    alert("PdservePrefillFallbacksRising", "5m", []),  # not yet: for 10m
                    alert("PdservePrefillFallbacksRising", "30m", [{"model_name": "bad"}]),
                    alert(
                        "PdserveKVTransferFailures",
                        "30m",
                        [{"model_name": "bad", "role": "decode"}],
                    ),
                    alert("PdserveRequestsShed", "30m", [{"model_name": "bad"}]),
                ],
            },
            {
                "interval": "1m",
                "input_series": _capacity_series(),
                "alert_rule_test": [
                    alert("PdservePoolAtMaxReplicas", "10m", []),  # not yet: for 15m
                    alert(
                        "PdservePoolAtMaxReplicas",
                        "30m",
                        [{"model_name": "m", "pool": "decode"}],
                    ),
                ],
            },
        ],
    }


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_and_unit_tests_the_charts_alert_rules(tmp_path: Path) -> None:
    groups = _rules()
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    checked = _promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    tests = _unit_tests(groups)
    tested = {t["alertname"] for case in tests["tests"] for t in case.get("alert_rule_test", [])}
    assert tested == alerts  # every alert the chart ships has a case that fires
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = _promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_fails_when_an_alert_is_expected_but_silent(tmp_path: Path) -> None:
    """The harness above can fail: claiming that the healthy model burns its budget is
    refuted by promtool."""
    groups = _rules()
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    tests = _unit_tests(groups)
    fast = tests["tests"][0]["alert_rule_test"][1]
    fast["exp_alerts"].append(_expected(groups, "PdserveTTFTSLOBurnFast", {"model_name": "fast"}))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = _promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "PdserveTTFTSLOBurnFast" in result.stdout + result.stderr
