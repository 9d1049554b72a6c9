"""The KV control channel trusts only the per-request token, on every message: a second
peer holding a forged token cannot open the request, and its layers for the request that
the real sender has opened (another connection) never land; the real transfer completes
with the real bytes."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kvtransfer import KVTransferRefusedError
from pdserve.kvtransfer.sender import KVSender
from tests.kvtransfer.procs import LAYOUT, make_receiver, source_pool


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_forged_peer_cannot_write_into_an_open_transfer(transport: str) -> None:
    receiver, pool, alloc = make_receiver(LAYOUT, transport, 16)
    real, forger = KVSender(LAYOUT), KVSender(LAYOUT)
    try:
        target = receiver.expect("r", [4, 7], time.time() + 20)
        src, junk = source_pool(LAYOUT, 4, 1), source_pool(LAYOUT, 4, 2)
        handle = real.open(target, [0, 1])
        real.send_layer(handle, 0, src)  # the session is open on the real connection
        forged = forger.open(target.model_copy(update={"token": "B" * 32}), [2, 3])
        for layer in range(LAYOUT.num_layers):
            forger.send_layer(forged, layer, junk)
        with pytest.raises(KVTransferRefusedError):
            forger.finish(forged)
        for layer in range(1, LAYOUT.num_layers):
            real.send_layer(handle, layer, src)
        assert real.finish(handle).ok and receiver.wait("r").ok
        assert torch.equal(pool[:, :, [4, 7]], src[:, :, [0, 1]])
        assert receiver.pending() == []
    finally:
        forger.close()
        real.close()
        receiver.close()
        alloc.close()
