"""Prefill and decode replicas of different tensor-parallel sizes hand KV off rank to rank
(CPU, gloo between the ranks, the serving layer's TP glue of ``deployments.tp_kv``).

The prefill engine (TP=a) runs in a child process with ``TPPrefillConnector``; the decode
engine (TP=b) runs here with a ``TPDecodeConnector`` over its ranks' receivers. Tokens equal one
engine doing the whole request; the bytes the prefill ranks put on the wire are the
request's KV once (every head once per decode rank that holds it: no duplicate heads); no
block is left held on either side. For models built by transformers (Qwen3, Qwen3-MoE and
Gemma 3 on their native classes) the tokens equal ``transformers.generate``.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.bench.gpu_verify_steps import prefill_batch
from pdserve.deployments.tp_kv import (
    DecodeAgentFactory,
    PrefillAgentFactory,
    TPDecodeConnector,
    TPPrefillConnector,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVTransferConfig
from pdserve.kvtransfer.connector import PrefillKVConnector
from pdserve.kvtransfer.decode_connector import DecodeKVConnector
from tests.kvtransfer.decode_side import assert_no_leak, decode_all, decode_engine

NUM_NEW = 8
BLOCKS = 48
PROMPTS = [list(range(3, 40)), [7, 99, 512, 3, 3, 1024] * 6, list(range(200, 216))]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _config(model_dir: Path, tp: int, kv: str = "auto", impl: str = "auto") -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), device="cpu", num_kv_blocks=BLOCKS, tensor_parallel_size=tp,
        kv_cache_dtype=kv, model_impl=impl,
    )  # fmt: skip


def prefill_main(
    conn: Connection, model_dir: str, tp: int, kv: str = "auto", impl: str = "auto"
) -> None:
    """The prefill replica: for [(rid, prompt, [target json per decode rank])] prefill with
    the targets registered; answers [(rid, first token, merged result json)]."""
    torch.set_num_threads(1)
    transfer = KVTransferConfig(transport="torch_dist")
    local = PrefillKVConnector(transfer)
    connector: Any = TPPrefillConnector(local) if tp > 1 else local
    engine = LLMEngine(
        _config(Path(model_dir), tp, kv, impl),
        kv_connector=connector,
        kv_agent_factory=PrefillAgentFactory(transfer) if tp > 1 else None,
    )
    try:
        batch = [(rid, prompt, NUM_NEW, targets) for rid, prompt, targets in conn.recv()]
        answers = prefill_batch(engine, connector, batch)
        stats = engine.stats()
        conn.send((answers, stats.num_total_blocks - stats.num_free_blocks))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    single = LLMEngine(_config(tiny_model_dir, 1))
    outs = single.generate(PROMPTS, _params())
    return {tuple(p): list(o.token_ids) for p, o in zip(PROMPTS, outs, strict=True)}


CASES = [(2, 1), (1, 2), (2, 4)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), CASES, ids=[f"{a}to{b}" for a, b in CASES])
def test_kv_moves_between_tp_sizes(
    tiny_model_dir: Path, references, prefill_tp: int, decode_tp: int
) -> None:
    _hand_off(tiny_model_dir, references, prefill_tp, decode_tp)


INT8_CASES = [(2, 2, "native"), (2, 1, "native"), (2, 2, "transformers")]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "impl"),
    INT8_CASES,
    ids=[f"{i}-{a}to{b}" for a, b, i in INT8_CASES],
)
def test_int8_kv_moves_between_tensor_parallel_ranks(
    tiny_model_dir: Path, prefill_tp: int, decode_tp: int, impl: str
) -> None:
    """Each prefill rank sends its heads' int8 blocks (one byte an element, checked in
    ``_hand_off``) to the decode ranks holding them, whose scales for those heads agree;
    the decode replica's tokens equal one native engine with an int8 cache (both replicas
    on the transformers path too)."""
    single = LLMEngine(_config(tiny_model_dir, 1, "int8", "native"))
    outs = single.generate(PROMPTS, _params())
    expected = {tuple(p): list(o.token_ids) for p, o in zip(PROMPTS, outs, strict=True)}
    _hand_off(tiny_model_dir, expected, prefill_tp, decode_tp, "int8", impl)


# Models built by transformers, on their native classes (model_impl auto).
TRANSFORMERS_CASES = [("qwen3", 1, 2), ("gemma3", 2, 1), ("qwen3-moe", 2, 2)]


@pytest.mark.parametrize(
    ("name", "prefill_tp", "decode_tp"),
    TRANSFORMERS_CASES,
    ids=[f"{n}-{a}to{b}" for n, a, b in TRANSFORMERS_CASES],
)
def test_transformers_path_kv_moves_between_tp_sizes(
    name: str, prefill_tp: int, decode_tp: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The decode replica's tokens equal ``transformers.generate`` (float32)."""
    from transformers import AutoModelForCausalLM

    from tests.engine.tiny_hf_models import build_tiny_model
    from tests.engine.transformers_reference import Reference

    model_dir = build_tiny_model(name, tmp_path, tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = Reference(hf, hf.config.vocab_size)
    expected = {tuple(p): ref.generate(p, NUM_NEW) for p in PROMPTS}
    _hand_off(model_dir, expected, prefill_tp, decode_tp)


# DeepSeek-V3 (multi-head latent attention): every prefill rank computes the same latent,
# the canonical copy (rank 0's) moves to every decode rank.
MLA_CASES = [(2, 1), (2, 2)]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), MLA_CASES, ids=[f"{a}to{b}" for a, b in MLA_CASES]
)
def test_mla_latent_moves_between_tp_sizes(
    prefill_tp: int, decode_tp: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The decode replica's tokens equal one engine's; the wire carries the one-plane
    latent once per decode rank (``_hand_off``)."""
    from tests.engine.tiny_hf_models import build_tiny_model

    model_dir = build_tiny_model("deepseek-v3", tmp_path, tiny_model_dir)
    single = LLMEngine(_config(model_dir, 1))
    assert single.model_config.mla is not None and single.model_config.kv_planes == 1
    outs = single.generate(PROMPTS, _params())
    expected = {tuple(p): list(o.token_ids) for p, o in zip(PROMPTS, outs, strict=True)}
    _hand_off(model_dir, expected, prefill_tp, decode_tp)


def _hand_off(
    model_dir: Path,
    references: dict[tuple[int, ...], list[int]],
    prefill_tp: int,
    decode_tp: int,
    kv: str = "auto",
    impl: str = "auto",
) -> None:
    """Prefill at TP=``prefill_tp`` in a child process, decode here at TP=``decode_tp``: the
    tokens equal ``references``, the wire carries each head once per decode rank holding
    it, and no block stays held."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(child, str(model_dir), prefill_tp, kv, impl))
    proc.start()
    transfer = KVTransferConfig(transport="torch_dist")
    local = DecodeKVConnector(transfer)
    receiver: Any = TPDecodeConnector(local) if decode_tp > 1 else local
    engine = LLMEngine(
        _config(model_dir, decode_tp, kv, impl),
        kv_connector=receiver,
        kv_agent_factory=DecodeAgentFactory(transfer) if decode_tp > 1 else None,
    )
    try:
        model = engine.model_config
        batch, prompts = [], {}
        for i, prompt in enumerate(PROMPTS):
            rid = f"r{i}"
            receiver.register_load(rid)
            blocks = engine.reserve_remote_prefill(rid, prompt, _params())
            assert blocks is not None
            targets = receiver.expect(rid, time.time() + 90)
            assert len(targets) == decode_tp
            for t in targets:  # a quantized pool's scales, one per layer, K/V and rank head
                lay = t.layout
                want_scales = 0 if kv == "auto" else lay.num_layers * 2 * lay.num_kv_heads
                assert len(lay.kv_scales) == want_scales, lay
            batch.append((rid, prompt, [t.model_dump_json() for t in targets]))
            prompts[rid] = prompt
        parent.send(batch)
        assert parent.poll(180), "the prefill replica did not answer"
        answers, prefill_held = parent.recv()
        assert prefill_held == 0
        elem = engine.kv_cache.element_size()
        for rid, first, result_json in answers:
            assert first is not None and result_json is not None and '"ok":true' in result_json
            sent = int(result_json.split('"bytes":')[1].split(",")[0])
            # Every block of the prompt, every layer, K and V, each of the model's KV heads
            # exactly once per decode rank holding it: its 2 heads once, or at decode TP=4
            # each head twice (two ranks hold a copy of each and each needs its own).
            # An MLA latent is one head in one plane, on every rank: rank 0's copy goes to
            # each decode rank.
            blocks = -(-len(prompts[rid]) // 16)
            heads_on_wire = max(model.num_kv_heads, decode_tp)
            planes = model.kv_planes
            want = blocks * model.num_layers * planes * 16 * heads_on_wire * model.head_dim * elem
            assert sent == want, (rid, sent, want)
            result = receiver.wait(rid)
            assert result.ok
            engine.complete_remote_prefill(rid, first)
        final = decode_all(engine)
        for rid, prompt in prompts.items():
            assert final[rid] == references[tuple(prompt)], rid
        assert_no_leak(engine)
        assert receiver.pending() == []
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        receiver.close()
        engine.shutdown()


def test_an_abort_mid_prefill_stops_every_prefill_rank(tiny_model_dir: Path) -> None:
    """A TP=2 prefill sends its first chunk, then the request is aborted: the step that
    carries only the cancel reaches both ranks' connectors, so the transfer ends at once
    (not at its deadline) on both sides and no block stays held."""
    from pdserve.kvtransfer.types import KVTransferError

    decode, receiver, _ = decode_engine(tiny_model_dir, "shm", BLOCKS)
    transfer = KVTransferConfig(transport="shm")
    connector = TPPrefillConnector(PrefillKVConnector(transfer))
    prefill = LLMEngine(
        _config(tiny_model_dir, 2).model_copy(update={"max_num_batched_tokens": 64}),
        kv_connector=connector,
        kv_agent_factory=PrefillAgentFactory(transfer),
    )
    try:
        prompt = list(range(10, 310))
        blocks = decode.reserve_remote_prefill("r", prompt, _params())
        assert blocks is not None
        deadline = time.time() + 60
        target = receiver.expect("r", blocks, deadline, num_tokens=len(prompt))
        connector.register_target("r", target)
        prefill.add_request("r", prompt, _params(), prefill_only=True)
        prefill.step()  # the first 64-token chunk: both ranks send their heads of it
        prefill.abort("r")
        began = time.monotonic()
        result = None
        while result is None and time.monotonic() - began < 20:
            prefill.step()
            result = connector.take_result("r", timeout=0.05)
        assert result is not None and not result.ok, result
        with pytest.raises(KVTransferError):
            receiver.wait("r")
        assert time.monotonic() - began < 20  # ended by the cancel, not the 60 s deadline
        decode.abort("r")
        assert_no_leak(prefill)
        assert_no_leak(decode)
    finally:
        receiver.close()
        prefill.shutdown()
