"""Where this process runs: node identity, and the one place a transport is chosen (from
where the two peers are) and built.

``receiver_offer`` is what a decode pool advertises in its ``KVTarget``; ``sender_choice``
what a prefill side uses for a target; ``send_transport`` / ``receive_transports`` build the
``pdserve.kvtransfer.transport`` implementations. Nothing else names a transport.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.shm import ShmSegment
from pdserve.kvtransfer.transport import LandingSite, ReceiveTransport, SendTransport
from pdserve.kvtransfer.transport_direct import CudaIpcReceive, CudaIpcSend, ShmReceive, ShmSend
from pdserve.kvtransfer.transport_torchdist import TorchDistReceive, TorchDistSend
from pdserve.kvtransfer.types import TransportName


def local_node_id(override: str | None = None) -> str:
    """Hostname plus boot id: equal only for processes sharing a kernel and a hostname
    (two containers on one host usually differ in hostname, and in /dev/shm)."""
    if override:
        return override
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def cupy_installed() -> bool:
    """Whether a CuPy wheel (cupy-cuda12x or cupy-cuda13x) is installed, without importing
    it: CuPy is imported only once CUDA IPC is actually chosen for a connection."""
    return importlib.util.find_spec("cupy") is not None


def receiver_offer(
    configured: str, device: str, has_shm_pool: bool, *, ipc_capable: bool = True
) -> TransportName:
    """What a decode pool offers: the configured transport, or the automatic choice
    (CUDA IPC for a CUDA pool when CuPy is installed here, else torch_dist = NCCL)."""
    if configured != "auto":
        return configured  # type: ignore[return-value]
    if device == "cuda":
        return "cuda_ipc" if ipc_capable else "torch_dist"
    return "shm" if has_shm_pool else "torch_dist"


def sender_choice(
    configured: str,
    offered: TransportName,
    same_node: bool,
    device: str,
    *,
    peer_gpu_local: int | None = None,
    ipc_capable: bool = True,
) -> TransportName:
    """What a prefill side uses for a target: zero-copy on the same node, else torch_dist.

    CUDA IPC needs more than a shared host: the decode pool's GPU must be one this process
    sees (``peer_gpu_local``, its local index found by UUID / PCI bus id, see ``gpu_ids``),
    and CuPy must be installed here; otherwise NCCL (torch_dist) carries the KV."""
    if configured not in ("auto", offered) and configured != "torch_dist":
        raise ValueError(
            f"transport: sender is configured for {configured!r} but the target offers "
            f"{offered!r} (only 'torch_dist' may be forced instead)"
        )
    if configured == "torch_dist" or not same_node:
        return "torch_dist"
    if offered == "cuda_ipc" and (device != "cuda" or peer_gpu_local is None or not ipc_capable):
        return "torch_dist"
    return offered


def send_transport(
    name: str, config: KVTransferConfig, *, peer_gpu_local: int | None = None
) -> SendTransport:
    """The prefill side of a new connection using transport ``name`` (not yet opened);
    ``peer_gpu_local`` is this process's index of the decode pool's GPU (CUDA IPC)."""
    if name == "shm":
        return ShmSend()
    if name == "cuda_ipc":
        if peer_gpu_local is None:
            raise ValueError("transport: cuda_ipc needs the peer's GPU to be visible here")
        return CudaIpcSend(peer_gpu_local)
    if name == "torch_dist":
        return TorchDistSend(config)
    raise ValueError(f"transport: unknown {name!r}; expected 'shm', 'cuda_ipc' or 'torch_dist'")


def receive_transports(
    site: LandingSite, shm_segment: ShmSegment | None, offered: TransportName
) -> dict[str, ReceiveTransport]:
    """Every transport a receiver serves, by name: a peer may use another than the offered
    one (torch_dist from another node, or forced). The pool is exported over CUDA IPC only
    when that is the offer, and lazily, when the first peer asks for it (CuPy is imported
    then, and only then)."""
    transports: list[ReceiveTransport] = [
        ShmReceive(site, shm_segment),
        CudaIpcReceive(site, export_pool=offered == "cuda_ipc"),
        TorchDistReceive(site),
    ]
    return {t.name: t for t in transports}
