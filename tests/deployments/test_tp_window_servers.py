"""The served P/D split of a window model under tensor parallelism, in one process, no Ray:
a TP=2 prefill replica and TP=2 and TP=1 decode replicas of a tiny gpt-oss (window 32,
block 16), the real servers and engines (ranks 1.. child processes, gloo between them), the
real hand-off (rank 0's pools in shared memory, the other ranks over torch.distributed).

Every rank keeps its heads' window pool; a remote prompt moves every block of the full
layers and only the first decoded token's window of the window layers, rank to rank, and
the tokens equal one engine's. A failed remote prefill, and a request whose window targets
do not match its full-pool targets, end in the decode side's local recompute."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdserve.deployments.decode_server import DecodeServer
from pdserve.deployments.prefill_server import PrefillServer
from pdserve.deployments.window_handoff import WindowPairingError
from pdserve.engine.llm_engine import LLMEngine
from tests.deployments.in_process import SHORT, collect, config, long_prompt, request, tokens
from tests.deployments.serving_fakes import InProcessPrefill
from tests.deployments.window_servers import (
    WINDOW,
    check_failed_prefill_is_recomputed,
    greedy_tokens,
    integrity,
    tiny_window_model,
)

MAX_TOKENS = 10


@dataclass
class Replicas:
    prefill: PrefillServer  # TP=2
    single_prefill: PrefillServer  # TP=1
    decode: DecodeServer  # TP=2
    single_decode: DecodeServer  # TP=1, paired with ``prefill``
    client: InProcessPrefill  # ``decode``'s (calls ``prefill`` unless a test swaps it)
    reference: LLMEngine  # one engine, window pool on


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    model_dir = tiny_window_model(tiny_model_dir, tmp_path_factory)
    engine = {"engine": {"num_kv_blocks": 64, "max_num_seqs": 4}}
    tp2 = {"tensor_parallel_size": 2, **engine}
    cfg = config(model={"path": model_dir}, prefill=tp2, decode=tp2)
    single_cfg = config(model={"path": model_dir}, prefill=tp2, decode=engine)
    prefill = PrefillServer(cfg, model_dir)
    client = InProcessPrefill(prefill)
    servers: list[Any] = [prefill]
    try:
        single_prefill = PrefillServer(config(model={"path": model_dir}, prefill=engine), model_dir)
        servers.append(single_prefill)
        decode = DecodeServer(cfg, model_dir, prefill=client)
        servers.append(decode)
        single_decode = DecodeServer(single_cfg, model_dir, prefill=InProcessPrefill(prefill))
        servers.append(single_decode)
        reference = LLMEngine.from_pretrained(model_dir, num_kv_blocks=64, device="cpu")
        yield Replicas(prefill, single_prefill, decode, single_decode, client, reference)
    finally:
        for server in reversed(servers):
            server.shutdown()


@pytest.fixture()
def r(replicas: Replicas) -> Replicas:
    replicas.client.reset()
    return replicas


def expected(r: Replicas, prompt: list[int]) -> list[int]:
    return greedy_tokens(r.reference, prompt, MAX_TOKENS)


def windowed_bytes(server: DecodeServer, prompts: list[list[int]]) -> int:
    """What rank 0 of ``server`` receives for ``prompts``: every block of the full layers,
    the window layers' blocks from the first decoded token's window on, rank 0's heads."""
    full_pool, window_pool = server.engine.kv_cache, server.engine.window_kv_cache
    assert window_pool is not None
    block = server.block_size
    block_bytes = full_pool[0, :, 0].numel() * full_pool.element_size()  # one layer, K and V
    total = 0
    for prompt in prompts:
        n = len(prompt)
        blocks = -(-n // block)
        total += blocks * full_pool.shape[0] * block_bytes
        total += (blocks - (n - WINDOW + 1) // block) * window_pool.shape[0] * block_bytes
    return total


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (2, 1), (1, 2)], ids=str)
def test_tp_replicas_hand_off_only_the_window_and_match(
    r: Replicas, prefill_tp: int, decode_tp: int
) -> None:
    decode = r.decode if decode_tp == 2 else r.single_decode
    prefill = r.prefill if prefill_tp == 2 else r.single_prefill
    r.client.server = prefill  # ``decode``'s client (``single_decode`` calls ``r.prefill``)
    seed = 10 * prefill_tp + decode_tp
    prompts = {
        f"{seed}-300": long_prompt(seed, 300),
        f"{seed}-70": long_prompt(seed + 1, 70),
        f"{seed}-short": SHORT,
    }
    before = decode.counters()

    async def run() -> list[list[Any]]:
        return await asyncio.gather(
            *(collect(decode, request(rid, p, MAX_TOKENS)) for rid, p in prompts.items())
        )

    try:
        results = dict(zip(prompts, asyncio.run(run()), strict=True))
    finally:
        r.client.server = r.prefill
    where = {rid: chunks[0].prefill_location for rid, chunks in results.items()}
    assert list(where.values()) == ["remote", "remote", "local"], where
    for rid, prompt in prompts.items():
        assert tokens(results[rid]) == expected(r, prompt), rid
    remote = [prompts[rid] for rid, at in where.items() if at == "remote"]
    after = decode.counters()
    assert after.kv_bytes_received - before.kv_bytes_received == windowed_bytes(decode, remote)
    assert after.kv_transfers - before.kv_transfers == 2 * len(remote)  # one per pool
    if decode_tp == 2:
        # One window target per decode rank; rank 0's pools both offer shared memory.
        for sent in r.client.requests:
            assert len(sent.window_kv_targets) == len(sent.kv_targets) == 2
            assert sent.window_kv_targets[0].transport == sent.kv_targets[0].transport == "shm"
            assert [t.layout.tp_rank for t in sent.window_kv_targets] == [0, 1]
    # What the prefill router prices a hand-off by: the whole replica's KV per token (every
    # head once, as the decode replica counts it), the window layers' share of it apart.
    stats = prefill.record_routing_stats()
    assert stats["kv_bytes_per_token"] == decode.kv_bytes_per_token
    window_layers = decode.engine.window_kv_cache.shape[0]
    layer_bytes = decode.kv_bytes_per_token // (window_layers + decode.engine.kv_cache.shape[0])
    assert stats["window_kv_bytes_per_token"] == window_layers * layer_bytes
    for server in (decode, prefill):
        report = integrity(server)
        assert report.num_window_total_blocks > 0, report
        assert report.idle, report


def test_a_failed_tp_remote_prefill_is_recomputed_with_the_window_pool(r: Replicas) -> None:
    check_failed_prefill_is_recomputed(
        r.decode, r.client, r.reference, "tp-fail", long_prompt(75, 150), MAX_TOKENS
    )


class OneWindowTarget:
    """Forwards to the prefill replica with only the first window target (a decode replica
    that does not send one per rank), noting the error the replica raised."""

    def __init__(self, server: PrefillServer) -> None:
        self.server = server
        self.errors: list[BaseException] = []

    async def prefill(self, req: Any) -> Any:
        try:
            truncated = req.model_copy(update={"window_kv_targets": req.window_kv_targets[:1]})
            return await self.server.prefill(truncated)
        except Exception as err:
            self.errors.append(err)
            raise


def test_window_targets_not_one_per_decode_rank_are_refused(r: Replicas) -> None:
    """One window target for two ranks' full-pool targets is refused before any byte moves,
    and the decode replica recomputes the prompt with the same tokens."""
    prompt = long_prompt(76, 120)
    r.client.server = truncating = OneWindowTarget(r.prefill)
    try:
        chunks = asyncio.run(collect(r.decode, request("tp-mismatch", prompt, MAX_TOKENS)))
    finally:
        r.client.server = r.prefill
    assert chunks[0].prefill_location == "fallback"
    assert tokens(chunks) == expected(r, prompt)
    [error] = truncating.errors
    assert isinstance(error, WindowPairingError)
    assert "1 given for 2 kv_targets" in str(error)
    for server in (r.decode, r.prefill):
        assert integrity(server).idle
