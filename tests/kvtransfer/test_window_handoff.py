"""The P/D hand-off of a model with sliding-window layers (a tiny gpt-oss, window 32): a
prefill engine (its own process, with a KV connector: its window layers stay in the one
pool the hand-off moves) streams prompts longer than the window into decode engines over
shared memory and over torch.distributed; each decode engine's greedy tokens equal one
engine doing the whole request with its window layers in a pool of their own."""

from __future__ import annotations

from pathlib import Path

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
