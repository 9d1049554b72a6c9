"""Delta hand-off with the real engines and the tiny test model: the decode engine already
holds a conversation's earlier turn in its prefix cache, so its reservation for the next turn
keeps that prefix and expects only the blocks past it; the prefill engine computes only what
its own cache lacks and sends only the blocks the decode side lacks (counted on both ends);
the tokens equal one engine doing the whole request, and nothing leaks on either side."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.kvtransfer import KVTransferConfig
from pdserve.kvtransfer.connector import PrefillKVConnector
from pdserve.kvtransfer.decode_connector import DecodeKVConnector
from pdserve.kvtransfer.shm import SharedKVAllocator
from tests.kvtransfer.decode_side import assert_no_leak, decode_all
from tests.support import wait_until

engine_mod = pytest.importorskip("pdserve.engine.llm_engine")
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

BLOCKS = 64
BS = 16  # the engine's default block size
BUDGET = 32  # the prefill engine's step budget: the uncomputed prompt goes in chunks


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


class _Pair:
    """A decode engine with its ``DecodeKVConnector`` over a shared-memory pool, and a
    prefill engine with its ``PrefillKVConnector``, in this process (shm transport)."""

    def __init__(self, model_dir: Path) -> None:
        self.alloc = SharedKVAllocator()
        self.decode_connector = DecodeKVConnector(
            KVTransferConfig(transport="shm"), segment_for=self.alloc.segment_for
        )
        self.decode = engine_mod.LLMEngine.from_pretrained(
            model_dir,
            kv_cache_allocator=self.alloc,
            kv_connector=self.decode_connector,
            num_kv_blocks=BLOCKS,
            device="cpu",
        )
        self.prefill_connector = PrefillKVConnector()
        self.prefill = engine_mod.LLMEngine.from_pretrained(
            model_dir,
            kv_connector=self.prefill_connector,
            num_kv_blocks=BLOCKS,
            max_num_batched_tokens=BUDGET,
            device="cpu",
        )

    def handoff(self, rid: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """One remote prefill and the decode to the end: what each side saw."""
        params = _params(max_tokens)
        self.decode_connector.register_load(rid)
        assert self.decode.reserve_remote_prefill(rid, prompt, params) is not None
        plan = self.decode_connector.plan(rid)
        (target,) = self.decode_connector.expect(rid, time.time() + 60)
        self.prefill_connector.register_target(rid, target)
        computed_before = self.prefill.scheduler.num_prompt_tokens_computed
        self.prefill.add_request(rid, prompt, params, prefill_only=True)
        outs: list[Any] = []

        def sent() -> bool:
            if not self.prefill.has_pending_work():
                return True
            outs.extend(self.prefill.step())
            return False

        wait_until(sent, timeout=30, interval=0.001, what="the prefill engine to send the KV")
        first = next(o for o in outs if o.request_id == rid)
        sent_result = self.prefill_connector.take_result(rid, timeout=5)
        got = self.decode_connector.wait(rid)
        self.decode.complete_remote_prefill(
            rid, first.token_ids[0], num_cached_tokens=first.num_cached_tokens
        )
        final: dict[str, Any] = {}
        for _ in range(500):
            if not self.decode.has_unfinished_requests():
                break
            for out in self.decode.step():
                if out.finished:
                    final[out.request_id] = out
        return {
            "plan": plan,
            "target": target,
            "sent": sent_result,
            "got": got,
            "computed": self.prefill.scheduler.num_prompt_tokens_computed - computed_before,
            "prefill_hit": first.num_cached_tokens,
            "out": final[rid],
        }

    def close(self) -> None:
        self.prefill_connector.close()
        self.decode_connector.close()
        self.alloc.close()


@pytest.fixture
def pair(tiny_model_dir: Path) -> Any:
    p = _Pair(tiny_model_dir)
    try:
        yield p
    finally:
        p.close()


def _reference(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    single = engine_mod.LLMEngine.from_pretrained(model_dir, num_kv_blocks=BLOCKS, device="cpu")
    (out,) = single.generate([prompt], _params(max_tokens))
    return list(out.token_ids)


def test_the_next_turn_moves_only_the_blocks_the_decode_side_lacks(
    pair: _Pair, tiny_model_dir: Path
) -> None:
    rng = random.Random(7)
    turn1 = [rng.randrange(4, 2048) for _ in range(100)]
    first = pair.handoff("t1", turn1, 40)
    assert list(first["out"].token_ids) == _reference(tiny_model_dir, turn1, 40)
    assert first["target"].first_block == 0  # a cold decode cache: the whole prompt moves
    num_layers = pair.decode.model_config.num_layers
    block_bytes = pair.decode_connector.layout.block_bytes()
    assert first["got"].bytes == 7 * num_layers * block_bytes

    # The next turn repeats turn 1 and its answer. The decode side cached 8 full blocks of
    # it (100 prompt + 39 computed output tokens), the prefill side 6 (turn 1's prompt).
    turn2 = turn1 + list(first["out"].token_ids) + [rng.randrange(4, 2048) for _ in range(30)]
    assert len(turn2) == 170  # 11 blocks, the last one partial
    second = pair.handoff("t2", turn2, 8)

    plan = second["plan"]
    assert (plan.num_computed_tokens, plan.num_external_tokens) == (8 * BS, 170 - 8 * BS)
    assert second["target"].first_block == 8 and len(second["target"].block_ids) == 3
    # The prefill side computed only what its own cache lacked ...
    assert second["prefill_hit"] == 6 * BS
    assert second["computed"] == 170 - 6 * BS
    # ... and the wire carried only the decode side's missing blocks: 3 of 11, in the two
    # steps that completed them (the first chunk completed only blocks decode holds).
    assert second["sent"].ok and second["got"].ok
    assert second["sent"].bytes == second["got"].bytes == 3 * num_layers * block_bytes
    assert second["got"].layer_messages == 2 * num_layers
    out = second["out"]
    assert list(out.token_ids) == _reference(tiny_model_dir, turn2, 8)
    assert out.num_cached_tokens == 6 * BS  # what was not computed for this request

    assert_no_leak(pair.decode)
    assert_no_leak(pair.prefill)
    assert pair.decode_connector.pending() == []
    assert pair.prefill_connector.sender.open_handles() == []


def test_a_failed_delta_recomputes_only_the_rest_locally(pair: _Pair, tiny_model_dir: Path) -> None:
    """The fallback after a delta reservation computes the prompt past the held prefix into
    the reserved blocks, never into the shared cached ones; the tokens still match."""
    rng = random.Random(11)
    prefix = [rng.randrange(4, 2048) for _ in range(64)]
    pair.decode.generate([prefix], _params(1))  # caches the prefix's 4 full blocks
    prompt = prefix + [rng.randrange(4, 2048) for _ in range(20)]
    pair.decode_connector.register_load("f")
    assert pair.decode.reserve_remote_prefill("f", prompt, _params(6)) is not None
    plan = pair.decode_connector.plan("f")
    assert plan is not None and plan.num_computed_tokens == 4 * BS
    computed_before = pair.decode.scheduler.num_prompt_tokens_computed
    pair.decode.fail_remote_prefill("f")
    final = decode_all(pair.decode)
    assert final["f"] == _reference(tiny_model_dir, prompt, 6)
    assert pair.decode.scheduler.num_prompt_tokens_computed - computed_before == 84 - 4 * BS
    assert_no_leak(pair.decode)


def test_a_request_aborted_before_its_first_missing_block_frees_everything(
    pair: _Pair, tiny_model_dir: Path
) -> None:
    """The prefill engine's first chunk completes only blocks the decode side holds, so no
    transfer is open yet when the request is aborted: the connector still settles it (as
    failed), the prefill engine gets every block back, and the decode side falls back."""
    rng = random.Random(5)
    turn1 = [rng.randrange(4, 2048) for _ in range(100)]
    first = pair.handoff("a1", turn1, 40)
    turn2 = turn1 + list(first["out"].token_ids) + [rng.randrange(4, 2048) for _ in range(30)]
    params = _params(8)
    pair.decode_connector.register_load("a2")
    assert pair.decode.reserve_remote_prefill("a2", turn2, params) is not None
    (target,) = pair.decode_connector.expect("a2", time.time() + 60)
    assert target.first_block == 8
    pair.prefill_connector.register_target("a2", target)
    pair.prefill.add_request("a2", turn2, params, prefill_only=True)
    pair.prefill.step()  # tokens 96..128: blocks up to 8, all held by the decode side
    assert pair.prefill.abort("a2") is not None

    def settled() -> bool:
        if not pair.prefill.has_pending_work():
            return True
        pair.prefill.step()
        return False

    wait_until(settled, timeout=10, interval=0.002, what="the prefill engine to settle")
    result = pair.prefill_connector.take_result("a2", timeout=5)
    assert result is not None and not result.ok and result.bytes == 0
    assert_no_leak(pair.prefill)
    pair.decode_connector.cancel("a2")
    pair.decode.fail_remote_prefill("a2")
    assert decode_all(pair.decode)["a2"] == _reference(tiny_model_dir, turn2, 8)
    assert_no_leak(pair.decode)
    assert pair.decode_connector.pending() == []
