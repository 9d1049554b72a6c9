"""Faults with real processes: a sender that hangs or dies mid-transfer, a receiver that
dies mid-transfer. Deadlines hold, nothing is reported complete, nothing leaks (no pending
requests, no open sends, no shared-memory segment left in /dev/shm)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from pdserve.kvtransfer import KVTarget, KVTransferError, KVTransferTimeoutError
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.shm import list_segments
from tests.kvtransfer.procs import LAYOUT, make_receiver, receiver_main, sender_main, source_pool
from tests.support import wait_until

# The receiver's promise: it raises within 2 s past its deadline.
SLACK_S = 2.0


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_sender_hangs_then_dies_mid_transfer(transport: str) -> None:
    ctx = mp.get_context("spawn")
    receiver, pool, alloc = make_receiver(LAYOUT, transport, 32)
    segment = alloc.segment_for(pool).name
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sender_main, args=(child, LAYOUT.model_dump_json(), 7, 16, 2))
    proc.start()
    try:
        hang = receiver.expect("hang", [3, 1, 20], time.time() + 60)
        die = receiver.expect("die", [9, 30], time.time() + 60)
        parent.send([(hang.model_dump_json(), [5, 0, 9]), (die.model_dump_json(), [2, 14])])
        assert parent.poll(60) and parent.recv() == "partial"
        # Both requests' first 2 layers land (3 and 2 blocks each) before the sender stalls.
        wait_until(
            lambda: (receiver.landed_blocks("hang"), receiver.landed_blocks("die")) == (6, 4),
            timeout=30,
            what="the partial layers to land",
        )

        # The sender is alive but stalled after 2 of 4 layers: wait raises by the deadline.
        deadline = time.time() + 1.0
        # The message says what is missing: every block of the last 2 layers.
        missing = r"missing: blocks \[0, 3\) of layers \[2, 4\)"
        with pytest.raises(KVTransferTimeoutError, match=f"deadline.*{missing}"):
            receiver.wait("hang", deadline=deadline)
        assert time.time() <= deadline + SLACK_S

        # Now it dies: the other request fails long before its own deadline.
        proc.kill()
        start = time.time()
        with pytest.raises(
            KVTransferError, match=r"went away: .*4/8 .*missing: blocks \[0, 2\) of layers \[2, 4\)"
        ):
            receiver.wait("die", deadline=time.time() + 10)
        assert time.time() - start < SLACK_S
        assert receiver.pending() == []
        assert receiver.num_connections() == 0
    finally:
        proc.kill()
        proc.join(10)
        receiver.close()
        alloc.close()
    assert segment not in list_segments()


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_receiver_dies_mid_transfer(transport: str) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, LAYOUT.model_dump_json(), transport, 32))
    proc.start()
    sender = KVSender(LAYOUT)
    try:
        deadline = time.time() + 30
        parent.send(([4, 2, 17], deadline))
        assert parent.poll(60)
        target_json, segment = parent.recv()
        assert segment in list_segments()
        src = source_pool(LAYOUT, 8, 3)
        handle = sender.open(KVTarget.model_validate_json(target_json), [1, 6, 3])
        for layer in range(2):
            sender.send_layer(handle, layer, src)
        # Mid-transfer: the receiver accepted the send and two layers went out to it.
        wait_until(lambda: handle.layers_sent == 2, timeout=30, what="two layers sent")
        proc.kill()
        killed = time.time()
        for layer in range(2, LAYOUT.num_layers):
            sender.send_layer(handle, layer, src)
        with pytest.raises(KVTransferError):
            sender.finish(handle)
        assert time.time() < deadline
        assert time.time() - killed < 5.0  # detected from the dead connection, not the deadline
        assert sender.open_handles() == []
        # The owner's guardian unlinks its segment although the owner was SIGKILLed.
        wait_until(
            lambda: segment not in list_segments(),
            timeout=5,
            interval=0.1,
            what=f"the guardian to unlink {segment}",
        )
    finally:
        proc.kill()
        proc.join(10)
        sender.close()


def test_source_pool_is_deterministic() -> None:
    """The fault and transfer tests rely on both processes building the same source pool."""
    assert torch.equal(source_pool(LAYOUT, 4, 11), source_pool(LAYOUT, 4, 11))
    assert not torch.equal(source_pool(LAYOUT, 4, 11), source_pool(LAYOUT, 4, 12))
