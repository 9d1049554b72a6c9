"""Reading what a running cluster exported, for tests: Prometheus samples from the nodes'
metrics endpoints and the spans the console exporter wrote into the replicas' log files."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.samples import Sample

from pdserve.cluster.metrics_scrape import node_metric_families

SPAN_START = '{\n    "name": '


def node_samples(host: str, ports: list[int]) -> list[Sample]:
    """Every sample on every node's ``/metrics`` (an endpoint that does not answer yet is
    skipped: the caller polls)."""
    return [s for family in node_metric_families(host, ports, 5.0) for s in family.samples]


@dataclass(frozen=True)
class ExportedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    attributes: dict[str, Any]
    source: str  # the log file (one per worker process) the span was printed to


def _spans_in(path: Path) -> list[ExportedSpan]:
    """Spans printed by OpenTelemetry's ``ConsoleSpanExporter`` (indented JSON objects)."""
    text = path.read_text(errors="replace")
    decoder = json.JSONDecoder()
    spans = []
    at = text.find(SPAN_START)
    while at >= 0:
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:  # a span still being written
            end = at + len(SPAN_START)
        else:
            spans.append(
                ExportedSpan(
                    name=obj["name"],
                    trace_id=obj["context"]["trace_id"],
                    span_id=obj["context"]["span_id"],
                    parent_id=obj.get("parent_id"),
                    attributes=obj.get("attributes") or {},
                    source=str(path),
                )
            )
        at = text.find(SPAN_START, end)
    return spans


def spans_by_trace(root: Path) -> dict[str, list[ExportedSpan]]:
    """All console-exported spans under ``root`` (the cluster's temp dirs), by trace id."""
    traces: dict[str, list[ExportedSpan]] = defaultdict(list)
    for path in sorted(root.rglob("worker-*.out")):
        for span in _spans_in(path):
            traces[span.trace_id].append(span)
    return dict(traces)
