"""Multi-turn workload of ``pdserve.bench.serve --workload multiturn``: chat conversations that
repeat a shared system prompt and their whole history every turn, with think time between
turns, as chat and agent traffic does.

Conversations are built from a seed (``build_conversations``: each takes one of a few shared
system prompts, a number of turns, user messages of exact token lengths, output lengths and
think times), can be saved as JSON and replayed (``save_conversations``,
``load_conversations``), and run against an endpoint (``run_conversations``): every
conversation starts at its own time and sends turn after turn, each prompt being the
previous prompt plus the answer streamed back plus the next user message, through the
completions API (the prompt's text grows by appending, so its tokens keep their prefix).
``summarize_turns`` reports TTFT by turn, turns >= 2 over turn 1, and the prefix hit rate
from the responses' ``usage.prompt_tokens_details.cached_tokens``; with ``metrics_urls``
the KV bytes moved between replicas come from the Prometheus counters before and after.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve.bench.serve import Endpoint, RunOptions, _payload, detect_model, send_request
from pdserve.bench.serve_metrics import RequestRecord
from pdserve.bench.serve_workload import BenchRequest, LengthDist, PromptBuilder

KV_BYTES_METRIC = "ray_pdserve_kv_transfer_bytes_total"


@dataclass(frozen=True)
class Turn:
    user: str  # the user message's text
    user_tokens: int
    max_tokens: int
    think_s: float  # the user's pause before sending this turn (after the previous answer)


@dataclass(frozen=True)
class Conversation:
    index: int
    system_id: int  # which shared system prompt it opens with
    system: str
    start_at: float  # seconds after the run starts
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class MultiTurnSpec:
    """How ``build_conversations`` draws conversations."""

    num_conversations: int
    turns: LengthDist
    system_len: int
    num_system_prompts: int
    user_len: LengthDist
    output_len: LengthDist
    think_time_s: float  # mean of an exponential pause between turns; 0 = none
    conversation_rate: float | None  # Poisson starts per second; None = all at once
    seed: int
    # Tokens of a context of the conversation's own (a document, an agent's tool output)
    # that opens its first user message: what makes history, not the new message, the bulk
    # of a follow-up turn's prompt, as in vLLM's multi-turn benchmark's per-conversation
    # prefix. 0 = none.
    context_len: int = 0

    def check(self) -> None:
        if self.num_conversations < 1:
            raise ValueError(f"num_conversations must be >= 1, got {self.num_conversations}")
        if self.system_len < 1 or self.num_system_prompts < 1:
            raise ValueError(
                f"system_len ({self.system_len}) and num_system_prompts "
                f"({self.num_system_prompts}) must be >= 1"
            )
        if self.context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {self.context_len}")
        if self.think_time_s < 0:
            raise ValueError(f"think_time_s must be >= 0, got {self.think_time_s}")
        if self.conversation_rate is not None and self.conversation_rate <= 0:
            raise ValueError(f"conversation_rate must be > 0, got {self.conversation_rate}")


def build_conversations(tokenizer: Any, spec: MultiTurnSpec) -> list[Conversation]:
    spec.check()
    rng = random.Random(spec.seed)
    builder = PromptBuilder(tokenizer, rng)
    systems = [builder.build(spec.system_len)[0] for _ in range(spec.num_system_prompts)]
    conversations, t = [], 0.0
    for i in range(spec.num_conversations):
        if spec.conversation_rate is not None and i > 0:
            t += rng.expovariate(spec.conversation_rate)
        turns = []
        for k in range(spec.turns.sample(rng)):
            text, n = builder.build(spec.user_len.sample(rng))
            if k == 0 and spec.context_len:
                context, m = builder.build(spec.context_len)
                text, n = context.lstrip() + " " + text.lstrip(), m + n
            think = rng.expovariate(1 / spec.think_time_s) if spec.think_time_s and k else 0.0
            turns.append(Turn(" " + text.lstrip(), n, spec.output_len.sample(rng), think))
        system_id = rng.randrange(spec.num_system_prompts)
        conversations.append(Conversation(i, system_id, systems[system_id], t, tuple(turns)))
    return conversations


def save_conversations(path: Path, conversations: list[Conversation]) -> None:
    path.write_text(json.dumps([asdict(c) for c in conversations], indent=1) + "\n")


def load_conversations(path: Path) -> list[Conversation]:
    """Conversations saved by ``save_conversations`` (ValueError on a malformed file)."""
    try:
        raw = json.loads(path.read_text())
        return [
            Conversation(
                int(c["index"]),
                int(c["system_id"]),
                str(c["system"]),
                float(c["start_at"]),
                tuple(
                    Turn(
                        str(t["user"]),
                        int(t["user_tokens"]),
                        int(t["max_tokens"]),
                        float(t["think_s"]),
                    )
                    for t in c["turns"]
                ),
            )  # fmt: skip
            for c in raw
        ]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a saved conversation list ({err})") from None


@dataclass
class TurnRecord:
    conversation: int
    turn: int  # 1-based
    record: RequestRecord


async def run_conversations(
    endpoint: Endpoint, conversations: list[Conversation], opts: RunOptions, warmup: int = 0
) -> tuple[list[TurnRecord], float]:
    """Run every conversation (each from its ``start_at``; turns in order, after the
    previous answer and the turn's think time); returns the turns' records and the run's
    duration. ``warmup`` single requests go first, unmeasured (a conversation's first user
    message alone). A failed turn ends its conversation."""
    url = endpoint.base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    records: list[TurnRecord] = []
    async with httpx.AsyncClient(limits=limits) as client:
        model = opts.model or await detect_model(client, endpoint)
        for conv in conversations[:warmup]:  # unmeasured first-request costs, no system prompt
            req = BenchRequest(-1, conv.turns[0].user, 0, conv.turns[0].max_tokens, 0.0)
            await send_request(client, url, _payload("completions", model, req, opts),
                               RequestRecord(-1, 0), opts.request_timeout_s)  # fmt: skip
        t0 = time.perf_counter()

        async def converse(conv: Conversation) -> None:
            await asyncio.sleep(max(0.0, t0 + conv.start_at - time.perf_counter()))
            history = conv.system
            for k, turn in enumerate(conv.turns, start=1):
                if turn.think_s:
                    await asyncio.sleep(turn.think_s)  # the user reads and types
                prompt = history + turn.user
                req = BenchRequest(conv.index, prompt, 0, turn.max_tokens, 0.0)
                record = RequestRecord(conv.index, 0, send_time=time.perf_counter() - t0)
                await send_request(
                    client, url, _payload("completions", model, req, opts), record,
                    opts.request_timeout_s,
                )  # fmt: skip
                records.append(TurnRecord(conv.index, k, record))
                if not record.ok:
                    return
                history = prompt + record.text

        await asyncio.gather(*(converse(c) for c in conversations))
        duration = time.perf_counter() - t0
    records.sort(key=lambda r: (r.conversation, r.turn))
    return records, duration


def scrape_counter(urls: list[str], name: str = KV_BYTES_METRIC) -> float:
    """Sum of every sample of counter ``name`` over the Prometheus endpoints ``urls``."""
    total = 0.0
    for url in urls:
        text = httpx.get(url, timeout=10.0).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "count": 0}
    p50, p99 = (float(v) for v in np.percentile(np.asarray(values), [50, 99]))
    return {"p50": p50, "p99": p99, "count": len(values)}


def summarize_turns(
    name: str, records: list[TurnRecord], duration_s: float, kv_bytes: float | None
) -> dict[str, Any]:
    """TTFT by turn, turns >= 2 against turn 1, prefix hit rates, KV bytes per request."""
    done = [r for r in records if r.record.ok]
    by_turn: dict[int, list[float]] = {}
    for r in done:
        assert r.record.ttft is not None
        by_turn.setdefault(r.turn, []).append(r.record.ttft)
    first = _pcts(by_turn.get(1, []))
    later = _pcts([t for k, ts in by_turn.items() if k >= 2 for t in ts])
    # The prompt tokens some replica had to compute: what a turn's TTFT can shrink with.
    computed = [(r.turn, r.record.prompt_tokens - r.record.cached_tokens) for r in done]

    def hit_rate(rs: list[TurnRecord]) -> float | None:
        prompt = sum(r.record.prompt_tokens for r in rs)
        return sum(r.record.cached_tokens for r in rs) / prompt if prompt else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "endpoint": name,
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "ttft_by_turn": {k: _pcts(v) for k, v in sorted(by_turn.items())},
        "ttft_turn1": first,
        "ttft_later_turns": later,
        "ttft_p50_later_over_turn1": ratio(later["p50"], first["p50"]),
        "ttft_p99_later_over_turn1": ratio(later["p99"], first["p99"]),
        "computed_tokens_turn1": _pcts([float(n) for k, n in computed if k == 1]),
        "computed_tokens_later_turns": _pcts([float(n) for k, n in computed if k >= 2]),
        "hit_rate": hit_rate(done),
        "hit_rate_later_turns": hit_rate([r for r in done if r.turn >= 2]),
        "kv_bytes_per_request": kv_bytes / len(done) if kv_bytes is not None and done else None,
        # Why turns failed (each failure ends its conversation): error text -> count.
        "errors": dict(Counter(str(r.record.error)[:200] for r in records if not r.record.ok)),
    }


def format_turn_table(summaries: list[dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    rows = [
        ("completed / failed", [f"{s['completed']} / {s['failed']}" for s in summaries]),
        ("TTFT turn 1 p50 (ms)", [ms(s["ttft_turn1"]["p50"]) for s in summaries]),
        ("TTFT turn 1 p99 (ms)", [ms(s["ttft_turn1"]["p99"]) for s in summaries]),
        ("TTFT turns>=2 p50 (ms)", [ms(s["ttft_later_turns"]["p50"]) for s in summaries]),
        ("TTFT turns>=2 p99 (ms)", [ms(s["ttft_later_turns"]["p99"]) for s in summaries]),
        ("p50 turns>=2 / turn 1", [num(s["ttft_p50_later_over_turn1"], ".2f") for s in summaries]),
        ("p99 turns>=2 / turn 1", [num(s["ttft_p99_later_over_turn1"], ".2f") for s in summaries]),
        (
            "computed prompt tokens turn 1 p50",
            [num(s["computed_tokens_turn1"]["p50"], ".0f") for s in summaries],
        ),
        (
            "computed prompt tokens turns>=2 p50",
            [num(s["computed_tokens_later_turns"]["p50"], ".0f") for s in summaries],
        ),
        ("prefix hit rate", [num(s["hit_rate"], ".1%") for s in summaries]),
        ("hit rate turns>=2", [num(s["hit_rate_later_turns"], ".1%") for s in summaries]),
        ("KV bytes / request", [num(s["kv_bytes_per_request"], ",.0f") for s in summaries]),
    ]
    width = max(len(r[0]) for r in rows)
    cols = [max(len(s["endpoint"]), 10) for s in summaries]
    names = [s["endpoint"] for s in summaries]
    head = " " * width + "  " + "  ".join(n.rjust(c) for n, c in zip(names, cols, strict=True))
    body = [
        label.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(vals, cols, strict=True))
        for label, vals in rows
    ]
    return "\n".join([head, *body])


def run_multiturn(args: Any) -> dict[str, Any]:
    """``bench.serve --workload multiturn``: build (or replay) the conversations, run them
    against every endpoint in turn, print the table, write the JSON report."""
    if args.replay:
        conversations = load_conversations(Path(args.replay))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        spec = MultiTurnSpec(
            num_conversations=args.conversations, turns=LengthDist.parse(args.turns),
            system_len=args.system_len, num_system_prompts=args.num_system_prompts,
            user_len=LengthDist.parse(args.user_len), output_len=args.output_dist,
            think_time_s=args.think_time_s, conversation_rate=args.conversation_rate,
            seed=args.seed, context_len=args.context_len,
        )  # fmt: skip
        conversations = build_conversations(tokenizer, spec)
    out_dir = Path(args.out_dir or f"bench/results/multiturn-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_conversations(out_dir / "conversations.json", conversations)
    if args.dry_run:
        print(f"wrote {out_dir / 'conversations.json'} ({len(conversations)} conversations)")
        return {"config": {"conversations": len(conversations)}, "summaries": []}
    opts = RunOptions(
        model=args.model, request_timeout_s=args.request_timeout_s,
        ignore_eos=not args.no_ignore_eos, temperature=args.temperature,
    )  # fmt: skip
    summaries = []
    for endpoint in args.endpoints:
        before = scrape_counter(args.metrics_url) if args.metrics_url else None
        records, duration = asyncio.run(
            run_conversations(endpoint, conversations, opts, warmup=args.warmup)
        )
        moved = scrape_counter(args.metrics_url) - before if before is not None else None
        summaries.append(summarize_turns(endpoint.name, records, duration, moved))
    report = {"config": {"conversations": len(conversations), "seed": args.seed},
              "summaries": summaries}  # fmt: skip
    print(format_turn_table(summaries))
    (out_dir / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out_dir / 'summary.json'} and {out_dir / 'conversations.json'}")
    return report
