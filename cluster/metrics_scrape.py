"""Reading the Prometheus text that every node of a running cluster exports.

Used by ``pdserve status`` and by the benches and tests that watch a cluster from the
outside. Reads only; an endpoint that does not answer is skipped (a node may still be
starting), so callers that need a value poll.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # prometheus_client is imported when a scrape runs
    from prometheus_client import Metric


def node_metric_families(host: str, ports: Iterable[int], timeout_s: float) -> list[Metric]:
    """Every metric family on ``http://host:port/metrics`` for each port, in port order."""
    from prometheus_client.parser import text_string_to_metric_families

    families: list[Metric] = []
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError):
            continue
        families.extend(text_string_to_metric_families(text))
    return families
