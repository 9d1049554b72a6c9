"""A long prompt prefilled in chunks is handed off chunk by chunk, with the real engine and
the tiny test model: the prefill engine (its own process, a 128-token step budget) sends
each chunk's blocks while it computes the next, so KV lands on the decode side before the
prefill's final step; decode tokens equal one engine doing the whole request. A request
aborted mid-prefill ends its transfer at once on both sides, and nothing leaks."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.kvtransfer import KVTransferError, TransferResult
from pdserve.kvtransfer.connector import PrefillKVConnector
from pdserve.kvtransfer.receiver import KVReceiver
from tests.kvtransfer.decode_side import (
    assert_no_leak,
    decode_all,
    decode_engine,
    prefill_process_and_decoders,
)
from tests.kvtransfer.procs import chunked_prefill_main

engine_mod = pytest.importorskip("pdserve.engine.llm_engine")
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from tests.support import wait_until  # noqa: E402

NUM_NEW = 8
BLOCKS = 64  # of 16 tokens: a 600-token prompt takes 38
BUDGET = 128  # 600 tokens = chunks of 128 x 4 + 88: five sends, each of its chunk's blocks
NUM_CHUNKS = 5


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2048) for _ in range(600)]


class _FirstLanding:
    """Watches a receiver until the request's first KV landed; records when."""

    def __init__(self, receiver: KVReceiver, request_id: str) -> None:
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(receiver, request_id))
        self._thread.start()

    def _watch(self, receiver: KVReceiver, request_id: str) -> None:
        while not self._stop.is_set():
            if (receiver.landed_blocks(request_id) or 0) > 0:
                self.at = time.time()
                return
            time.sleep(0.0005)  # sampling interval of the timestamp, not synchronization

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _warm_up(parent: Any, engine: Any, receiver: KVReceiver, rid: str, prompt: list[int]) -> None:
    """A short hand-off first: the prefill side connects to this receiver (a serving pair
    stays connected), so the long one's timing is the steady state's."""
    blocks = engine.reserve_remote_prefill(rid, prompt, _params())
    target = receiver.expect(rid, blocks, time.time() + 60, num_tokens=len(prompt))
    parent.send((rid, prompt, NUM_NEW, target.model_dump_json()))
    assert parent.poll(120), "prefill process did not answer"
    first, *_ = parent.recv()
    receiver.wait(rid)
    engine.complete_remote_prefill(rid, first)
    decode_all(engine)


@pytest.fixture(scope="module")
def prompts_and_references(tiny_model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy continuations from one engine doing the whole request in one step."""
    single = engine_mod.LLMEngine.from_pretrained(
        tiny_model_dir, num_kv_blocks=BLOCKS, device="cpu"
    )
    prompts = [_prompt(1), _prompt(2)]
    outs = single.generate(prompts, _params())
    return {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs, strict=True)}


def test_long_prompt_is_handed_off_chunk_by_chunk(
    tiny_model_dir: Path, prompts_and_references: dict[tuple[int, ...], list[int]]
) -> None:
    with prefill_process_and_decoders(
        chunked_prefill_main, (str(tiny_model_dir), BLOCKS, BUDGET), tiny_model_dir, BLOCKS
    ) as (parent, decoders):
        for (transport, (engine, receiver, _)), prompt in zip(
            decoders.items(), prompts_and_references, strict=True
        ):
            _warm_up(parent, engine, receiver, f"warm-{transport}", list(prompt[:20]))
            rid = f"long-{transport}"
            num_layers = engine.model_config.num_layers
            blocks = engine.reserve_remote_prefill(rid, list(prompt), _params())
            assert blocks is not None and len(blocks) >= 38
            target = receiver.expect(rid, blocks, time.time() + 90, num_tokens=len(prompt))
            watch = _FirstLanding(receiver, rid)
            parent.send((rid, list(prompt), NUM_NEW, target.model_dump_json()))
            assert parent.poll(120), "prefill process did not answer"
            first, result_json, starts, first_step, leaked = parent.recv()
            watch.stop()
            assert leaked == 0 and first is not None and result_json is not None
            sent = TransferResult.model_validate_json(result_json)
            assert sent.ok, sent.error
            got = receiver.wait(rid)
            # One message per layer per chunk: the five chunks went out one by one...
            assert sent.layer_messages == got.layer_messages == NUM_CHUNKS * num_layers
            assert got.bytes == sent.bytes == 38 * num_layers * receiver.layout.block_bytes()
            # ... and KV landed here before the prefill engine began its final step.
            assert first_step == NUM_CHUNKS - 1, starts
            assert watch.at is not None and watch.at < starts[first_step], (watch.at, starts)
            engine.complete_remote_prefill(rid, first)
            assert decode_all(engine)[rid] == prompts_and_references[prompt], transport
            assert_no_leak(engine)
            assert receiver.pending() == []


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_abort_mid_prefill_ends_the_transfer_on_both_sides(
    tiny_model_dir: Path,
    prompts_and_references: dict[tuple[int, ...], list[int]],
    transport: str,
) -> None:
    """The prefill request is aborted after two of its five chunks: the decode side's wait
    fails at once (long before the deadline) saying the prefill side aborted and what is
    missing; it recomputes the prompt into its blocks with the same tokens; both engines
    get every block back and no send or expectation is left."""
    prompt = next(iter(prompts_and_references))
    engine, receiver, alloc = decode_engine(tiny_model_dir, transport, BLOCKS)
    connector = PrefillKVConnector()
    prefill = engine_mod.LLMEngine.from_pretrained(
        tiny_model_dir,
        kv_connector=connector,
        num_kv_blocks=BLOCKS,
        max_num_batched_tokens=BUDGET,
        device="cpu",
    )
    try:
        blocks = engine.reserve_remote_prefill("ab", list(prompt), _params())
        assert blocks is not None
        deadline = time.time() + 60
        target = receiver.expect("ab", blocks, deadline, num_tokens=len(prompt))
        connector.register_target("ab", target)
        prefill.add_request("ab", list(prompt), _params(), prefill_only=True)
        prefill.step()
        prefill.step()
        out = prefill.abort("ab")
        assert out is not None and out.finish_reason == "abort"

        # The engine's next step passes the cancel on (there is nothing left to compute);
        # it steps until the connector confirmed it: then no read of the blocks is pending.
        def settled() -> bool:
            if not prefill.has_pending_work():
                return True
            prefill.step()
            return False

        wait_until(settled, timeout=10, interval=0.002, what="the engine to pass the cancel on")
        with pytest.raises(KVTransferError, match=r"aborted the transfer.*missing: blocks"):
            receiver.wait("ab")
        assert time.time() < deadline - 30  # failed on the sender's word, not by the deadline
        result = connector.take_result("ab", timeout=5)
        assert result is not None and not result.ok and "aborted" in (result.error or "")
        assert_no_leak(prefill)
        assert connector.sender.open_handles() == []

        engine.fail_remote_prefill("ab")  # the decode side's fallback: compute it here
        assert decode_all(engine)["ab"] == prompts_and_references[prompt]
        assert_no_leak(engine)
        assert receiver.pending() == []
    finally:
        connector.sender.close()
        receiver.close()
        alloc.close()
