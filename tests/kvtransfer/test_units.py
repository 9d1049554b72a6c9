"""Unit tests: block copies against a per-block reference, transport choice, typed
messages and configs, the control-channel framing and the metrics observer."""

from __future__ import annotations

import random
import socket
import struct
import time

import pydantic
import pytest
import torch

from pdserve.kvtransfer import KVLayout, KVTransferConfig, blocks, wire
from pdserve.kvtransfer.metrics import TransferStats
from pdserve.kvtransfer.node import receiver_offer, sender_choice
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.staging import Scratch
from tests.kvtransfer.procs import LAYOUT, make_receiver, source_pool


def _reference_copy(src, src_ids, dst, dst_ids):  # noqa: ANN001, ANN202
    for s, d in zip(src_ids, dst_ids, strict=True):
        dst[..., d, :, :, :] = src[..., s, :, :, :]


@pytest.mark.parametrize("shape", [(4, 2, 8), (1, 1, 3)])  # (1, 1, 3) fp16: 6-byte rows
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("pattern", ["random", "runs", "single", "gather", "scatter"])
@pytest.mark.parametrize("lead", [(2,), (3, 2)])
def test_copy_blocks_matches_per_block_reference(
    pattern: str, lead: tuple[int, ...], strided: bool, shape: tuple[int, int, int]
) -> None:
    rng = random.Random(hash((pattern, lead, strided, shape)) & 0xFFFF)
    dtype = torch.float16 if shape == (1, 1, 3) else torch.float32
    src = torch.randn(*lead, 20, *shape).to(dtype)
    if strided:  # a non-contiguous source takes the per-run strided path
        src = torch.randn(*lead, 20, *shape[:-1], 2 * shape[-1]).to(dtype)[..., ::2]
    if pattern == "random":  # scattered on both sides: index_select + index_copy_
        src_ids, dst_ids = rng.sample(range(20), 9), rng.sample(range(30), 9)
    elif pattern == "runs":  # two runs: one copy per run
        src_ids, dst_ids = [3, 4, 5, 11, 12], [20, 21, 22, 0, 1]
    elif pattern == "single":
        src_ids, dst_ids = [7], [29]
    elif pattern == "gather":  # into consecutive destination blocks
        src_ids, dst_ids = rng.sample(range(20), 9), list(range(4, 13))
    else:  # "scatter": out of consecutive source blocks
        src_ids, dst_ids = list(range(2, 11)), rng.sample(range(30), 9)
    got = torch.zeros(*lead, 30, *shape, dtype=dtype)
    want = torch.zeros_like(got)
    blocks.copy_blocks(src, src_ids, got, dst_ids, Scratch() if pattern == "random" else None)
    _reference_copy(src, src_ids, want, dst_ids)
    assert torch.equal(got, want)


def test_copy_blocks_rejects_mismatched_pools() -> None:
    with pytest.raises(ValueError, match="shapes"):
        blocks.copy_blocks(torch.zeros(2, 4, 4, 2, 8), [0], torch.zeros(2, 4, 4, 2, 4), [0])
    with pytest.raises(ValueError, match="dtypes"):
        blocks.copy_blocks(
            torch.zeros(2, 4, 4, 2, 8), [0], torch.zeros(2, 4, 4, 2, 8, dtype=torch.float16), [0]
        )


def test_runs_coalesce_only_when_both_sides_advance() -> None:
    assert blocks.runs([3, 4, 5, 9], [7, 8, 9, 10]) == [(3, 7, 3), (9, 10, 1)]
    assert blocks.runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]


def test_transport_choice() -> None:
    assert receiver_offer("auto", "cpu", has_shm_pool=True) == "shm"
    assert receiver_offer("auto", "cpu", has_shm_pool=False) == "torch_dist"
    assert receiver_offer("auto", "cuda", has_shm_pool=False) == "cuda_ipc"
    assert receiver_offer("torch_dist", "cpu", has_shm_pool=True) == "torch_dist"
    assert sender_choice("auto", "shm", same_node=True, device="cpu") == "shm"
    assert sender_choice("auto", "shm", same_node=False, device="cpu") == "torch_dist"
    assert (
        sender_choice("auto", "cuda_ipc", same_node=True, device="cuda", peer_gpu_local=0)
        == "cuda_ipc"
    )
    assert sender_choice("torch_dist", "shm", same_node=True, device="cpu") == "torch_dist"
    with pytest.raises(ValueError, match="transport"):
        sender_choice("cuda_ipc", "shm", same_node=True, device="cpu")


def test_each_transport_is_built_behind_one_interface() -> None:
    """node.py builds every transport; a CPU receiver serves all three by name, exports its
    pool over CUDA IPC only when that is its offer, and never imports CuPy otherwise."""
    import sys

    from pdserve.kvtransfer.node import send_transport
    from pdserve.kvtransfer.transport import ReceiveTransport, SendTransport

    for name in ("shm", "cuda_ipc", "torch_dist"):
        built = send_transport(name, KVTransferConfig(), peer_gpu_local=0)
        assert built.name == name
        assert isinstance(built, SendTransport)
    with pytest.raises(ValueError, match="transport: unknown 'nvlink'"):
        send_transport("nvlink", KVTransferConfig())
    receiver, _pool, alloc = make_receiver(LAYOUT, "shm", 4)
    try:
        served = receiver._transports
        assert sorted(served) == ["cuda_ipc", "shm", "torch_dist"]
        assert all(isinstance(t, ReceiveTransport) for t in served.values())
        assert served["cuda_ipc"].handle is None
    finally:
        receiver.close()
        alloc.close()
    assert "cupy" not in sys.modules


def test_sender_and_its_peers_do_not_import_each_other() -> None:
    """Not even for typing: a peer knows its sender through the PeerOwner protocol."""
    import ast
    import inspect

    from pdserve.kvtransfer import sender_peer, transport, transport_direct, transport_torchdist

    for module in (sender_peer, transport, transport_direct, transport_torchdist):
        tree = ast.parse(inspect.getsource(module))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "pdserve.kvtransfer.sender" not in imported, module.__name__


def test_layout_mismatch_names_both_values() -> None:
    other = LAYOUT.model_copy(update={"block_size": 16, "model": "other"})
    msg = LAYOUT.mismatch(other)
    assert msg == "model: local='tiny-test' peer='other'; block_size: local=4 peer=16"
    assert LAYOUT.mismatch(LAYOUT) is None
    assert LAYOUT.block_bytes() == 2 * 4 * 2 * 8 * 4


def test_configs_and_messages_are_strict() -> None:
    with pytest.raises(pydantic.ValidationError):
        KVTransferConfig(transprt="shm")  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError):
        KVTransferConfig(transport="rdma")  # type: ignore[arg-type]
    with pytest.raises(pydantic.ValidationError):
        KVLayout(model="m", num_layers=0, num_kv_heads=1, head_dim=1, block_size=1, dtype="x")
    with pytest.raises(pydantic.ValidationError):
        wire.Layer(
            request_id="r", layer=0, nbytes=1, head_start=0, num_heads=1, num_blocks=1, extra=1
        )  # type: ignore[call-arg]


def test_channel_frames_messages_and_reports_eof() -> None:
    a, b = socket.socketpair()
    left, right = wire.Channel(a), wire.Channel(b)
    left.send(
        wire.Layer(
            request_id="r",
            layer=3,
            nbytes=64,
            head_start=2,
            num_heads=1,
            block_start=5,
            num_blocks=2,
            seq=9,
        )
    )
    msg = right.recv()
    assert isinstance(msg, wire.Layer) and (msg.layer, msg.nbytes, msg.seq) == (3, 64, 9)
    assert (msg.head_start, msg.num_heads, msg.block_start, msg.num_blocks) == (2, 1, 5, 2)
    a.sendall(struct.pack("!I", wire.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(ConnectionError, match="exceeds"):
        right.recv()
    left.close()
    assert right.recv() is None
    right.close()


def test_observer_sees_bytes_and_failures_on_both_sides() -> None:
    stats = TransferStats()
    receiver, pool, alloc = make_receiver(LAYOUT, "shm", 8)
    receiver._observer = stats
    sender = KVSender(LAYOUT, observer=stats)
    try:
        src = source_pool(LAYOUT, 4, 5)
        handle = sender.open(receiver.expect("ok", [1, 2], time.time() + 20), [3, 0])
        for layer in range(LAYOUT.num_layers):
            sender.send_layer(handle, layer, src)
        assert sender.finish(handle).ok and receiver.wait("ok").ok
        receiver.expect("late", [4], time.time() + 0.2)
        with pytest.raises(TimeoutError):
            receiver.wait("late")
    finally:
        sender.close()
        receiver.close()
        alloc.close()
    nbytes = LAYOUT.num_layers * 2 * LAYOUT.block_bytes()
    sent, received = stats.totals("send"), stats.totals("recv")
    assert (sent.transfers, sent.failures, sent.bytes) == (1, 0, nbytes)
    assert (received.transfers, received.failures, received.bytes) == (2, 1, nbytes)


def test_stale_segments_are_swept_and_live_ones_kept() -> None:
    import _posixshmem
    import os

    from pdserve.kvtransfer.shm import (
        SEGMENT_PREFIX,
        ShmSegment,
        list_segments,
        sweep_stale_segments,
    )

    dead = f"{SEGMENT_PREFIX}{2**22 + 7}-1-feedfacecafe"  # above Linux's pid_max: never alive
    recycled = f"{SEGMENT_PREFIX}{os.getpid()}-1-feedfacecafe"  # our pid, wrong start time
    live = ShmSegment.create(4096)
    for name in (dead, recycled):
        os.close(_posixshmem.shm_open("/" + name, os.O_CREAT | os.O_RDWR, mode=0o600))
    try:
        assert live.name in list_segments() and live.name.count("-") == 4
        removed = sweep_stale_segments()
        assert dead in removed and recycled in removed
        assert live.name in list_segments()
    finally:
        live.close()
    assert live.name not in list_segments()


def test_guardian_unlinks_when_terminated() -> None:
    import signal

    from pdserve.kvtransfer.shm import ShmSegment, list_segments

    seg = ShmSegment.create(4096)
    assert seg._guardian is not None
    seg._guardian.send_signal(signal.SIGTERM)
    seg._guardian.wait(10)
    assert seg.name not in list_segments()
    seg.close()  # the owner's own unlink finds nothing; no error
