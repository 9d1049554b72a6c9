"""Bad input is refused with a clear error and nothing is written into the decode pool:
layout mismatch, wrong token, unknown request id, block ids out of range, late targets."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.kvtransfer import (
    KVLayoutMismatchError,
    KVTransferConfig,
    KVTransferRefusedError,
)
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.shm import SharedKVAllocator
from tests.kvtransfer.procs import LAYOUT, make_receiver, source_pool


@pytest.fixture(params=["shm", "torch_dist"])
def endpoints(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[KVReceiver, torch.Tensor, KVSender]]:
    receiver, pool, alloc = make_receiver(LAYOUT, request.param, 16)
    sender = KVSender(LAYOUT)
    yield receiver, pool, sender
    sender.close()
    receiver.close()
    alloc.close()


def _send_all(sender: KVSender, handle, src: torch.Tensor) -> None:  # noqa: ANN001
    for layer in range(LAYOUT.num_layers):
        sender.send_layer(handle, layer, src)


def test_layout_mismatch_is_refused_naming_both_sides(endpoints) -> None:  # noqa: ANN001
    receiver, pool, _ = endpoints
    other = LAYOUT.model_copy(update={"head_dim": 16, "dtype": "bfloat16"})
    sender = KVSender(other)
    try:
        target = receiver.expect("r", [1, 2], time.time() + 20)
        src = source_pool(other, 4, 0)
        handle = sender.open(target, [0, 1])
        _send_all(sender, handle, src)
        with pytest.raises(KVLayoutMismatchError) as info:
            sender.finish(handle)
        msg = str(info.value)
        assert "head_dim: local=8 peer=16" in msg
        assert "dtype: local='float32' peer='bfloat16'" in msg
        assert torch.count_nonzero(pool) == 0
        receiver.cancel("r")
        assert receiver.pending() == [] and sender.open_handles() == []
    finally:
        sender.close()


def test_wrong_token_is_refused_and_the_real_sender_still_succeeds(endpoints) -> None:  # noqa: ANN001
    receiver, pool, sender = endpoints
    target = receiver.expect("r", [5, 3], time.time() + 20)
    src = source_pool(LAYOUT, 4, 1)
    forged = target.model_copy(update={"token": "A" * 32})
    handle = sender.open(forged, [0, 1])
    _send_all(sender, handle, src)
    with pytest.raises(KVTransferRefusedError, match="wrong token"):
        sender.finish(handle)
    assert torch.count_nonzero(pool) == 0
    # The refused attempt neither consumed nor broke the expectation.
    handle = sender.open(target, [2, 0])
    _send_all(sender, handle, src)
    assert sender.finish(handle).ok
    assert receiver.wait("r").ok
    assert torch.equal(pool[:, :, [5, 3]], src[:, :, [2, 0]])


def test_unknown_request_id_is_refused(endpoints) -> None:  # noqa: ANN001
    receiver, pool, sender = endpoints
    target = receiver.expect("known", [1], time.time() + 20)
    stranger = target.model_copy(update={"request_id": "unknown"})
    handle = sender.open(stranger, [0])
    _send_all(sender, handle, source_pool(LAYOUT, 2, 2))
    with pytest.raises(KVTransferRefusedError, match="unknown request id 'unknown'"):
        sender.finish(handle)
    assert torch.count_nonzero(pool) == 0
    receiver.cancel("known")
    assert receiver.pending() == []


def test_block_ids_out_of_range(endpoints) -> None:  # noqa: ANN001
    receiver, pool, sender = endpoints
    with pytest.raises(ValueError, match=r"block_ids: \[16, 99\] out of range"):
        receiver.expect("r", [0, 16, 99], time.time() + 20)
    with pytest.raises(ValueError, match="block_ids: contains duplicates"):
        receiver.expect("r", [2, 2], time.time() + 20)
    with pytest.raises(ValueError, match="deadline"):
        receiver.expect("r", [2], time.time() - 1)
    assert receiver.pending() == []
    # A source block beyond the sender's own pool is refused before anything moves.
    target = receiver.expect("r", [1, 2], time.time() + 20)
    handle = sender.open(target, [0, 40])
    _send_all(sender, handle, source_pool(LAYOUT, 4, 3))
    with pytest.raises(KVTransferRefusedError, match="src_block_ids: 40 out of range"):
        sender.finish(handle)
    receiver.cancel("r")
    assert torch.count_nonzero(pool) == 0
    assert receiver.pending() == [] and sender.open_handles() == []


def test_receiver_refuses_shm_without_a_shared_pool() -> None:
    pool = torch.zeros(LAYOUT.num_layers, 2, 4, LAYOUT.block_size, 2, 8)
    with pytest.raises(ValueError, match="shm_segment"):
        KVReceiver(pool, LAYOUT, KVTransferConfig(transport="shm"))
    # auto picks torch_dist for a private CPU pool, shm for a shared one
    receiver = KVReceiver(pool, LAYOUT)
    assert receiver.transport == "torch_dist"
    receiver.close()
    alloc = SharedKVAllocator()
    shared = alloc(tuple(pool.shape), torch.float32, "cpu")
    receiver = KVReceiver(shared, LAYOUT, shm_segment=alloc.segment_for(shared))
    assert receiver.transport == "shm"
    receiver.close()
    alloc.close()


def test_pool_not_matching_layout_is_rejected() -> None:
    with pytest.raises(ValueError, match="kv_cache: shape"):
        KVReceiver(torch.zeros(2, 2, 4, 4, 2, 8), LAYOUT)
    with pytest.raises(ValueError, match="kv_cache: dtype"):
        KVReceiver(torch.zeros(4, 2, 4, 4, 2, 8, dtype=torch.float16), LAYOUT)
