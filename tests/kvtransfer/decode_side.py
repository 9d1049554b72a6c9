"""The decode side of the hand-off tests: a real engine on a shared-memory KV pool with its
receiver, stepping to the end, and the no-leak check both sides end with; and the pairing of
one prefill process with a decode engine per transport."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdserve.kvtransfer import KVTransferConfig
from pdserve.kvtransfer.blocks import pool_layout
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.shm import SharedKVAllocator


def decode_engine(
    model_dir: Path, transport: str, num_blocks: int, kv_cache_dtype: str = "auto"
) -> tuple[Any, KVReceiver, SharedKVAllocator]:
    """A decode-role engine whose pool lives in shared memory, and its receiver offering
    ``transport``. CPU on every host: the shm/gloo transports are the subject here
    (bench.gpu_verify runs the CUDA ones)."""
    from pdserve.engine.llm_engine import LLMEngine

    alloc = SharedKVAllocator()
    engine = LLMEngine.from_pretrained(
        model_dir, kv_cache_allocator=alloc, num_kv_blocks=num_blocks, device="cpu",
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    receiver = KVReceiver(
        engine.kv_cache,
        pool_layout(engine.kv_cache, engine.model_config.kv_identity, kv_scales=engine.kv_scales),
        KVTransferConfig(transport=transport),
        shm_segment=alloc.segment_for(engine.kv_cache),
    )
    return engine, receiver, alloc


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
) -> Iterator[tuple[Any, dict[str, tuple[Any, KVReceiver, SharedKVAllocator]]]]:
    """A spawned prefill process ``target(child_pipe, *args)`` and a decode engine on each
    of the shm and torch_dist transports: yields (the parent pipe, the decoders by
    transport). On a clean exit the process is told to stop (``None``) and must exit 0;
    in every case it is killed if still alive and the decoders' receivers and pools close."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    decoders: dict[str, tuple[Any, KVReceiver, SharedKVAllocator]] = {}
    try:
        for transport in ("shm", "torch_dist"):
            decoders[transport] = decode_engine(model_dir, transport, num_blocks, kv_cache_dtype)
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
