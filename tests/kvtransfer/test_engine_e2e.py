"""End to end with the real engine and the tiny test model: engine A (prefill role, its own
process) prefills and streams its KV into engine B (decode role, this process), B decodes.
Tokens equal one engine doing the whole request, and transformers. Failures fall back to a
local prefill with the same tokens, and neither side leaks a block."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.kvtransfer import KVTarget, KVTransferTimeoutError
from pdserve.kvtransfer.connector import PrefillKVConnector
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.shm import list_segments
from tests.kvtransfer.decode_side import (
    assert_no_leak,
    decode_all,
    decode_engine,
    prefill_process_and_decoders,
)
from tests.kvtransfer.procs import prefill_engine_main

engine_mod = pytest.importorskip("pdserve.engine.llm_engine")
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from tests.support import wait_until  # noqa: E402

NUM_NEW = 10
BLOCKS = 64


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _reserve(
    engine: Any, receiver: KVReceiver, rid: str, prompt: list[int], deadline: float | None = None
) -> KVTarget | None:
    """The decode side of a hand-off, with the primitives: reserve blocks for the prompt,
    expect its KV in them. None when the pool has no room."""
    blocks = engine.reserve_remote_prefill(rid, prompt, _params())
    if blocks is None:
        return None
    return receiver.expect(rid, blocks, deadline, num_tokens=len(prompt))


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path) -> Iterator[dict[tuple[int, ...], list[int]]]:
    """Greedy continuations from one engine doing the whole request, checked against
    transformers on the way."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    prompts = [list(range(3, 40)), [7, 99, 512, 3, 3, 1024] * 6, list(range(200, 216))]
    single = engine_mod.LLMEngine.from_pretrained(
        tiny_model_dir, num_kv_blocks=BLOCKS, device="cpu"
    )
    outs = single.generate(prompts, _params())
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gc = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None)
    refs: dict[tuple[int, ...], list[int]] = {}
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hf_ids = hf.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
        assert list(out.token_ids) == hf_ids[0, len(prompt) :].tolist()
        refs[tuple(prompt)] = list(out.token_ids)
    yield refs


def test_prefill_process_streams_kv_to_decode_engines(
    tiny_model_dir: Path, references: dict[tuple[int, ...], list[int]]
) -> None:
    # One prefill process pairs with two decode engines at once, over two transports.
    with prefill_process_and_decoders(
        prefill_engine_main, (str(tiny_model_dir), BLOCKS), tiny_model_dir, BLOCKS
    ) as (parent, decoders):
        segments = [a.segment_for(e.kv_cache).name for e, _, a in decoders.values()]
        prompts = list(references)
        plan = [("shm", 0), ("shm", 1), ("torch_dist", 2), ("torch_dist", 0)]
        batch, handoffs = [], {}
        for i, (transport, p) in enumerate(plan):
            engine, receiver, _ = decoders[transport]
            rid = f"{transport}-{i}"
            target = _reserve(engine, receiver, rid, list(prompts[p]), time.time() + 90)
            assert target is not None and target.transport == transport
            batch.append((rid, list(prompts[p]), NUM_NEW, target.model_dump_json()))
            handoffs[rid] = (transport, prompts[p])
        parent.send(batch)
        assert parent.poll(120), "prefill process did not answer"
        answers, prefill_leaked = parent.recv()
        assert prefill_leaked == 0
        for rid, first, result_json in answers:
            assert first is not None and result_json is not None
            assert '"ok":true' in result_json, result_json
            engine, receiver, _ = decoders[handoffs[rid][0]]
            result = receiver.wait(rid)  # the KV landed: decoding starts from ``first``
            engine.complete_remote_prefill(rid, first)
            assert result.ok and result.bytes > 0
        for transport, (engine, receiver, _) in decoders.items():
            final = decode_all(engine)
            for rid, (_, prompt) in handoffs.items():
                if rid.startswith(transport):
                    assert final[rid] == references[prompt], rid
            assert_no_leak(engine)
            assert receiver.pending() == []
    for name in segments:
        assert name not in list_segments()


def test_lost_prefill_falls_back_to_local_compute(
    tiny_model_dir: Path, references: dict[tuple[int, ...], list[int]]
) -> None:
    """Nobody sends the KV: wait raises by the deadline, the decode engine recomputes the
    prompt into the blocks it reserved, the tokens are still right, nothing leaks."""
    engine, receiver, alloc = decode_engine(tiny_model_dir, "shm", BLOCKS)
    try:
        prompt = next(iter(references))
        assert _reserve(engine, receiver, "lost", list(prompt), time.time() + 0.5) is not None
        start = time.time()
        with pytest.raises(KVTransferTimeoutError, match="deadline"):
            receiver.wait("lost")
        engine.fail_remote_prefill("lost")  # recompute the prompt into the reserved blocks
        assert time.time() - start < 0.5 + 2.0
        assert decode_all(engine)["lost"] == references[prompt]
        assert_no_leak(engine)
        assert receiver.pending() == []
    finally:
        receiver.close()
        alloc.close()


def test_prefill_frees_blocks_when_the_decode_side_is_gone(tiny_model_dir: Path) -> None:
    """The receiver disappears before the prefill runs: the prefill engine still answers,
    its transfer result says what failed, and all its blocks come back."""
    dec_engine, receiver, alloc = decode_engine(tiny_model_dir, "torch_dist", BLOCKS)
    prompt = list(range(3, 40))
    target = _reserve(dec_engine, receiver, "gone", prompt)
    assert target is not None
    receiver.close()
    alloc.close()

    connector = PrefillKVConnector()  # the engine registers its pool: the sender is built
    engine = engine_mod.LLMEngine.from_pretrained(
        tiny_model_dir, kv_connector=connector, num_kv_blocks=BLOCKS, device="cpu"
    )
    connector.register_target("gone", target)
    engine.add_request("gone", prompt, _params(), prefill_only=True)

    def settled() -> bool:
        if not engine.has_pending_work():
            return True
        engine.step()
        return False

    wait_until(settled, timeout=30, interval=0.001, what="the send to the closed peer to end")
    result = connector.take_result("gone", timeout=1)
    assert result is not None and not result.ok and result.error
    assert_no_leak(engine)
    assert connector.sender.open_handles() == []
    connector.sender.close()
