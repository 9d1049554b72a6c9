"""Load generator for OpenAI-compatible endpoints: ``python -m pdserve.bench.serve``.

Sends the same seeded workload (prompts of exact token lengths built with a local
tokenizer, fixed output lengths through ``ignore_eos``) to one or more endpoints in turn,
with Poisson arrivals (``--request-rate``) or a fixed number of clients
(``--concurrency``), bounded by ``--num-requests`` and ``--max-duration-s``. Reports TTFT,
TPOT, ITL (mean, p50/p90/p99), throughput and SLO attainment as a table, a JSON file and a
PNG plot. Example, pdserve disaggregated vs colocated vs vLLM in one run::

    python -m pdserve.bench.serve --tokenizer models/pdserve-small-... \\
        --endpoint disagg=http://127.0.0.1:8000 --endpoint coloc=http://127.0.0.1:8001 \\
        --endpoint vllm=http://127.0.0.1:8002 --request-rate 4 --num-requests 200 \\
        --prompt-len mix:128:2048:0.1 --output-len fixed:128 --slo-ttft-ms 1000 --slo-tpot-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.serve_metrics import RequestRecord, Summary, summarize
from pdserve.bench.serve_report import format_table, write_plot
from pdserve.bench.serve_workload import BenchRequest, LengthDist, build_workload


@dataclass(frozen=True)
class Endpoint:
    name: str
    base_url: str  # scheme://host:port, without /v1

    @classmethod
    def parse(cls, spec: str) -> Endpoint:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"bad --endpoint {spec!r}: use NAME=http://HOST:PORT")
        url = url.rstrip("/").removesuffix("/v1")
        return cls(name, url)


@dataclass(frozen=True)
class RunOptions:
    api: str = "completions"  # or "chat"
    model: str | None = None  # None = ask the endpoint's /v1/models
    concurrency: int | None = None  # fixed-concurrency mode when set
    max_duration_s: float = 300.0
    request_timeout_s: float = 600.0
    ignore_eos: bool = True
    temperature: float = 0.0


def _payload(api: str, model: str, req: BenchRequest, opts: RunOptions) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": opts.temperature,
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if api == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.max_tokens
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.max_tokens
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    text = []
    for choice in obj.get("choices") or []:
        if "text" in choice:
            text.append(choice.get("text") or "")
        else:
            text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    record: RequestRecord,
    timeout_s: float,
) -> RequestRecord:
    """Stream one request, filling ``record`` with what the client observed."""
    start = time.perf_counter()
    last: float | None = None
    text_chunks = 0
    try:
        async with client.stream("POST", url, json=payload, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {body[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    raise RuntimeError(f"stream error: {obj['error'].get('message')}")
                if piece := _chunk_text(obj):
                    record.text += piece
                    now = time.perf_counter()
                    if last is None:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    text_chunks += 1
                if usage := obj.get("usage"):
                    record.output_tokens = int(usage["completion_tokens"])
                    record.prompt_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = int(details.get("cached_tokens") or 0)
                    record.usage_reported = True
        if not record.usage_reported:
            record.output_tokens = text_chunks
        record.e2e = time.perf_counter() - start
        record.ok = record.ttft is not None
        if not record.ok:
            record.error = "no text in the response"
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as err:
        record.error = f"{type(err).__name__}: {err}"
        record.ok = False
    return record


async def detect_model(client: httpx.AsyncClient, endpoint: Endpoint) -> str:
    resp = await client.get(f"{endpoint.base_url}/v1/models", timeout=30.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_endpoint(
    endpoint: Endpoint,
    workload: list[BenchRequest],
    opts: RunOptions,
    warmup: list[BenchRequest] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``warmup`` (unmeasured, one by one), then run the workload against one endpoint;
    returns the workload's records and its duration (first send to last completion)."""
    path = "/v1/chat/completions" if opts.api == "chat" else "/v1/completions"
    url = endpoint.base_url + path
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        model = opts.model or await detect_model(client, endpoint)
        for req in warmup or []:  # not measured: first-request costs
            warm = RequestRecord(index=-1, prompt_tokens=req.prompt_tokens)
            await send_request(client, url, _payload(opts.api, model, req, opts), warm,
                               opts.request_timeout_s)  # fmt: skip

        t0 = time.perf_counter()
        deadline = t0 + opts.max_duration_s

        async def one(req: BenchRequest) -> RequestRecord:
            record = RequestRecord(req.index, req.prompt_tokens,
                                   send_time=time.perf_counter() - t0)  # fmt: skip
            payload = _payload(opts.api, model, req, opts)
            return await send_request(client, url, payload, record, opts.request_timeout_s)

        records: list[RequestRecord] = []
        if opts.concurrency is not None:
            queue = list(reversed(workload))

            async def worker() -> None:
                while queue and time.perf_counter() < deadline:
                    records.append(await one(queue.pop()))

            await asyncio.gather(*(worker() for _ in range(opts.concurrency)))
        else:
            tasks = []
            for req in workload:
                delay = t0 + req.send_at - time.perf_counter()
                if t0 + req.send_at >= deadline:
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req)))
            records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return records, duration


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.serve", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="endpoint to measure (repeat to compare several)",
    )
    p.add_argument("--tokenizer", required=True, help="local tokenizer/model directory")
    p.add_argument("--model", default=None, help="model id to send; default: from /v1/models")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--max-duration-s",
        type=float,
        default=300.0,
        help="stop sending new requests after this long",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals at this many requests/s"
    )
    mode.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="this many clients sending back to back (default 4)",
    )
    p.add_argument(
        "--prompt-len",
        default="fixed:128",
        help="fixed:N | uniform:LO:HI | mix:SHORT:LONG:P (tokens)",
    )
    p.add_argument("--output-len", default="fixed:64", help="same forms as --prompt-len")
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (output lengths then vary)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out-dir",
        default=None,
        help="where summary.json and report.png go; default bench/results/serve-<time>",
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--workload",
        choices=["single", "multiturn"],
        default="single",
        help="single requests, or multi-turn conversations (bench.serve_multiturn)",
    )
    turns = p.add_argument_group("multiturn workload")
    turns.add_argument("--conversations", type=int, default=16)
    turns.add_argument("--turns", default="uniform:2:6", help="turns per conversation")
    turns.add_argument("--system-len", type=int, default=512, help="shared system prompt tokens")
    turns.add_argument("--num-system-prompts", type=int, default=2)
    turns.add_argument(
        "--context-len",
        type=int,
        default=0,
        help="tokens of each conversation's own context opening its first user message",
    )
    turns.add_argument("--user-len", default="uniform:32:128", help="tokens per user message")
    turns.add_argument(
        "--think-time-s",
        type=float,
        default=1.0,
        help="mean pause between a turn's answer and the next turn",
    )
    turns.add_argument(
        "--conversation-rate",
        type=float,
        default=None,
        help="Poisson conversation starts per second (default: all at once)",
    )
    turns.add_argument("--replay", default=None, help="conversations.json of an earlier run")
    turns.add_argument(
        "--dry-run", action="store_true", help="only build and save the conversations"
    )
    turns.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="Prometheus endpoint(s) to read KV transfer bytes from (repeat)",
    )
    p.add_argument("--save-requests", action="store_true",
                   help="also write every request's record into the JSON")  # fmt: skip
    args = p.parse_args(argv)
    for flag in ("num_requests", "warmup"):
        if getattr(args, flag) < (1 if flag == "num_requests" else 0):
            p.error(f"--{flag.replace('_', '-')} is out of range")
    if args.request_rate is not None and args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if args.request_rate is None and args.concurrency is None:
        args.concurrency = 4
    try:
        args.endpoints = [Endpoint.parse(e) for e in args.endpoint]
        args.prompt_dist = LengthDist.parse(args.prompt_len)
        args.output_dist = LengthDist.parse(args.output_len)
    except ValueError as err:
        p.error(str(err))
    if len({e.name for e in args.endpoints}) != len(args.endpoints):
        p.error("--endpoint names must be unique")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by parsed ``args``; returns the JSON report."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    workload = build_workload(
        tokenizer,
        num_requests=args.num_requests + args.warmup,
        prompt_len=args.prompt_dist,
        output_len=args.output_dist,
        rate=args.request_rate,
        seed=args.seed,
    )
    # The warm-up requests come first; the measured ones are re-based to index 0, time 0.
    warm, measured = workload[: args.warmup], workload[args.warmup :]
    shift = measured[0].send_at
    measured = [
        BenchRequest(r.index - args.warmup, r.prompt, r.prompt_tokens, r.max_tokens,
                     r.send_at - shift)
        for r in measured
    ]  # fmt: skip
    opts = RunOptions(
        api=args.api,
        model=args.model,
        concurrency=args.concurrency,
        max_duration_s=args.max_duration_s,
        request_timeout_s=args.request_timeout_s,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
    )
    slo_ttft = None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000
    slo_tpot = None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000
    results: dict[str, list[RequestRecord]] = {}
    summaries: list[Summary] = []
    for endpoint in args.endpoints:
        records, duration = asyncio.run(run_endpoint(endpoint, measured, opts, warmup=warm))
        results[endpoint.name] = records
        summaries.append(
            summarize(endpoint.name, records, duration, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot)
        )
    report: dict[str, Any] = {
        "config": {
            "api": args.api,
            "num_requests": args.num_requests,
            "request_rate": args.request_rate,
            "concurrency": args.concurrency,
            "prompt_len": str(args.prompt_dist),
            "output_len": str(args.output_dist),
            "ignore_eos": not args.no_ignore_eos,
            "temperature": args.temperature,
            "seed": args.seed,
            "endpoints": {e.name: e.base_url for e in args.endpoints},
        },
        "summaries": [s.to_json() for s in summaries],
    }
    if args.save_requests:
        report["requests"] = {
            name: [asdict(r) | {"tpot": r.tpot} for r in records]
            for name, records in results.items()
        }
    print(format_table(summaries))
    out_dir = Path(args.out_dir or f"bench/results/serve-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out_dir / 'summary.json'}")
    if not args.no_plot:
        write_plot(out_dir / "report.png", results, summaries)
        print(f"wrote {out_dir / 'report.png'}")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workload == "multiturn":
        from pdserve.bench.serve_multiturn import run_multiturn

        report = run_multiturn(args)
    else:
        report = run(args)
    return 0 if all(s["completed"] > 0 for s in report["summaries"]) else 1


if __name__ == "__main__":
    sys.exit(main())
