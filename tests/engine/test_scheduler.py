"""Scheduler lifecycle tests against a fake runner whose "KV" is read back through the block
tables, so every output is checked against the reference generation. Every test ends with
nothing queued and no block held."""

from __future__ import annotations

import pytest

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.request import RequestStatus
from tests.engine.fakes import (
    PIECES,
    Harness,
    RecordingConnector,
    make_request,
    reference_generate,
)

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]  # 20 tokens


def test_single_request_matches_reference_and_frees_blocks() -> None:
    h = Harness()
    h.add(make_request("r", PROMPT, max_tokens=7, temperature=0.0))
    h.run()
    out = h.final("r")
    assert out.token_ids == reference_generate(PROMPT, 7)
    assert out.finish_reason == "length"
    assert [len(o.new_token_ids) for o in h.outputs["r"]] == [1] * 7
    h.assert_empty()


def test_chunked_prefill_respects_token_budget() -> None:
    h = Harness(max_num_batched_tokens=8)
    h.add(make_request("r", PROMPT, max_tokens=3))
    steps = [h.step() for _ in range(3)]
    assert [s.chunks[0].token_ids for s in steps] == [PROMPT[0:8], PROMPT[8:16], PROMPT[16:20]]
    assert [s.chunks[0].start_position for s in steps] == [0, 8, 16]
    assert [s.chunks[0].sample for s in steps] == [False, False, True]
    assert all(s.num_batched_tokens <= 8 for s in steps)
    assert "r" in h.outputs and len(h.outputs["r"]) == 1  # first token only after last chunk
    h.run()
    assert h.final("r").token_ids == reference_generate(PROMPT, 3)
    h.assert_empty()


def test_running_decodes_come_before_new_prefills() -> None:
    h = Harness(max_num_batched_tokens=8)
    h.add(make_request("a", PROMPT[:5], max_tokens=10))
    h.step()  # a's prefill (5 tokens) and its first token
    h.add(make_request("b", PROMPT, max_tokens=2))
    out = h.step()
    assert [c.request_id for c in out.chunks] == ["a", "b"]
    assert len(out.chunks[0].token_ids) == 1 and len(out.chunks[1].token_ids) == 7
    assert out.num_batched_tokens == 8
    h.run()
    assert h.final("a").token_ids == reference_generate(PROMPT[:5], 10)
    assert h.final("b").token_ids == reference_generate(PROMPT, 2)
    h.assert_empty()


def test_fcfs_admission_under_max_num_seqs() -> None:
    h = Harness(max_num_seqs=2)
    for rid, n in (("a", 3), ("b", 6), ("c", 2)):
        h.add(make_request(rid, PROMPT[:6], max_tokens=n))
    first = h.step()
    assert [c.request_id for c in first.chunks] == ["a", "b"]
    admitted_c_at = None
    for i in range(20):
        out = h.step()
        if any(c.request_id == "c" for c in out.chunks):
            admitted_c_at = i
            break
    # c starts only once a (3 tokens) has finished and freed its seat.
    assert admitted_c_at is not None
    assert h.final("a").finished
    assert "b" in h.scheduler.requests
    h.run()
    h.assert_empty()


def test_head_of_line_request_is_not_overtaken() -> None:
    # 6 blocks of 4 tokens. "a" holds 3; "big" needs 5 -> waits; "small" behind it waits too.
    h = Harness(num_blocks=6, block_size=4, max_model_len=24)
    h.add(make_request("a", PROMPT[:10], max_tokens=2))
    h.step()
    big = [40 + k % 7 for k in range(18)]  # no prefix shared with "a"
    h.add(make_request("big", big, max_tokens=2))
    h.add(make_request("small", PROMPT[:2], max_tokens=2))
    out = h.step()
    assert [c.request_id for c in out.chunks] == ["a"]
    h.run()
    assert h.final("big").token_ids == reference_generate(big, 2)
    assert h.final("small").token_ids == reference_generate(PROMPT[:2], 2)
    h.assert_empty()


def test_preemption_by_recompute_when_pool_is_tiny() -> None:
    # Each request grows to 8 + 16 = 24 tokens = 6 blocks; the pool has 8 blocks.
    h = Harness(num_blocks=8, block_size=4, max_model_len=32)
    prompts = {rid: [(i * 7 + k) % 50 for k in range(8)] for i, rid in enumerate("abc")}
    for rid, prompt in prompts.items():
        h.add(make_request(rid, prompt, max_tokens=16))
    h.run()
    assert h.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert h.final(rid).token_ids == reference_generate(prompt, 16), rid
    # The newest request is the one preempted first.
    assert h.final("c").num_preemptions >= 1
    assert h.final("a").num_preemptions == 0
    h.assert_empty()


def test_preempted_request_leaves_running_and_is_reported_to_runner() -> None:
    h = Harness(num_blocks=4, block_size=4, max_model_len=16)
    h.add(make_request("a", PROMPT[:7], max_tokens=8))
    h.add(make_request("b", PROMPT[:7], max_tokens=8, temperature=0.0))
    # Prefix hits are possible (same prompt) but the pool still runs out while decoding.
    left: list[str] = []
    for _ in range(100):
        if not h.scheduler.has_work():
            break
        left += h.step().finished_request_ids
    assert h.scheduler.num_preemptions >= 1
    assert "b" in left
    assert h.final("a").token_ids == reference_generate(PROMPT[:7], 8)
    assert h.final("b").token_ids == reference_generate(PROMPT[:7], 8)
    h.assert_empty()


def test_prefix_cache_hit_is_reported_and_correct() -> None:
    h = Harness(block_size=4)
    h.add(make_request("a", PROMPT, max_tokens=2))
    h.run()
    assert h.final("a").num_cached_tokens == 0
    longer = PROMPT + [11, 12, 13]
    h.add(make_request("b", longer, max_tokens=4))
    first = h.step()
    assert first.chunks[0].start_position == 20  # 5 full blocks served from the cache
    h.run()
    assert h.final("b").num_cached_tokens == 20
    assert h.final("b").token_ids == reference_generate(longer, 4)
    assert h.kv.prefix_cache_hits == 20
    h.assert_empty()


def test_prefix_caching_disabled_computes_everything() -> None:
    h = Harness(block_size=4, enable_prefix_caching=False)
    h.add(make_request("a", PROMPT, max_tokens=2))
    h.run()
    h.add(make_request("b", PROMPT, max_tokens=2))
    assert h.step().chunks[0].start_position == 0
    h.run()
    assert h.final("b").num_cached_tokens == 0
    h.assert_empty()


# ---------------------------------------------------------------- stop conditions
def test_eos_stops_unless_ignored() -> None:
    ref = reference_generate(PROMPT, 10)
    eos = frozenset({ref[3]})
    stop_at = ref.index(ref[3]) + 1
    h = Harness()
    h.add(make_request("eos", PROMPT, max_tokens=10, eos=eos))
    h.add(make_request("ign", PROMPT, max_tokens=10, eos=eos, ignore_eos=True))
    h.run()
    assert h.final("eos").token_ids == ref[:stop_at]
    assert h.final("eos").finish_reason == "stop"
    assert h.final("ign").token_ids == ref and h.final("ign").finish_reason == "length"
    h.assert_empty()


def test_min_tokens_suppresses_eos_and_stop_token_ids() -> None:
    ref = reference_generate(PROMPT, 12)
    target = ref[1]
    h = Harness()
    h.add(make_request("a", PROMPT, max_tokens=12, stop_token_ids=[target]))
    h.add(make_request("b", PROMPT, max_tokens=12, stop_token_ids=[target], min_tokens=5))
    h.run()
    assert h.final("a").token_ids == ref[: ref.index(target) + 1]
    later = [i for i, t in enumerate(ref) if t == target and i >= 4]
    expected_b = ref[: later[0] + 1] if later else ref
    assert h.final("b").token_ids == expected_b
    assert len(h.final("b").token_ids) >= 5
    h.assert_empty()


def test_max_model_len_finishes_with_length() -> None:
    h = Harness(max_model_len=24)
    h.add(make_request("r", PROMPT, max_tokens=100))
    h.run()
    assert len(h.final("r").token_ids) == 4 and h.final("r").finish_reason == "length"
    h.assert_empty()


def _text_of(tokens: list[int]) -> str:
    return "".join(PIECES[t] for t in tokens)


def test_stop_string_spanning_tokens_truncates_text_and_stream() -> None:
    ref = reference_generate(PROMPT, 12)
    full = _text_of(ref)
    # A stop string that starts inside token 5's text and ends inside token 6's.
    start = len(_text_of(ref[:5])) + len(PIECES[ref[5]]) - 1
    stop = full[start : start + 2]
    expected_text = full[: full.find(stop)]
    h = Harness()
    h.add(make_request("r", PROMPT, max_tokens=12, stop=[stop], detokenize=True))
    h.run()
    out = h.final("r")
    assert out.finish_reason == "stop"
    assert out.text == expected_text and stop not in out.text
    assert "".join(o.text_delta for o in h.outputs["r"]) == out.text
    assert out.token_ids == ref[: len(out.token_ids)] and len(out.token_ids) <= 7
    h.assert_empty()


def test_streamed_text_without_stop_is_complete() -> None:
    ref = reference_generate(PROMPT, 6)
    h = Harness()
    h.add(make_request("r", PROMPT, max_tokens=6, detokenize=True, stop=["#never#"]))
    h.run()
    assert "".join(o.text_delta for o in h.outputs["r"]) == _text_of(ref)
    assert h.final("r").text == _text_of(ref)
    h.assert_empty()


def test_logprobs_top_n_is_trimmed_and_streamed_as_deltas() -> None:
    h = Harness()
    h.add(make_request("r", PROMPT, max_tokens=3, logprobs=2))
    h.add(make_request("n", PROMPT, max_tokens=3))
    h.run()
    deltas = [o.logprobs for o in h.outputs["r"]]
    assert all(d is not None and len(d) == 1 for d in deltas)
    tokens = h.final("r").token_ids
    for d, tok in zip(deltas, tokens, strict=True):
        assert isinstance(d[0], TokenLogprob) and d[0].token_id == tok
        assert d[0].top_logprobs is not None and len(d[0].top_logprobs) == 2
    assert h.final("n").logprobs is None
    h.assert_empty()


# ---------------------------------------------------------------- abort
@pytest.mark.parametrize("steps_before_abort", [0, 1, 3])
def test_abort_frees_everything(steps_before_abort: int) -> None:
    h = Harness(max_num_batched_tokens=8)
    h.add(make_request("a", PROMPT, max_tokens=20))
    h.add(make_request("b", PROMPT[:5], max_tokens=20))
    for _ in range(steps_before_abort):
        h.step()
    out = h.scheduler.abort("a")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert h.scheduler.abort("a") is None  # idempotent
    assert h.scheduler.abort("unknown") is None
    h.scheduler.abort("b")
    h.run()
    h.assert_empty()


def test_duplicate_request_id_rejected() -> None:
    h = Harness()
    h.add(make_request("a", PROMPT))
    with pytest.raises(ValueError, match="request_id"):
        h.add(make_request("a", PROMPT))
    h.scheduler.abort("a")
    h.assert_empty()


# ---------------------------------------------------------------- prefill role
def test_prefill_only_sends_kv_and_holds_blocks_until_send_done() -> None:
    conn = RecordingConnector()
    h = Harness(max_num_batched_tokens=8, connector=conn)
    h.add(make_request("p", PROMPT, max_tokens=50, prefill_only=True))
    s1, s2, s3 = h.step(), h.step(), h.step()  # chunks of 8, 8 and 4 tokens
    # Each step sends the blocks (of 4 tokens) its chunk completed; the last one is final.
    sends = [s.kv_sends for s in (s1, s2, s3)]
    assert [
        [(x.request_id, x.block_offset, len(x.block_ids), x.final) for x in s] for s in sends
    ] == [
        [("p", 0, 2, False)],
        [("p", 2, 2, False)],
        [("p", 4, 1, True)],
    ]
    assert all(x.num_tokens == 20 for s in sends for x in s)
    assert [b for s in sends for b in s[0].block_ids] == s3.chunks[0].block_ids
    out = h.final("p")
    assert out.token_ids == reference_generate(PROMPT, 1) and out.finish_reason == "length"
    # Finished for the caller, but the blocks stay held until the connector is done.
    assert "p" in h.scheduler.sending and h.kv.num_free_blocks < h.kv.num_total_blocks
    assert not h.scheduler.has_work()
    assert h.scheduler.abort("p") is None
    conn.done.append("p")
    h.step()
    h.assert_empty()


def test_prefill_only_without_connector_frees_at_once() -> None:
    h = Harness()
    h.add(make_request("p", PROMPT, max_tokens=5, prefill_only=True))
    h.run()
    assert len(h.final("p").token_ids) == 1
    h.assert_empty()


# ---------------------------------------------------------------- decode role
def test_remote_prefill_complete_then_decode() -> None:
    h = Harness(block_size=4)
    req = make_request("d", PROMPT, max_tokens=5, detokenize=True)
    blocks = h.scheduler.reserve_remote_prefill(req)
    assert blocks is not None and len(blocks) == 5
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert not h.scheduler.has_work() and h.scheduler.has_unfinished_requests()
    h.scheduler.check_integrity()
    # The "transfer": the prefill side's KV lands in the reserved blocks.
    h.runner.write(blocks, 0, PROMPT)
    first = reference_generate(PROMPT, 1)[0]
    h.scheduler.complete_remote_prefill("d", first)
    h.run()
    out = h.final("d")
    assert out.token_ids == reference_generate(PROMPT, 5)
    assert h.outputs["d"][0].new_token_ids == [first]
    assert "".join(o.text_delta for o in h.outputs["d"]) == _text_of(out.token_ids)
    # Only decode tokens were computed locally, in the reserved blocks.
    assert all(len(c.token_ids) == 1 for s in h.runner.steps for c in s.chunks)
    assert h.runner.steps[0].chunks[0].block_ids[:5] == blocks
    h.assert_empty()


def test_remote_prefill_first_token_can_finish_the_request() -> None:
    h = Harness()
    req = make_request("d", PROMPT, max_tokens=1)
    assert h.scheduler.reserve_remote_prefill(req) is not None
    h.scheduler.complete_remote_prefill("d", 7)
    h.step()
    assert h.final("d").token_ids == [7] and h.final("d").finish_reason == "length"
    h.assert_empty()


def test_remote_prefill_failure_recomputes_locally_into_reserved_blocks() -> None:
    h = Harness(max_num_batched_tokens=8)
    req = make_request("d", PROMPT, max_tokens=4)
    blocks = h.scheduler.reserve_remote_prefill(req)
    assert blocks is not None
    h.scheduler.fail_remote_prefill("d")
    h.run()
    assert h.final("d").token_ids == reference_generate(PROMPT, 4)
    assert h.runner.steps[0].chunks[0].block_ids[: len(blocks)] == blocks
    h.assert_empty()


def test_remote_reservation_without_room_holds_nothing() -> None:
    h = Harness(num_blocks=4, block_size=4, max_model_len=16)
    assert h.scheduler.reserve_remote_prefill(make_request("x", PROMPT)) is None
    assert "x" not in h.scheduler.requests
    with pytest.raises(ValueError, match="remote KV"):
        h.scheduler.complete_remote_prefill("x", 1)
    h.assert_empty()


def test_abort_while_waiting_for_remote_kv_frees_blocks() -> None:
    h = Harness()
    assert h.scheduler.reserve_remote_prefill(make_request("d", PROMPT)) is not None
    out = h.scheduler.abort("d")
    assert out is not None and out.finish_reason == "abort"
    h.assert_empty()


def test_requests_holding_remote_kv_are_not_starved_by_a_preempted_head() -> None:
    # 5 blocks of 4. "a" runs alone (max_num_seqs=1); two remote requests take 4 blocks.
    h = Harness(num_blocks=5, block_size=4, max_num_seqs=1, max_model_len=20)
    h.add(make_request("a", PROMPT[:4], max_tokens=12))
    h.step()
    remote = {"r1": PROMPT[4:12], "r2": PROMPT[8:16]}
    for rid, prompt in remote.items():
        blocks = h.scheduler.reserve_remote_prefill(make_request(rid, prompt, max_tokens=3))
        assert blocks is not None
        h.runner.write(blocks, 0, prompt)
        h.scheduler.complete_remote_prefill(rid, reference_generate(prompt, 1)[0])
    # "a" needs a second block, none is free: it is preempted and heads the queue, but
    # the remote requests hold the blocks it needs; they must run first.
    h.run(max_steps=200)
    assert h.final("a").token_ids == reference_generate(PROMPT[:4], 12)
    assert h.final("a").num_preemptions >= 1
    for rid, prompt in remote.items():
        assert h.final(rid).token_ids == reference_generate(prompt, 3)
    h.assert_empty()


def test_streamed_tokens_are_not_repeated_after_preemption() -> None:
    h = Harness(num_blocks=8, block_size=4, max_model_len=32)
    for i, rid in enumerate("abc"):
        h.add(make_request(rid, [(i * 5 + k) % 50 for k in range(8)], max_tokens=16))
    h.run()
    assert h.scheduler.num_preemptions > 0
    for rid in "abc":
        streamed = [t for o in h.outputs[rid] for t in o.new_token_ids]
        assert streamed == h.final(rid).token_ids
    h.assert_empty()


def test_prefill_only_aborted_before_its_send_frees_at_once() -> None:
    conn = RecordingConnector()
    h = Harness(max_num_batched_tokens=3, connector=conn)
    h.add(make_request("p", PROMPT, prefill_only=True))
    h.step()  # first 3 of 20 prompt tokens: no block of 4 complete, nothing sent yet
    assert h.scheduler.abort("p") is not None
    assert conn.begun == []
    h.assert_empty()


def test_integrity_check_catches_a_leaked_reference() -> None:
    h = Harness()
    h.add(make_request("a", PROMPT, max_tokens=4))
    h.step()
    h.kv.pool.touch(h.scheduler.requests["a"].block_ids[:1])  # a reference nobody holds
    with pytest.raises(AssertionError, match="ref_count"):
        h.scheduler.check_integrity()


def test_send_reported_done_within_its_own_step_still_frees_blocks() -> None:
    conn = RecordingConnector(complete_in_step=True)
    h = Harness(connector=conn)
    h.add(make_request("p", PROMPT, prefill_only=True))
    h.step()
    assert [s.request_id for s in conn.begun] == ["p"]
    assert h.final("p").token_ids == reference_generate(PROMPT, 1)
    h.assert_empty()


def test_send_reported_done_before_the_request_finishes() -> None:
    h = Harness(connector=RecordingConnector())
    h.add(make_request("p", PROMPT, prefill_only=True))
    out = h.scheduler.schedule()
    sampled = h.runner.execute(out)
    h.scheduler.finish_sends(["p"])  # e.g. a connector that reports from its own thread
    (final,) = h.scheduler.update_from_output(sampled)
    assert final.finished
    h.assert_empty()


def test_scheduler_and_cache_manager_never_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pdserve.engine.scheduler, pdserve.engine.kv_cache_manager, "
        "pdserve.engine.output_processor; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
