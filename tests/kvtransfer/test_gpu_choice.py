"""Transport choice between GPU pools on one node, with fabricated device maps (no CUDA):
CUDA IPC only where the decode pool's GPU is visible to the sender, found by UUID or PCI
bus id whatever its index there; NCCL (torch_dist) otherwise. And the IPC unmap race: a
dropped peer's mapping is closed only after the copy in flight finished."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pdserve.kvtransfer import gpu_ids, transport_direct
from pdserve.kvtransfer.gpu_ids import GpuId
from pdserve.kvtransfer.node import receiver_offer, sender_choice
from pdserve.kvtransfer.send_handle import SendHandle
from pdserve.kvtransfer.tp_plan import HeadSlice
from tests.kvtransfer.procs import LAYOUT

NODE = [  # the node's four GPUs, as nvidia-smi lists them
    GpuId("GPU-aaaa", "0000:18:00.0"),
    GpuId("GPU-bbbb", "0000:3b:00.0"),
    GpuId("GPU-cccc", "0000:86:00.0"),
    GpuId("GPU-dddd", "0000:af:00.0"),
]


def choose(sender_sees: list[GpuId], receiver_gpu: str, *, ipc_capable: bool = True) -> str:
    local = gpu_ids.local_index(receiver_gpu, sender_sees)
    return sender_choice(
        "auto", "cuda_ipc", True, "cuda", peer_gpu_local=local, ipc_capable=ipc_capable
    )


def test_ray_replicas_see_only_their_own_gpu_so_ipc_across_gpus_falls_back_to_nccl() -> None:
    # Prefill got CUDA_VISIBLE_DEVICES=1, decode =2: both call their GPU cuda:0.
    prefill_sees, decode_sees = [NODE[1]], [NODE[2]]
    decode_gpu = gpu_ids.gpu_key(0, decode_sees)
    assert decode_gpu == "GPU-cccc"
    assert gpu_ids.local_index(decode_gpu, prefill_sees) is None  # index 0 is another card
    assert choose(prefill_sees, decode_gpu) == "torch_dist"


def test_same_gpu_or_a_visible_one_uses_ipc_at_the_senders_own_index() -> None:
    # Two engines sharing one GPU (each sees only it): IPC on local index 0.
    assert choose([NODE[2]], gpu_ids.gpu_key(0, [NODE[2]])) == "cuda_ipc"
    # A sender that sees every GPU maps decode's cuda:0 (= GPU-dddd) at its own index 3.
    decode_gpu = gpu_ids.gpu_key(0, [NODE[3]])
    assert gpu_ids.local_index(decode_gpu, NODE) == 3
    assert choose(NODE, decode_gpu) == "cuda_ipc"
    # By PCI bus id too (a target from a peer without UUIDs), case-insensitively.
    assert gpu_ids.local_index("0000:AF:00.0", NODE) == 3


def test_no_cupy_or_no_gpu_identity_means_nccl() -> None:
    assert choose(NODE, "GPU-aaaa", ipc_capable=False) == "torch_dist"
    assert gpu_ids.local_index(None, NODE) is None
    assert receiver_offer("auto", "cuda", False, ipc_capable=False) == "torch_dist"
    assert receiver_offer("auto", "cuda", False, ipc_capable=True) == "cuda_ipc"
    with pytest.raises(ValueError, match="not visible"):
        gpu_ids.gpu_key(1, [NODE[0]])


def test_cuda_ipc_send_needs_the_peer_gpu() -> None:
    from pdserve.kvtransfer.config import KVTransferConfig
    from pdserve.kvtransfer.node import send_transport

    with pytest.raises(ValueError, match="visible"):
        send_transport("cuda_ipc", KVTransferConfig(), peer_gpu_local=None)
    assert send_transport("cuda_ipc", KVTransferConfig(), peer_gpu_local=3).device == 3


class _Mapping:
    """Stands in for cuda_ipc.MappedPool: records the order of events."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.copy_stream = SimpleNamespace(synchronize=lambda: events.append("sync"))

    def close(self) -> None:
        self.events.append("unmap")


def test_dropping_an_ipc_peer_waits_for_the_copy_in_flight(monkeypatch) -> None:
    events: list[str] = []
    copying = threading.Event()

    def slow_copy(src, src_ids, dst, dst_ids, scratch=None) -> None:
        copying.set()
        time.sleep(0.2)  # a slow copy is the behaviour under test, not synchronization
        dst[:, dst_ids[0]] = src[:, src_ids[0]]
        events.append("copied")

    monkeypatch.setattr(transport_direct.blocks, "copy_blocks", slow_copy)
    send = transport_direct.CudaIpcSend(0)
    send.mapping = _Mapping(events)
    send.pool = torch.zeros(LAYOUT.num_layers, 2, 4, 4, 2, 8)
    target = SimpleNamespace(request_id="r", layout=LAYOUT)
    heads = HeadSlice(first_head=0, num_heads=LAYOUT.num_kv_heads, src_start=0, dst_start=0)
    handle = SendHandle(target=target, src_block_ids=[1], heads=heads)  # type: ignore[arg-type]
    handle.dst_block_ids = [2]
    channel = SimpleNamespace(send=lambda msg: events.append("announced"))
    src = torch.ones(2, 4, 4, 2, 8)
    writer = threading.Thread(target=send.write_layer, args=(handle, 0, src, None, channel))
    writer.start()
    assert copying.wait(5)
    send.close()  # the peer is dropped while its copy runs
    writer.join(5)
    assert [e for e in events if e != "announced"] == ["copied", "sync", "unmap"]
    assert send.pool is None
    # A layer queued after the drop is not written into the unmapped pool.
    assert send.write_layer(handle, 1, src, None, channel) is False


def test_an_nccl_pair_is_built_to_survive_its_peer(monkeypatch) -> None:
    """The pair's group is built with the communicator-abort policy in force (torch reads
    it at construction), never torch's default teardown, and is aborted on shutdown."""
    import torch.distributed as dist

    from pdserve.kvtransfer import torchdist

    for key in torchdist.NCCL_SURVIVE_ENV:
        monkeypatch.setenv(key, "1")
    seen: dict[str, str] = {}

    class FakeNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, opts) -> None:
            import os

            seen.update({k: os.environ[k] for k in torchdist.NCCL_SURVIVE_ENV})
            self.aborted = False

        def abort(self) -> None:
            self.aborted = True

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    group = torchdist.pair_group(object(), 1, "nccl", "127.0.0.1", 1.0)
    assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: abort, no teardown
    assert seen["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    torchdist.shutdown(group, "nccl")
    assert group.aborted
