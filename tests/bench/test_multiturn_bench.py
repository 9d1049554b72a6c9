"""``bench.serve --workload multiturn`` against the scripted OpenAI server: conversations are
seeded and replayable, every turn resends the conversation so far (the previous prompt, the
answer streamed back, the next user message), and the report gives TTFT by turn and the
prefix hit rate from the responses' usage."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest

from pdserve.bench.serve import Endpoint, RunOptions, main
from pdserve.bench.serve_multiturn import (
    MultiTurnSpec,
    build_conversations,
    load_conversations,
    run_conversations,
    save_conversations,
    summarize_turns,
)
from pdserve.bench.serve_workload import LengthDist
from tests.bench.fake_openai import CACHED_TOKENS, TTFT_S


def _spec(seed: int = 3) -> MultiTurnSpec:
    return MultiTurnSpec(
        num_conversations=4, turns=LengthDist.parse("uniform:2:3"), system_len=40,
        num_system_prompts=1, user_len=LengthDist.parse("fixed:12"),
        output_len=LengthDist.parse("fixed:4"), think_time_s=0.01, conversation_rate=None,
        seed=seed,
    )  # fmt: skip


def test_conversations_are_seeded_share_a_system_prompt_and_replay(tokenizer, tmp_path) -> None:
    convs = build_conversations(tokenizer, _spec())
    assert convs == build_conversations(tokenizer, _spec())
    assert convs != build_conversations(tokenizer, _spec(seed=4))
    assert len({c.system for c in convs}) == 1  # one shared system prompt
    assert all(2 <= len(c.turns) <= 3 for c in convs)
    assert all(t.user_tokens == 12 and t.max_tokens == 4 for c in convs for t in c.turns)
    path = tmp_path / "conversations.json"
    save_conversations(path, convs)
    assert load_conversations(path) == convs
    path.write_text('[{"index": 0}]')
    with pytest.raises(ValueError, match="not a saved conversation list"):
        load_conversations(path)


def test_every_turn_resends_the_conversation_so_far(fake_server, tokenizer) -> None:
    fake, url = fake_server
    fake.bodies.clear()
    convs = build_conversations(tokenizer, _spec())
    records, duration = asyncio.run(run_conversations(Endpoint("fake", url), convs, RunOptions()))
    assert len(records) == sum(len(c.turns) for c in convs)
    prompts: dict[int, list[str]] = {}
    for body in fake.bodies:
        conv = next(c for c in convs if body["prompt"].startswith(c.system + c.turns[0].user))
        prompts.setdefault(conv.index, []).append(body["prompt"])
    for conv in convs:
        sent = prompts[conv.index]
        assert len(sent) == len(conv.turns)
        for k in range(1, len(sent)):
            # The previous prompt, then its answer (the fake streams "ab" per chunk), then
            # this turn's user message.
            answer = "ab" * (conv.turns[k - 1].max_tokens // 2)
            assert sent[k] == sent[k - 1] + answer + conv.turns[k].user
    summary = summarize_turns("fake", records, duration, kv_bytes=None)
    assert summary["completed"] == len(records) and summary["failed"] == 0
    assert set(summary["ttft_by_turn"]) >= {1, 2}
    # The scripted first-token delay is a floor (a loaded machine only adds to it).
    assert summary["ttft_turn1"]["p50"] >= TTFT_S
    assert summary["ttft_later_turns"]["count"] == len(records) - len(convs)
    assert summary["hit_rate"] == pytest.approx(CACHED_TOKENS / 7)
    assert summary["errors"] == {}
    # The prompt tokens computed: each prompt less the fake's reported cached tokens.
    prompts = sorted(r.record.prompt_tokens for r in records if r.turn == 1)
    assert summary["computed_tokens_turn1"]["p50"] == pytest.approx(
        float(np.median(prompts)) - CACHED_TOKENS
    )


def test_cli_replays_saved_conversations(fake_server, tokenizer, tmp_path, capsys) -> None:
    _, url = fake_server
    saved = tmp_path / "saved.json"
    save_conversations(saved, build_conversations(tokenizer, _spec()))
    out = tmp_path / "out"
    code = main([
        "--endpoint", f"fake={url}", "--tokenizer", "unused-with-replay",
        "--workload", "multiturn", "--replay", str(saved), "--out-dir", str(out),
    ])  # fmt: skip
    assert code == 0
    report = json.loads((out / "summary.json").read_text())
    (summary,) = report["summaries"]
    assert summary["completed"] == sum(len(c.turns) for c in load_conversations(saved))
    assert load_conversations(out / "conversations.json") == load_conversations(saved)
    assert "TTFT turns>=2 p50" in capsys.readouterr().out


def test_a_conversation_context_opens_only_the_first_turn_and_is_its_own(tokenizer) -> None:
    spec = dataclasses.replace(_spec(), context_len=30)
    convs = build_conversations(tokenizer, spec)
    plain = build_conversations(tokenizer, _spec())
    for conv in convs:
        first, *rest = conv.turns
        assert first.user_tokens == 30 + 12
        assert len(tokenizer(conv.system + first.user, add_special_tokens=False)["input_ids"]) == (
            len(tokenizer(conv.system, add_special_tokens=False)["input_ids"]) + 42
        )
        assert all(t.user_tokens == 12 for t in rest)
    # Every conversation opens with a context of its own after the shared system prompt.
    assert len({c.turns[0].user[:80] for c in convs}) == len(convs)
    assert len({c.system for c in convs}) == 1 and plain[0].system == convs[0].system
    with pytest.raises(ValueError, match="context_len"):
        build_conversations(tokenizer, dataclasses.replace(_spec(), context_len=-1))
