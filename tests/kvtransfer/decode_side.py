"""The decode side of the hand-off tests: a real engine on a shared-memory KV pool with its
receiver, stepping to the end, and the no-leak check both sides end with; and the pairing of
one prefill process with a decode engine per transport."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.kvtransfer import KVTransferConfig
from pdserve.kvtransfer.blocks import pool_layout
from pdserve.kvtransfer.connector import window_identity
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.shm import SharedKVAllocator
from pdserve.kvtransfer.types import TransferResult

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pdserve.engine.sampling_params import SamplingParams


@dataclass
class WindowReceivers:
    """A window-pool decode engine's two receivers: its full layers' pool's and its window
    pool's (which gets only the blocks of the first decoded token's window)."""

    full: KVReceiver
    window: KVReceiver

    def pending(self) -> list[str]:
        return self.full.pending() + self.window.pending()

    def close(self) -> None:
        self.full.close()
        self.window.close()


def decode_engine(
    model_dir: Path,
    transport: str,
    num_blocks: int,
    kv_cache_dtype: str = "auto",
    window_pool: bool = False,
) -> tuple[Any, Any, SharedKVAllocator]:
    """A decode-role engine whose pool lives in shared memory, and its receiver offering
    ``transport``. CPU on every host: the shm/gloo transports are the subject here
    (bench.gpu_verify runs the CUDA ones). Without ``window_pool`` the receiver fills one
    pool of every layer, so a window model's engine keeps its window layers there too;
    with it the engine keeps its window pool and the receiver is a ``WindowReceivers``."""
    from pdserve.engine.llm_engine import LLMEngine

    alloc = SharedKVAllocator()
    engine = LLMEngine.from_pretrained(
        model_dir, kv_cache_allocator=alloc, num_kv_blocks=num_blocks, device="cpu",
        kv_cache_dtype=kv_cache_dtype, window_kv_pool=window_pool,
    )  # fmt: skip
    config = KVTransferConfig(transport=transport)
    receiver = KVReceiver(
        engine.kv_cache,
        pool_layout(engine.kv_cache, engine.model_config.kv_identity, kv_scales=engine.kv_scales),
        config,
        shm_segment=alloc.segment_for(engine.kv_cache),
    )
    if not window_pool:
        return engine, receiver, alloc
    assert engine.window_layout is not None, "not a model that mixes window and full layers"
    pool = engine.window_kv_cache
    identity = window_identity(engine.model_config.kv_identity, engine.window_layout.window)
    layout = pool_layout(pool, identity, kv_scales=engine.window_kv_scales)
    window = KVReceiver(pool, layout, config, shm_segment=alloc.segment_for(pool))
    return engine, WindowReceivers(receiver, window), alloc


def hand_off(
    parent: Any,
    engine: Any,
    receiver: KVReceiver | WindowReceivers,
    prompts: dict[str, list[int]],
    params: SamplingParams,
    transport: str,
) -> dict[str, tuple[int, TransferResult]]:
    """Reserve the prompts on the decode engine, have the prefill process (``parent``, as
    ``procs.prefill_engine_main``) send their KV, check every transfer landed and complete
    the remote prefills; returns each request's reserved blocks and transfer result."""
    batch: list[tuple[str, list[int], int | None, str | tuple[str, str]]] = []
    blocks_of = {}
    windowed = isinstance(receiver, WindowReceivers)
    for rid, prompt in prompts.items():
        blocks = engine.reserve_remote_prefill(rid, prompt, params, receives_window_pool=windowed)
        assert blocks is not None
        blocks_of[rid] = len(blocks)
        if not windowed:
            target = receiver.expect(rid, blocks, time.time() + 90, num_tokens=len(prompt))
            batch.append((rid, prompt, params.max_tokens, target.model_dump_json()))
            continue
        first, window_blocks = engine.remote_window_blocks(rid)
        deadline = time.time() + 90
        full = receiver.full.expect(rid, blocks, deadline, num_tokens=len(prompt))
        window = receiver.window.expect(
            rid, window_blocks, deadline, num_tokens=len(prompt), first_block=first
        )
        targets = (full.model_dump_json(), window.model_dump_json())
        batch.append((rid, prompt, params.max_tokens, targets))
    parent.send(batch)
    assert parent.poll(180), "prefill process did not answer"
    answers, prefill_leaked = parent.recv()
    assert prefill_leaked == 0
    results = {}
    for rid, first, result_json in answers:
        result = TransferResult.model_validate_json(result_json)
        assert first is not None and result.ok, (transport, result_json)
        if windowed:
            assert receiver.full.wait(rid).ok and receiver.window.wait(rid).ok
        else:
            assert receiver.wait(rid).ok
        engine.complete_remote_prefill(rid, first)
        results[rid] = (blocks_of[rid], result)
    return results


def decode_all(engine: Any) -> dict[str, list[int]]:
    """Step until every request finished; their token ids."""
    final: dict[str, list[int]] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.token_ids)
    return final


def assert_no_leak(engine: Any) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@contextmanager
def prefill_process_and_decoders(
    target: Callable[..., None],
    args: tuple,
    model_dir: Path,
    num_blocks: int,
    kv_cache_dtype: str = "auto",
    window_pool: bool = False,
) -> Iterator[tuple[Any, dict[str, tuple[Any, Any, SharedKVAllocator]]]]:
    """A spawned prefill process ``target(child_pipe, *args)`` and a decode engine on each
    of the shm and torch_dist transports: yields (the parent pipe, the decoders by
    transport). On a clean exit the process is told to stop (``None``) and must exit 0;
    in every case it is killed if still alive and the decoders' receivers and pools close."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    decoders: dict[str, tuple[Any, Any, SharedKVAllocator]] = {}
    try:
        for transport in ("shm", "torch_dist"):
            decoders[transport] = decode_engine(
                model_dir, transport, num_blocks, kv_cache_dtype, window_pool
            )
        yield parent, decoders
        parent.send(None)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        for _, receiver, alloc in decoders.values():
            receiver.close()
            alloc.close()
