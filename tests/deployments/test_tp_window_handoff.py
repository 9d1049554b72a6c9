"""Tensor-parallel hand-offs with window pools on both sides (CPU, gloo between the ranks,
the serving layer's TP glue of ``deployments.tp_kv``).

A tiny gpt-oss (window 32, block 16) prefills at TP=2 in a child process: every prefill
rank keeps its window layers' KV in a window pool and sends, to every decode rank holding
its heads, the full layers' blocks of the prompt and the window layers' blocks of the first
decoded token's window only. The decode replica (TP=2 through ``TPDecodeConnector``, or one
engine with a receiver per pool) keeps window pools too. Its tokens equal one engine doing
the whole request, the bytes on the wire are the windowed layout's (each head once per
decode rank holding it), and no block or expected transfer is left on either side.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from pdserve.kvtransfer.types import KVTarget
from tests.engine.tiny_hf_models import build_tiny_model
from tests.kvtransfer.decode_side import assert_no_leak, decode_all, decode_engine

B = 16
WINDOW = 32
BLOCKS = 64
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TRANSFER = KVTransferConfig(transport="torch_dist")


def _config(model_dir: Path, tp: int, kv: str) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), device="cpu", num_kv_blocks=BLOCKS, tensor_parallel_size=tp,
        kv_cache_dtype=kv,
    )  # fmt: skip


def prefill_main(conn: Connection, model_dir: str, kv: str) -> None:
    """The TP=2 prefill replica, window pools on: for [(rid, prompt, (full targets json,
    window targets json))] prefill with the targets registered; answers [(rid, first token,
    merged result json)] and the blocks it still holds."""
    torch.set_num_threads(1)
    connector = TPPrefillConnector(PrefillKVConnector(TRANSFER, window_pool=True))
    engine = LLMEngine(
        _config(Path(model_dir), 2, kv),
        kv_connector=connector,
        kv_agent_factory=PrefillAgentFactory(TRANSFER),
    )
    try:
        layout = engine.window_layout
        assert layout is not None and layout.window == WINDOW, layout
        batch = [(rid, prompt, PARAMS.max_tokens, targets) for rid, prompt, targets in conn.recv()]
        answers = prefill_batch(engine, connector, batch)
        stats = engine.stats()
        conn.send((answers, stats.num_total_blocks - stats.num_free_blocks))
    finally:
        engine.shutdown()


Expect = Callable[[str, list[int]], tuple[tuple[KVTarget, ...], tuple[KVTarget, ...]]]


def _tp_decoder(model_dir: Path, kv: str) -> tuple[Any, Any, Expect]:
    """A TP=2 decode replica with window pools: its engine, its connector (wait / pending /
    close) and how a prompt is reserved and expected (the full and window targets)."""
    connector = TPDecodeConnector(DecodeKVConnector(TRANSFER), window_pool=True)
    engine = LLMEngine(
        _config(model_dir, 2, kv),
        kv_connector=connector,
        kv_agent_factory=DecodeAgentFactory(TRANSFER),
    )

    def expect(rid: str, prompt: list[int]) -> tuple[tuple[KVTarget, ...], tuple[KVTarget, ...]]:
        connector.register_load(rid)
        assert engine.reserve_remote_prefill(rid, prompt, PARAMS, receives_window_pool=True)
        deadline = time.time() + 120
        full = connector.expect(rid, deadline)
        first, blocks = engine.remote_window_blocks(rid)
        return full, connector.expect_window(rid, first, blocks, deadline)

    return engine, connector, expect


def _single_decoder(model_dir: Path, kv: str) -> tuple[Any, Any, Expect]:
    """One decode engine with window pool and a receiver per pool."""
    engine, receivers, _ = decode_engine(model_dir, "torch_dist", BLOCKS, kv, window_pool=True)

    def expect(rid: str, prompt: list[int]) -> tuple[tuple[KVTarget, ...], tuple[KVTarget, ...]]:
        blocks = engine.reserve_remote_prefill(rid, prompt, PARAMS, receives_window_pool=True)
        assert blocks is not None
        first, window_blocks = engine.remote_window_blocks(rid)
        deadline = time.time() + 120
        n = len(prompt)
        full = receivers.full.expect(rid, blocks, deadline, num_tokens=n)
        window = receivers.window.expect(
            rid, window_blocks, deadline, num_tokens=n, first_block=first
        )
        return (full,), (window,)

    class Both:  # what the test asks of a TPDecodeConnector, over the two receivers
        def wait(self, rid: str) -> Any:
            full, window = receivers.full.wait(rid), receivers.window.wait(rid)
            assert full.ok and window.ok
            return full

        pending = receivers.pending
        close = receivers.close

    return engine, Both(), expect


CASES = [(2, "auto"), (1, "auto"), (2, "int8")]


@pytest.mark.parametrize(("decode_tp", "kv"), CASES, ids=[f"2to{t}-{k}" for t, k in CASES])
def test_tp_window_pool_handoff_sends_only_the_window(
    tiny_model_dir: Path, tmp_path: Path, decode_tp: int, kv: str
) -> None:
    model_dir = build_tiny_model("gpt-oss", tmp_path, tiny_model_dir, swiglu_limit=1.5)
    g = torch.Generator().manual_seed(7)
    lengths = (300, 9, 70)  # the first far longer than the window
    prompts = {
        f"r{i}": torch.randint(4, 2048, (n,), generator=g).tolist() for i, n in enumerate(lengths)
    }
    single = LLMEngine(_config(model_dir, 1, kv))
    assert single.window_layout is not None
    want = {
        rid: list(o.token_ids)
        for rid, o in zip(prompts, single.generate(list(prompts.values()), PARAMS), strict=True)
    }
    make = _tp_decoder if decode_tp > 1 else _single_decoder
    with _prefill_replica(model_dir, kv) as parent:
        engine, receiver, expect = make(model_dir, kv)
        try:
            _hand_off(parent, engine, receiver, expect, prompts, decode_tp)
            assert decode_all(engine) == want
            assert_no_leak(engine)
            assert receiver.pending() == []
        finally:
            receiver.close()
            engine.shutdown()


@contextmanager
def _prefill_replica(model_dir: Path, kv: str) -> Iterator[Connection]:
    """``prefill_main`` in a spawned process: the pipe to it (joined, or killed, after)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(child, str(model_dir), kv))
    proc.start()
    try:
        yield parent
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def _hand_off(
    parent: Connection,
    engine: Any,
    receiver: Any,
    expect: Expect,
    prompts: dict[str, list[int]],
    decode_tp: int,
) -> None:
    """Reserve and expect every prompt on the decode side, have the prefill replica send
    them, check each transfer's bytes against the windowed layout and complete the remote
    prefills."""
    layout = engine.window_layout
    assert layout is not None and layout.window == WINDOW
    model = engine.model_config
    batch = []
    for rid, prompt in prompts.items():
        full, window = expect(rid, prompt)
        assert len(full) == len(window) == decode_tp
        for t in window:
            assert t.layout.num_layers == len(layout.layers), t.layout
            assert t.first_block == max(0, (len(prompt) - WINDOW + 1) // B)
        jsons = ([t.model_dump_json() for t in full], [t.model_dump_json() for t in window])
        batch.append((rid, prompt, jsons))
    parent.send(batch)
    assert parent.poll(300), "the prefill replica did not answer"
    answers, prefill_held = parent.recv()
    assert prefill_held == 0
    elem = engine.kv_cache.element_size()
    # One block of one layer, K and V, every KV head once per decode rank holding it.
    block_bytes = 2 * B * max(model.num_kv_heads, decode_tp) * model.head_dim * elem
    num_full = model.num_layers - len(layout.layers)
    for rid, first, result_json in answers:
        assert first is not None and result_json is not None and '"ok":true' in result_json
        sent = int(result_json.split('"bytes":')[1].split(",")[0])
        n = len(prompts[rid])
        blocks = -(-n // B)
        in_window = blocks - max(0, (n - WINDOW + 1) // B)
        windowed = (blocks * num_full + in_window * len(layout.layers)) * block_bytes
        assert sent == windowed, (rid, sent, windowed)
        assert receiver.wait(rid).ok
        engine.complete_remote_prefill(rid, first)
