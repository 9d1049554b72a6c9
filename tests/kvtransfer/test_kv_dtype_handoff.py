"""A KV hand-off between pools with an int8 / float8 cache: the wire carries the cache in
its own dtype (a quarter of this float32 model's bytes, half of bf16's), the decode side
continues with the tokens one engine with the same KV dtype gives, and pools of different
KV dtypes (or scales) refuse to pair, naming both."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pdserve.kvtransfer.blocks import pool_layout
from pdserve.kvtransfer.types import KVLayout, KVLayoutMismatchError
from tests.kvtransfer.decode_side import assert_no_leak, decode_all, prefill_process_and_decoders
from tests.kvtransfer.procs import prefill_engine_main

engine_mod = pytest.importorskip("pdserve.engine.llm_engine")
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

NUM_NEW = 8
BLOCKS = 64
PROMPTS = [list(range(3, 40)), [7, 99, 512, 3, 3, 1024] * 6]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def test_fp8_kv_handoff_moves_one_byte_per_element_and_gives_single_engine_tokens(
    tiny_model_dir: Path,
) -> None:
    single = engine_mod.LLMEngine.from_pretrained(
        tiny_model_dir, num_kv_blocks=BLOCKS, device="cpu", kv_cache_dtype="fp8_e4m3"
    )
    want = [list(o.token_ids) for o in single.generate(PROMPTS, _params())]
    float_layout = pool_layout(
        torch.empty(4, 2, 1, 16, 2, 32, dtype=single.model_config.dtype), "x"
    )
    with prefill_process_and_decoders(
        prefill_engine_main, (str(tiny_model_dir), BLOCKS, "fp8_e4m3"), tiny_model_dir, BLOCKS,
        "fp8_e4m3",
    ) as (parent, decoders):  # fmt: skip
        batch, sent = [], {}
        for i, (transport, p) in enumerate([("shm", 0), ("torch_dist", 1)]):
            engine, receiver, _ = decoders[transport]
            assert engine.kv_cache.dtype == torch.float8_e4m3fn
            rid = f"{transport}-{i}"
            prompt = PROMPTS[p]
            blocks = engine.reserve_remote_prefill(rid, prompt, _params())
            target = receiver.expect(rid, blocks, time.time() + 90, num_tokens=len(prompt))
            assert target.layout.dtype == "float8_e4m3fn" and target.layout.kv_scales
            batch.append((rid, prompt, NUM_NEW, target.model_dump_json()))
            sent[rid] = (transport, p, len(blocks))
        parent.send(batch)
        assert parent.poll(120), "prefill process did not answer"
        answers, prefill_leaked = parent.recv()
        assert prefill_leaked == 0
        for rid, first, result_json in answers:
            assert '"ok":true' in result_json, result_json
            transport, p, num_blocks = sent[rid]
            engine, receiver, _ = decoders[transport]
            result = receiver.wait(rid)
            engine.complete_remote_prefill(rid, first)
            # Every layer's blocks, one byte per element: a quarter of the float32 pool's.
            layout = receiver.layout
            assert result.bytes == num_blocks * layout.num_layers * layout.block_bytes()
            assert 4 * layout.block_bytes() == float_layout.block_bytes()
        for transport, (engine, receiver, _) in decoders.items():
            final = decode_all(engine)
            for rid, (t, p, _) in sent.items():
                if t == transport:
                    assert final[rid] == want[p], rid
            assert_no_leak(engine)
            assert receiver.pending() == []


def _layout(dtype: str, scales: tuple[float, ...] = ()) -> KVLayout:
    return KVLayout(
        model="m", num_layers=1, num_kv_heads=2, head_dim=8, block_size=16, dtype=dtype,
        kv_scales=scales,
    )  # fmt: skip


def test_pools_of_different_kv_dtypes_or_scales_do_not_pair() -> None:
    msg = _layout("float8_e4m3fn", (0.1,) * 4).mismatch(_layout("bfloat16"))
    assert msg is not None and "float8_e4m3fn" in msg and "bfloat16" in msg
    msg = _layout("int8", (0.1, 0.1, 0.1, 0.1)).mismatch(_layout("int8", (0.1, 0.1, 0.2, 0.1)))
    assert msg is not None and "kv_scales" in msg and "0.2" in msg
    # Last-bit differences of one calibration on two devices still pair.
    assert _layout("int8", (0.1,) * 4).mismatch(_layout("int8", (0.1 * (1 + 1e-6),) * 4)) is None


def test_tensor_parallel_pools_compare_the_scales_of_the_heads_they_share() -> None:
    # One layer, 2 KV heads: a whole pool (K 0.1 0.2, V 0.3 0.4) and the TP rank holding head 1.
    whole = _layout("int8", (0.1, 0.2, 0.3, 0.4))

    def rank1(scales: tuple[float, ...]) -> KVLayout:
        return KVLayout(
            model="m", num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="int8",
            kv_scales=scales, kv_head_start=1, total_kv_heads=2, tp_size=2, tp_rank=1,
        )  # fmt: skip

    assert whole.mismatch(rank1((0.2, 0.4))) is None
    assert rank1((0.2, 0.4)).mismatch(whole) is None
    msg = whole.mismatch(rank1((0.2, 0.5)))
    assert msg is not None and "0.4" in msg and "0.5" in msg
    # Rank 0 of another split (head 0) shares no head with rank 1: nothing to compare.
    other = rank1((0.9, 0.9)).model_copy(update={"kv_head_start": 0, "tp_rank": 0})
    assert other.mismatch(rank1((0.2, 0.4))) is None


def test_a_prefill_engine_refuses_a_target_of_another_kv_dtype(tiny_model_dir: Path) -> None:
    from pdserve.kvtransfer import tp_plan
    from pdserve.kvtransfer.connector import PrefillKVConnector

    connector = PrefillKVConnector()
    engine = engine_mod.LLMEngine.from_pretrained(
        tiny_model_dir, kv_connector=connector, num_kv_blocks=BLOCKS, device="cpu",
        kv_cache_dtype="int8",
    )  # fmt: skip
    mine = connector.sender.layout
    assert mine.dtype == "int8" and len(mine.kv_scales) == 4 * 2 * 2
    decode_pool = torch.zeros(4, 2, BLOCKS, 16, 2, 32, dtype=engine.model_config.dtype)
    theirs = pool_layout(decode_pool, engine.model_config.model_name)
    # What the connector checks before it opens a send to a target with this layout.
    with pytest.raises(KVLayoutMismatchError, match=r"dtype: local='int8' peer='float32'"):
        tp_plan.send_slice(mine, theirs)
    connector.close()
