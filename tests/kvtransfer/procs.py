"""Child-process bodies and shared helpers for the kvtransfer tests (spawned, not forked).

Both sides build their pools from a seed, so a receiver can check byte-identity without the
bytes travelling any other way than through the transport under test.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

import torch

from pdserve.kvtransfer import KVLayout, KVTarget, KVTransferConfig, TransferResult
from pdserve.kvtransfer.connector import PrefillKVConnector
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.shm import SharedKVAllocator
from tests.support import wait_until

LAYOUT = KVLayout(
    model="tiny-test", num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32"
)


def source_pool(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
             layout.head_dim)  # fmt: skip
    return torch.randn(shape, generator=g, dtype=torch.float32).to(getattr(torch, layout.dtype))


def make_receiver(
    layout: KVLayout, transport: str, num_blocks: int
) -> tuple[KVReceiver, torch.Tensor, SharedKVAllocator]:
    """A receiver whose pool lives in shared memory (offered as shm or torch_dist)."""
    alloc = SharedKVAllocator()
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
             layout.head_dim)  # fmt: skip
    pool = alloc(shape, getattr(torch, layout.dtype), "cpu")
    receiver = KVReceiver(
        pool, layout, KVTransferConfig(transport=transport), shm_segment=alloc.segment_for(pool)
    )
    return receiver, pool, alloc


def sender_main(
    conn: Connection, layout_json: str, seed: int, num_blocks: int, stop_after_layers: int | None
) -> None:
    """Prefill side: receive [(target_json, src_ids)], stream all layers (layer-major across
    requests, as the engine does), report results. With ``stop_after_layers`` it sends that
    many layers, says 'partial' and waits to be killed."""
    torch.set_num_threads(1)
    layout = KVLayout.model_validate_json(layout_json)
    src = source_pool(layout, num_blocks, seed)
    sender = KVSender(layout)
    jobs = conn.recv()
    handles = [sender.open(KVTarget.model_validate_json(t), ids) for t, ids in jobs]
    layers = layout.num_layers if stop_after_layers is None else stop_after_layers
    for layer in range(layers):
        for h in handles:
            sender.send_layer(h, layer, src)
    if stop_after_layers is not None:
        conn.send("partial")  # the test waits for those layers to land, on its side
        time.sleep(600)  # stalled, not synchronizing: it stays alive until the test kills it
        os._exit(3)
    results = [sender.finish(h, check=False).model_dump_json() for h in handles]
    conn.send((results, sender.open_handles()))
    sender.close()


def receiver_main(conn: Connection, layout_json: str, transport: str, num_blocks: int) -> None:
    """Decode side that gets killed: expect one request, hand back the target, idle."""
    torch.set_num_threads(1)
    layout = KVLayout.model_validate_json(layout_json)
    receiver, _pool, _alloc = make_receiver(layout, transport, num_blocks)
    block_ids, deadline = conn.recv()
    target = receiver.expect("victim", block_ids, deadline)
    conn.send((target.model_dump_json(), _alloc.segment_for(_pool).name))
    time.sleep(600)  # idle, not synchronizing: it stays alive until the test kills it


def prefill_engine_main(
    conn: Connection,
    model_dir: str,
    num_kv_blocks: int,
    kv_cache_dtype: str = "auto",
    window_pool: bool = False,
    max_num_batched_tokens: int | None = None,
) -> None:
    """Prefill-role engine: for each batch [(request_id, prompt_ids, params_json?, target)]
    add the requests ``prefill_only`` with their targets, step until every send ended, and
    answer [(request_id, first_token_id, transfer_result_json)]. ``None`` ends the loop.
    ``window_pool``: a window model keeps (and sends) its window layers' pool;
    ``max_num_batched_tokens``: the step budget (a small one chunks long prompts)."""
    torch.set_num_threads(1)
    from pdserve.bench.gpu_verify_steps import prefill_batch
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kvtransfer.connector import PrefillKVConnector

    connector: PrefillKVConnector | None = None
    engine = None
    while True:
        batch = conn.recv()
        if batch is None:
            break
        if engine is None:
            # The engine registers its pool with the connector, which builds its sender.
            connector = PrefillKVConnector(window_pool=window_pool)
            # CPU on every host: these tests are about the shm and gloo transports
            # (bench.gpu_verify runs the CUDA ones).
            engine = LLMEngine.from_pretrained(
                model_dir, kv_connector=connector, num_kv_blocks=num_kv_blocks, device="cpu",
                kv_cache_dtype=kv_cache_dtype,
                **({"max_num_batched_tokens": max_num_batched_tokens}
                   if max_num_batched_tokens else {}),
            )  # fmt: skip
        assert connector is not None
        answers = prefill_batch(engine, connector, batch)
        engine.check_integrity()
        stats = engine.stats()
        leaked = stats.num_total_blocks - stats.num_free_blocks
        conn.send((answers, leaked))


def chunked_prefill_main(
    conn: Connection, model_dir: str, num_kv_blocks: int, max_num_batched_tokens: int
) -> None:
    """Prefill-role engine with a small step budget (long prompts are chunked): for each
    ``(request_id, prompt_ids, max_tokens, target_json)`` prefill it, step until its send
    ended, and answer ``(first_token_id, transfer_result_json, step_starts, first_token_step,
    leaked_blocks)``: the wall time each step began and the step that produced the first
    token (the final chunk's). ``None`` ends the loop."""
    torch.set_num_threads(1)
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    connector = PrefillKVConnector()
    engine = LLMEngine.from_pretrained(
        model_dir,
        kv_connector=connector,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        device="cpu",
    )
    while (job := conn.recv()) is not None:
        rid, prompt, max_tokens, target_json = job
        connector.register_target(rid, KVTarget.model_validate_json(target_json))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(rid, prompt, params, prefill_only=True)
        starts: list[float] = []
        first, first_step = None, None
        deadline = time.time() + 60
        while engine.has_pending_work() and time.time() < deadline:
            starts.append(time.time())
            for out in engine.step():
                if out.finished and out.token_ids:
                    first, first_step = out.token_ids[0], len(starts) - 1
            if not engine.has_unfinished_requests():
                time.sleep(0.002)  # poll interval: only the send is left, until it lands
        result = connector.take_result(rid, timeout=10)
        engine.check_integrity()
        stats = engine.stats()
        leaked = stats.num_total_blocks - stats.num_free_blocks
        conn.send((first, result and result.model_dump_json(), starts, first_step, leaked))
    connector.sender.close()


# ---- tensor-parallel replicas: one pool per rank, holding that rank's KV heads ------------


def rank_pool(pool: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Rank ``layout``'s own pool: its heads of the whole model's ``pool``, contiguous."""
    return pool[..., layout.kv_head_start : layout.kv_head_start + layout.num_kv_heads, :].clone()


def prefill_ranks(
    model_layout: KVLayout, tp: int, pool: torch.Tensor
) -> tuple[list[PrefillKVConnector], list[torch.Tensor]]:
    """A TP=``tp`` prefill replica's connectors, each with its rank's pool registered."""
    from pdserve.kvtransfer.tp_plan import rank_layout

    connectors, pools = [], []
    for rank in range(tp):
        layout = rank_layout(model_layout, tp, rank)
        connector = PrefillKVConnector()
        pools.append(rank_pool(pool, layout))
        connector.register_kv_caches(pools[-1], layout.model, layout=layout)
        connectors.append(connector)
    return connectors, pools


def run_prefill_step(
    connectors: list[PrefillKVConnector],
    pools: list[torch.Tensor],
    jobs: list[tuple[str, list[KVTarget], list[int], int]],
    timeout: float = 30.0,
) -> list[dict[str, TransferResult]]:
    """One engine step on every rank: register each request's targets (one per decode
    rank), begin the sends, compute the layers, then poll until every rank reported every
    request; each rank's results by request id."""
    from pdserve.engine.kv_connector import PendingSend

    sends = [PendingSend(rid, src_ids, num_tokens) for rid, _, src_ids, num_tokens in jobs]
    for connector in connectors:
        for rid, targets, _, _ in jobs:
            connector.register_target(rid, targets)
        connector.begin_step(sends)
    for layer in range(pools[0].shape[0]):
        for connector, pool in zip(connectors, pools, strict=True):
            connector.layer_computed(layer, pool)
    seen: list[set[str]] = [set(c.end_step()) for c in connectors]
    want = {rid for rid, *_ in jobs}

    def all_reported() -> bool:
        for connector, s in zip(connectors, seen, strict=True):
            s.update(connector.poll_finished())
        return all(s == want for s in seen)

    wait_until(all_reported, timeout, interval=0.005, what=f"every rank to report {want}")
    results = []
    for connector in connectors:
        got = {rid: connector.take_result(rid, timeout=0) for rid in want}
        results.append({rid: r for rid, r in got.items() if r is not None})
    return results


def tp_prefill_main(conn: Connection, model_layout_json: str, tp: int, seed: int, n: int) -> None:
    """A TP=``tp`` prefill replica in its own process (every rank's connector here): gets
    ``[(request_id, [target_json per decode rank], src_ids, num_tokens)]``, runs the step,
    answers each rank's results as JSON and whether any send is still open."""
    torch.set_num_threads(1)
    model_layout = KVLayout.model_validate_json(model_layout_json)
    connectors, pools = prefill_ranks(model_layout, tp, source_pool(model_layout, n, seed))
    jobs = [
        (rid, [KVTarget.model_validate_json(t) for t in targets], ids, tokens)
        for rid, targets, ids, tokens in conn.recv()
    ]
    results = run_prefill_step(connectors, pools, jobs)
    answer = [{rid: r.model_dump_json() for rid, r in rank.items()} for rank in results]
    conn.send((answer, [c.sender.open_handles() for c in connectors]))
    for connector in connectors:
        connector.sender.close()
