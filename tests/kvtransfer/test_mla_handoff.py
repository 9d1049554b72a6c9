"""The P/D hand-off of native DeepSeek-V3 (multi-head latent attention): a prefill engine
(its own process) streams the latent KV blocks (one head of ``kv_lora_rank +
qk_rope_head_dim`` per token) into a decode engine over shared memory and over
torch.distributed; each decode engine's greedy tokens equal one engine doing the whole
request, and what landed is the latent's bytes, once (the pool's one plane is read as keys
and values). A native (latent) pool and a transformers (per-head K/V) pool of the same
checkpoint refuse to pair, and so do a one-plane and a two-plane latent pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.kvtransfer.blocks import pool_layout
from pdserve.kvtransfer.types import KVLayoutMismatchError
from tests.engine.tiny_hf_models import build_tiny_model
from tests.kvtransfer.decode_side import (
    assert_no_leak,
    decode_all,
    hand_off,
    prefill_process_and_decoders,
)
from tests.kvtransfer.procs import prefill_engine_main

engine_mod = pytest.importorskip("pdserve.engine.llm_engine")
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

NUM_NEW = 12
BLOCKS = 64
LATENT = 16 + 8  # the tiny model's kv_lora_rank + qk_rope_head_dim


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def test_latent_handoff_gives_single_engine_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = build_tiny_model("deepseek-v3", tmp_path, tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 2048, (n,), generator=g).tolist() for n in (150, 9, 40)]
    single = engine_mod.LLMEngine.from_pretrained(model_dir, num_kv_blocks=BLOCKS, device="cpu")
    assert single.model_config.mla is not None
    want = {f"r{i}": list(o.token_ids) for i, o in enumerate(single.generate(prompts, _params()))}
    with prefill_process_and_decoders(
        prefill_engine_main, (str(model_dir), BLOCKS), model_dir, BLOCKS
    ) as (parent, decoders):
        for transport, (engine, receiver, _) in decoders.items():
            assert tuple(engine.kv_cache.shape[-2:]) == (1, LATENT)
            requests = {f"r{i}": prompt for i, prompt in enumerate(prompts)}
            results = hand_off(parent, engine, receiver, requests, _params(), transport)
            layout = receiver.layout
            for num_blocks, result in results.values():
                # Whole blocks of one latent head per layer, in one plane, float32.
                latent_block = layout.block_size * LATENT * 4
                assert result.bytes == num_blocks * layout.num_layers * latent_block
            assert decode_all(engine) == want, transport
            assert_no_leak(engine)
            assert receiver.pending() == []


def test_latent_and_per_head_pools_of_one_checkpoint_do_not_pair(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from pdserve.kvtransfer import tp_plan
    from pdserve.kvtransfer.connector import PrefillKVConnector

    model_dir = build_tiny_model("deepseek-v3", tmp_path, tiny_model_dir)
    connector = PrefillKVConnector()
    native = engine_mod.LLMEngine.from_pretrained(
        model_dir, kv_connector=connector, num_kv_blocks=8, device="cpu"
    )
    assert native.model_config.kv_identity.endswith("(MLA latent KV)")
    expanded = engine_mod.LLMEngine.from_pretrained(
        model_dir, num_kv_blocks=8, device="cpu", model_impl="transformers"
    )
    mine = connector.sender.layout
    theirs = pool_layout(expanded.kv_cache, expanded.model_config.kv_identity)
    assert (mine.num_kv_heads, mine.head_dim) == (1, LATENT)
    # What the connector checks before it opens a send to a target with this layout.
    with pytest.raises(KVLayoutMismatchError, match=r"MLA latent KV"):
        tp_plan.send_slice(mine, theirs)
    # A pool that kept the latent twice (K and V planes) means other bytes per block.
    assert mine.num_planes == 1
    two_planes = mine.model_copy(update={"num_planes": 2})
    with pytest.raises(KVLayoutMismatchError, match=r"num_planes: local=1 peer=2"):
        tp_plan.send_slice(mine, two_planes)
    connector.close()
