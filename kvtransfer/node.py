"""Where this process runs: node identity and the automatic transport choice."""

from __future__ import annotations

import socket
from pathlib import Path

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


def receiver_offer(configured: str, device: str, has_shm_pool: bool) -> TransportName:
    """What a decode pool offers: the configured transport, or the automatic choice."""
    if configured != "auto":
        return configured  # type: ignore[return-value]
    if device == "cuda":
        return "cuda_ipc"
    return "shm" if has_shm_pool else "torch_dist"


def sender_choice(
    configured: str, offered: TransportName, same_node: bool, device: str
) -> TransportName:
    """What a prefill side uses for a target: zero-copy on the same node, else torch_dist."""
    if configured not in ("auto", offered) and configured != "torch_dist":
        raise ValueError(
            f"transport: sender is configured for {configured!r} but the target offers "
            f"{offered!r} (only 'torch_dist' may be forced instead)"
        )
    if configured == "torch_dist" or not same_node:
        return "torch_dist"
    if offered == "cuda_ipc" and device != "cuda":
        return "torch_dist"
    return offered
