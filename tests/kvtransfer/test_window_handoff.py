"""The P/D hand-off of a model with sliding-window layers (a tiny gpt-oss, window 32): a
prefill engine (its own process, with a KV connector: its window layers stay in the one
pool the hand-off moves) streams prompts longer than the window into decode engines over
shared memory and over torch.distributed; each decode engine's greedy tokens equal one
engine doing the whole request with its window layers in a pool of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.engine.tiny_hf_models import build_tiny_model
from tests.kvtransfer.decode_side import (
    assert_no_leak,
    decode_all,
    hand_off,
    prefill_process_and_decoders,
)
from tests.kvtransfer.procs import prefill_engine_main

BLOCKS = 64
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def test_window_model_handoff_gives_single_engine_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = build_tiny_model("gpt-oss", tmp_path, tiny_model_dir, swiglu_limit=1.5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 2048, (n,), generator=g).tolist() for n in (300, 9, 70)]
    single = LLMEngine.from_pretrained(model_dir, num_kv_blocks=BLOCKS, device="cpu")
    assert single.window_layout is not None and single.window_layout.window == 32
    want = {f"r{i}": list(o.token_ids) for i, o in enumerate(single.generate(prompts, PARAMS))}
    with prefill_process_and_decoders(
        prefill_engine_main, (str(model_dir), BLOCKS), model_dir, BLOCKS
    ) as (parent, decoders):
        for transport, (engine, receiver, _) in decoders.items():
            assert engine.window_layout is None  # the receiver fills one pool of every layer
            requests = {f"r{i}": prompt for i, prompt in enumerate(prompts)}
            hand_off(parent, engine, receiver, requests, PARAMS, transport)
            assert decode_all(engine) == want, transport
            assert_no_leak(engine)
            assert receiver.pending() == []


@pytest.mark.parametrize(
    ("budget", "kv_dtype"),
    [(None, "auto"), (32, "auto"), (None, "int8")],
    ids=["default", "chunked-32", "int8-kv"],
)
def test_window_pool_handoff_sends_only_the_window(
    tiny_model_dir: Path, tmp_path: Path, budget: int | None, kv_dtype: str
) -> None:
    """Both sides keep the window pool: the prefill side sends its window layers' blocks
    of the first decoded token's window only, into the decode side's window pool; tokens
    equal one engine's, the bytes are the windowed layout's, and a later prompt sharing a
    prefix of a handed-off one (whose early window-layer KV never came) still matches.
    With a 32-token budget the prefill side computes the prompts in chunks, releasing
    window blocks between them while the earlier chunks' full-layer blocks are sent. With an
    int8 KV cache each pool carries its own layers' scales, which both sides compare."""
    model_dir = build_tiny_model("gpt-oss", tmp_path, tiny_model_dir, swiglu_limit=1.5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 2048, (n,), generator=g).tolist() for n in (300, 9, 70)]
    later = prompts[0][:250] + [7, 8, 9]
    single = LLMEngine.from_pretrained(
        model_dir, num_kv_blocks=BLOCKS, device="cpu", kv_cache_dtype=kv_dtype
    )
    outs = single.generate([*prompts, later], PARAMS)
    want = {f"r{i}": list(o.token_ids) for i, o in enumerate(outs[:-1])}
    window = 32
    with prefill_process_and_decoders(
        prefill_engine_main,
        (str(model_dir), BLOCKS, kv_dtype, True, budget),
        model_dir,
        BLOCKS,
        kv_dtype,
        window_pool=True,
    ) as (parent, decoders):
        for transport, (engine, receivers, _) in decoders.items():
            assert engine.window_layout is not None and engine.window_layout.window == window
            requests = {f"r{i}": prompt for i, prompt in enumerate(prompts)}
            results = hand_off(parent, engine, receivers, requests, PARAMS, transport)
            full, windowed = receivers.full.layout, receivers.window.layout
            if kv_dtype == "int8":  # [L_pool, 2, H] scales each: their own layers' rows
                assert windowed.dtype == "int8" and windowed.kv_scales
                assert len(full.kv_scales) == 2 * full.num_layers * full.num_kv_heads
                assert len(windowed.kv_scales) == 2 * windowed.num_layers * windowed.num_kv_heads
            bs = full.block_size
            for rid, (num_blocks, result) in results.items():
                n = len(requests[rid])
                blocks = -(-n // bs)
                first_in_window = max(0, (n - window + 1) // bs)
                assert num_blocks >= blocks
                assert result.bytes == (
                    blocks * full.num_layers * full.block_bytes()
                    + (blocks - first_in_window) * windowed.num_layers * windowed.block_bytes()
                ), (transport, rid)
            assert decode_all(engine) == want, transport
            # The decode side's prefix cache holds the 300-token prompt's full layers but
            # only its last window's window-layer KV: a prompt sharing 250 tokens of it
            # must not take the blocks whose window-layer KV never arrived.
            (out,) = engine.generate([later], PARAMS)
            assert list(out.token_ids) == list(outs[-1].token_ids), transport
            assert_no_leak(engine)
            assert receivers.pending() == []
