"""Chunk-by-chunk KV sends of prefill_only requests: which blocks each step announces, and
how a transfer ends when its request leaves before its final chunk (abort, preemption) or
when the transfer itself fails first. Every test ends with no block held."""

from __future__ import annotations

from pdserve.engine.kv_connector import PendingSend
from tests.engine.fakes import Harness, RecordingConnector, make_request, reference_generate

LONG = [(7 * i + 3) % 50 for i in range(600)]


def _sends(conn: RecordingConnector, request_id: str) -> list[PendingSend]:
    return [s for s in conn.begun if s.request_id == request_id]


def test_long_prompt_is_sent_chunk_by_chunk_and_blocks_partition_exactly() -> None:
    conn = RecordingConnector()
    h = Harness(
        num_blocks=64,
        block_size=16,
        max_num_batched_tokens=128,
        max_model_len=1024,
        connector=conn,
    )
    h.add(make_request("p", LONG, prefill_only=True))
    steps = [h.step() for _ in range(5)]  # 600 tokens: chunks of 128 x 4, then 88
    assert [c.num_tokens for s in steps for c in s.chunks] == [128, 128, 128, 128, 88]
    # Every chunk step announces exactly one send (its own), before the prompt completes.
    assert [len(s.kv_sends) for s in steps] == [1] * 5
    sends = [s.kv_sends[0] for s in steps]
    assert [(s.block_offset, len(s.block_ids)) for s in sends] == [
        (0, 8),
        (8, 8),
        (16, 8),
        (24, 8),
        (32, 6),  # 600 = 37 full blocks of 16 + a partial one: the final chunk has both
    ]
    assert [s.final for s in sends] == [False] * 4 + [True]
    assert [s.first for s in sends] == [True] + [False] * 4
    assert all(s.num_tokens == 600 and not s.cancel for s in sends)
    table = steps[-1].chunks[0].block_ids
    assert len(table) == 38
    assert [b for s in sends for b in s.block_ids] == table  # a partition, in prompt order
    # The block each send carries was fully written by the end of its step.
    for step, send in zip(steps, sends, strict=True):
        end = step.chunks[0].start_position + step.chunks[0].num_tokens
        assert (send.block_offset + len(send.block_ids)) * 16 <= end or send.final
    assert h.final("p").token_ids == reference_generate(LONG, 1)
    # The blocks are held until the connector reports the (whole) transfer done.
    assert "p" in h.scheduler.sending
    conn.done.append("p")
    h.step()
    h.assert_empty()


def test_a_chunk_that_completes_no_block_announces_nothing() -> None:
    conn = RecordingConnector()
    h = Harness(block_size=8, max_num_batched_tokens=6, connector=conn)
    h.add(make_request("p", LONG[:20], prefill_only=True))
    h.run()  # chunks end at 6, 12, 18, 20: blocks complete at 8 and 16, the last is partial
    assert [(s.block_offset, len(s.block_ids), s.final) for s in conn.begun] == [
        (0, 1, False),
        (1, 1, False),
        (2, 1, True),
    ]
    conn.done.append("p")
    h.step()
    h.assert_empty()


def test_prefix_cache_hits_go_out_with_the_first_send() -> None:
    conn = RecordingConnector(complete_in_step=True)
    h = Harness(block_size=4, max_num_batched_tokens=8, connector=conn)
    h.add(make_request("a", LONG[:20], max_tokens=1))
    h.run()  # a plain request fills the prefix cache
    h.add(make_request("p", LONG[:20] + [1, 2], prefill_only=True))
    h.run()
    sends = _sends(conn, "p")
    # 16 tokens were cached (the last block holding prompt token 20 is recomputed):
    # the first chunk's send carries the cached blocks and the one it completes.
    assert sends[0].block_offset == 0 and len(sends[0].block_ids) >= 4
    assert [b for s in sends for b in s.block_ids] == h.runner.steps[-1].chunks[0].block_ids
    assert sends[-1].final and sum(len(s.block_ids) for s in sends) == 6
    h.assert_empty()


def test_abort_mid_prefill_cancels_the_transfer_and_frees_once_confirmed() -> None:
    conn = RecordingConnector()
    h = Harness(block_size=16, max_num_batched_tokens=128, max_model_len=1024, connector=conn)
    h.add(make_request("p", LONG, prefill_only=True))
    h.step()
    h.step()  # two chunks sent, three to go
    out = h.scheduler.abort("p")
    assert out is not None and out.finish_reason == "abort"
    # The connector may still be reading the blocks: they are held until it says so.
    assert "p" in h.scheduler.sending
    s = h.step()  # nothing to compute; the cancel still reaches the connector
    assert s.chunks == [] and [(x.request_id, x.cancel, x.block_ids) for x in s.kv_sends] == [
        ("p", True, [])
    ]
    assert "p" in h.scheduler.sending
    conn.done.append("p")
    h.step()
    h.assert_empty()
    assert all(not x.final for x in _sends(conn, "p"))


def test_preempting_a_request_whose_send_began_aborts_it() -> None:
    # 12 blocks of 4: "p" (prefill_only, 40 tokens in chunks of 8) and "d" (decoding)
    # outgrow the pool; "p", the newest, is the victim once its transfer has begun.
    conn = RecordingConnector()
    h = Harness(num_blocks=12, block_size=4, max_num_batched_tokens=8, connector=conn)
    h.add(make_request("d", LONG[:8], max_tokens=30, ignore_eos=True))
    h.step()
    h.add(make_request("p", [(3 * i + 1) % 47 for i in range(40)], prefill_only=True))
    for _ in range(20):
        h.step()
        if "p" in h.outputs:
            break
    out = h.final("p")
    assert out.finish_reason == "abort" and out.token_ids == []
    sends = _sends(conn, "p")
    assert sends[-1].cancel and not any(s.final for s in sends)
    assert len(sends) >= 2  # it was sending before it was chosen
    # Its blocks come back once the connector confirmed the cancel; "d" goes on.
    conn.done.append("p")
    h.run()
    assert h.final("d").token_ids == reference_generate(LONG[:8], 30)
    h.assert_empty()


def test_preemption_prefers_a_request_whose_kv_is_not_being_sent() -> None:
    # "p" (prefill_only, sending) is the newest running request when the pool runs out;
    # "q", a plain prefill, is preempted instead (recomputed later), and "p" completes.
    conn = RecordingConnector()
    h = Harness(num_blocks=10, block_size=4, max_num_batched_tokens=5, connector=conn)
    h.add(make_request("n", [5, 6, 7, 8], max_tokens=20, ignore_eos=True))
    h.step()
    q_prompt = [(2 * i + 3) % 47 for i in range(12)]
    h.add(make_request("q", q_prompt, max_tokens=16, ignore_eos=True))
    h.add(make_request("p", [(3 * i + 1) % 47 for i in range(24)], prefill_only=True))
    for _ in range(60):
        h.step()
        if "p" in h.outputs:
            break
    assert h.final("p").finish_reason == "length" and _sends(conn, "p")[-1].final
    assert h.scheduler.num_preemptions >= 1 and h.scheduler.requests["q"].num_preemptions >= 1
    conn.done.append("p")
    h.run()
    assert h.final("q").token_ids == reference_generate(q_prompt, 16)
    h.assert_empty()


def test_a_transfer_that_fails_mid_way_stops_the_sends_and_frees_at_the_end() -> None:
    conn = RecordingConnector()
    h = Harness(block_size=16, max_num_batched_tokens=128, max_model_len=1024, connector=conn)
    h.add(make_request("p", LONG, prefill_only=True))
    h.step()
    conn.done.append("p")  # e.g. the decode side cancelled: reported before the final chunk
    h.run()
    assert len(_sends(conn, "p")) == 1  # nothing more is announced for a dead transfer
    assert h.final("p").token_ids == reference_generate(LONG, 1)
    h.assert_empty()  # freed when it finished: the connector no longer reads the blocks
