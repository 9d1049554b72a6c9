"""Property-based fuzzing of the OpenAPI document a pdserve ingress publishes.

Schemathesis generates requests from ``/openapi.json`` (valid and invalid bodies, for every
operation); each is sent with httpx and must get a non-5xx answer, and every error must
carry the OpenAI error body. Used by test_openapi_fuzz.py (bounded) and, as a script, for
long runs against a real ``pdserve serve``:

    python -P tests/deployments/openapi_fuzz.py http://127.0.0.2:PORT --requests 10000

Generation lengths are clamped (``MAX_FUZZ_TOKENS``, also when unset) so a fuzzed request
cannot ask for minutes of decoding; everything else is sent as generated. A request not
answered within the timeout counts as status 0 and a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

MAX_FUZZ_TOKENS = 8
_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of")


@dataclass
class FuzzReport:
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.statuses.values())


def _clamp(body: Any) -> Any:
    if isinstance(body, dict):
        # An unset (or null) limit means "up to the context length": thousands of tokens.
        if ("prompt" in body or "messages" in body) and all(
            body.get(k) is None for k in ("max_tokens", "max_completion_tokens")
        ):
            body["max_tokens"] = MAX_FUZZ_TOKENS
        for name in _LENGTH_FIELDS:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_FUZZ_TOKENS:
                body[name] = MAX_FUZZ_TOKENS
    return body


def _check(report: FuzzReport, method: str, path: str, response: httpx.Response, sent: Any) -> None:
    report.statuses[response.status_code] += 1
    what = f"{method} {path} {json.dumps(sent, default=repr)[:300]}"
    if response.status_code >= 500 and response.status_code != 503:
        report.failures.append(f"{response.status_code} for {what}: {response.text[:300]}")
    elif response.status_code >= 400 and response.status_code != 404:
        try:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and "type" in error
        except Exception:  # noqa: BLE001 (any shape problem is the finding)
            report.failures.append(f"{response.status_code} without the OpenAI body: {what}")


def fuzz(
    base_url: str,
    *,
    headers: dict[str, str] | None = None,
    requests: int = 200,
    time_budget_s: float = 60.0,
    timeout_s: float = 60.0,
) -> FuzzReport:
    """Send about ``requests`` generated requests (split over the operations, positive and
    negative modes), stopping early at ``time_budget_s``."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    report = FuzzReport()
    deadline = time.monotonic() + time_budget_s
    per_run = max(1, requests // (2 * len(operations)))
    with httpx.Client(base_url=base_url, headers=headers or {}, timeout=timeout_s) as client:
        # Passes until enough requests went out: operations without parameters exhaust
        # their few distinct inputs quickly, the others get fresh examples each pass.
        while report.total < requests and time.monotonic() < deadline:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                for op in operations:
                    _run(op, mode, per_run, client, report, deadline, requests)
    return report


def _run(
    op: Any,
    mode: GenerationMode,
    examples: int,
    client: httpx.Client,
    report: FuzzReport,
    deadline: float,
    limit: int,
) -> None:
    """Up to ``examples`` generated requests for one operation in one mode."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,  # no "reproduce with @seed" lines around the JSON summary
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def send(case: Any) -> None:
        if time.monotonic() > deadline or report.total >= limit:
            return
        body = _clamp(case.body) if case.body is not None else None
        kwargs: dict[str, Any] = {"params": case.query or None}
        if body is not None:
            raw = json.dumps(body, default=str).encode("utf-8", "surrogatepass")
            kwargs["content"] = raw
            kwargs["headers"] = {"content-type": case.media_type or "application/json"}
        path = case.formatted_path
        try:
            response = client.request(case.method, path, **kwargs)
        except httpx.TimeoutException:
            report.statuses[0] += 1  # 0 = no answer in time
            report.failures.append(f"timeout: {case.method} {path} {str(body)[:300]}")
            return
        _check(report, case.method, path, response, body)

    with contextlib.suppress(Unsatisfiable):  # an operation with no invalid inputs
        send()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--time-budget", type=float, default=3600.0)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    start = time.monotonic()
    report = fuzz(args.url, headers=headers, requests=args.requests, time_budget_s=args.time_budget)
    summary = {
        "requests": report.total,
        "seconds": round(time.monotonic() - start, 1),
        "statuses": dict(sorted(report.statuses.items())),
        "server_errors": sum(n for s, n in report.statuses.items() if s >= 500),
        "failures": report.failures[:20],
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
