"""Chunk-by-chunk sends through the connector, without a model: tensor-parallel head slices
and block subsets together, block-level accounting on the receiver (nothing completes
before the last block of every layer of every head landed; a block sent twice fails the
request), and what the connector does with chunks out of order."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.kv_connector import PendingSend
from pdserve.kvtransfer import KVLayout, KVTransferError
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.tp_plan import rank_layout
from tests.kvtransfer.procs import LAYOUT, make_receiver, prefill_ranks, rank_pool, source_pool
from tests.support import wait_until

MODEL = KVLayout(
    model="tiny-chunks", num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, dtype="float32"
)
SRC = [9, 2, 11, 5, 0, 7, 3]  # the prefill engine's blocks, in prompt order
DST = [4, 12, 1, 8, 6, 14, 10]  # the decode pool's reservation
TOKENS = 6 * 4 + 3  # the last block is partly filled
CHUNKS = [(0, 3), (3, 5), (5, 7)]  # blocks each step completes: the last one is final


def _poll(connectors, want: set[str], timeout: float = 30.0) -> None:
    """Poll every connector the way the engine does until each reported ``want``."""
    seen = [set() for _ in connectors]

    def all_reported() -> bool:
        for connector, s in zip(connectors, seen, strict=True):
            s.update(connector.poll_finished())
        return all(s == want for s in seen)

    wait_until(all_reported, timeout, interval=0.005, what=f"every rank to report {want}")


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
@pytest.mark.parametrize(("a", "b"), [(2, 1), (1, 2), (2, 2)])
def test_tp_ranks_send_their_heads_chunk_by_chunk(transport: str, a: int, b: int) -> None:
    source = source_pool(MODEL, 16, seed=5)
    connectors, pools = prefill_ranks(MODEL, a, source)
    decode = [make_receiver(rank_layout(MODEL, b, r), transport, 16) for r in range(b)]
    try:
        deadline = time.time() + 30
        targets = [r.expect("c", DST, deadline, num_tokens=TOKENS) for r, _, _ in decode]
        for connector in connectors:
            connector.register_target("c", targets)
        for step, (start, stop) in enumerate(CHUNKS):
            final = stop == len(SRC)
            send = PendingSend("c", SRC[start:stop], TOKENS, block_offset=start, final=final)
            for connector in connectors:
                connector.begin_step([send])
            for layer in range(MODEL.num_layers):
                for connector, pool in zip(connectors, pools, strict=True):
                    connector.layer_computed(layer, pool)
            for connector in connectors:
                assert "c" not in connector.end_step()  # never within the step that sent
            if not final:
                # This chunk's blocks land while the next is computed; the request is not
                # complete before its last block: nothing reports it, every rank waits.
                want = MODEL.num_layers * stop * _shares(a, b)  # (layer, block) pairs
                for receiver, _, _ in decode:
                    wait_until(
                        lambda r=receiver, w=want: r.landed_blocks("c") == w,
                        timeout=10,
                        interval=0.002,
                        what=f"step {step}'s {want} (layer, block) pairs to land",
                    )
                assert all(c.poll_finished() == [] for c in connectors)
        _poll(connectors, {"c"})
        results = [c.take_result("c", timeout=0) for c in connectors]
        assert all(r is not None and r.ok for r in results), results
        # One message per layer per step per send (coalesced over the step's blocks).
        sends_per_rank = max(1, b // a)  # decode ranks holding a prefill rank's heads
        assert [r.layer_messages for r in results] == [
            sends_per_rank * len(CHUNKS) * MODEL.num_layers
        ] * a
        for receiver, pool, _ in decode:
            landed = receiver.wait("c")
            assert landed.ok
            assert landed.layer_messages == len(CHUNKS) * MODEL.num_layers * _shares(a, b)
            want = rank_pool(source, receiver.layout)[:, :, SRC]
            assert torch.equal(pool[:, :, DST], want)
            assert receiver.pending() == []
        assert all(c.sender.open_handles() == [] for c in connectors)
    finally:
        for connector in connectors:
            connector.sender.close()
        for receiver, _, alloc in decode:
            receiver.close()
            alloc.close()


def _shares(a: int, b: int) -> int:
    """Prefill ranks sending into one decode rank's pool (4 heads, no replicas here)."""
    return max(1, a // b)


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_a_block_sent_twice_for_the_same_heads_fails_the_request(transport: str) -> None:
    receiver, _, alloc = make_receiver(LAYOUT, transport, 8)
    sender = KVSender(LAYOUT)
    try:
        target = receiver.expect("twice", [1, 2, 3], time.time() + 30)
        src = source_pool(LAYOUT, 8, seed=1)
        handle = sender.open(target, [4, 5])
        sender.send_layer(handle, 0, src, range(0, 2))
        sender.send_layer(handle, 0, src, range(1, 2))  # block 1 of layer 0 again
        with pytest.raises(KVTransferError, match=r"layer 0 .*blocks \[1\] .*sent twice"):
            receiver.wait("twice")
        sender.finish(handle, check=False)
        assert receiver.pending() == [] and sender.open_handles() == []
    finally:
        sender.close()
        receiver.close()
        alloc.close()


def test_chunks_out_of_order_end_the_transfer_and_tell_the_decode_side() -> None:
    source = source_pool(MODEL, 16, seed=6)
    (connector,), (pool,) = prefill_ranks(MODEL, 1, source)
    receiver, _, alloc = make_receiver(MODEL, "shm", 16)
    try:
        target = receiver.expect("gap", DST, time.time() + 30, num_tokens=TOKENS)
        connector.register_target("gap", target)
        sends = [
            PendingSend("gap", SRC[:3], TOKENS, final=False),
            PendingSend("gap", SRC[4:7], TOKENS, block_offset=4, final=True),  # skips block 3
        ]
        for send in sends:
            connector.begin_step([send])
            for layer in range(MODEL.num_layers):
                connector.layer_computed(layer, pool)
            connector.end_step()
        _poll([connector], {"gap"})
        result = connector.take_result("gap", timeout=0)
        assert result is not None and not result.ok
        assert "blocks from 4 announced, but 3 were sent before" in (result.error or "")
        with pytest.raises(
            KVTransferError, match=r"aborted the transfer.*missing: blocks \[3, 7\)"
        ):
            receiver.wait("gap")
        assert connector.sender.open_handles() == [] and receiver.pending() == []
    finally:
        connector.sender.close()
        receiver.close()
        alloc.close()
