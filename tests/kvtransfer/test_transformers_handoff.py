"""The P/D KV hand-off for models built by transformers: a prefill engine (its own process)
streams the KV of tiny Qwen3-MoE, Gemma 3 (sliding-window layers) and gpt-oss (sinks,
sliding-window layers, MoE), all on the native classes ``model_impl`` auto picks, into a
decode engine over shared memory, layer by layer, and the decode engine's greedy tokens
equal ``transformers.generate``; neither side leaks a block."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.engine.tiny_hf_models import build_tiny_model
from tests.kvtransfer.decode_side import assert_no_leak, decode_all, prefill_process_and_decoders
from tests.kvtransfer.procs import prefill_engine_main

NUM_NEW = 16
BLOCKS = 64


@pytest.mark.parametrize("name", ["qwen3-moe", "gemma3", "gpt-oss"])
def test_remote_prefill_gives_transformers_tokens(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from pdserve.engine.sampling_params import SamplingParams

    model_dir = build_tiny_model(name, tmp_path, tiny_model_dir)
    g = torch.Generator().manual_seed(1)
    # Longer than the windows (32 / 40 tokens) and shorter than one block.
    prompts = [torch.randint(4, 2048, (n,), generator=g).tolist() for n in (150, 9)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gc = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None)
    expected = {}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
        expected[f"r{i}"] = out[0, len(prompt) :].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with prefill_process_and_decoders(
        prefill_engine_main, (str(model_dir), BLOCKS), model_dir, BLOCKS
    ) as (parent, decoders):
        engine, receiver, _ = decoders["shm"]
        batch = []
        for i, prompt in enumerate(prompts):
            blocks = engine.reserve_remote_prefill(f"r{i}", prompt, params)
            assert blocks is not None
            target = receiver.expect(f"r{i}", blocks, time.time() + 90, num_tokens=len(prompt))
            batch.append((f"r{i}", prompt, NUM_NEW, target.model_dump_json()))
        parent.send(batch)
        assert parent.poll(180), "prefill process did not answer"
        answers, prefill_leaked = parent.recv()
        assert prefill_leaked == 0
        for rid, first, result_json in answers:
            assert first is not None and '"ok":true' in result_json, result_json
            assert receiver.wait(rid).ok
            engine.complete_remote_prefill(rid, first)
        assert decode_all(engine) == expected
        assert_no_leak(engine)
        assert receiver.pending() == []
