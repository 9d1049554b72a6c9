"""Which GPUs this process can reach, by identity (UUID, PCI bus id), never by index.

Ray gives each replica only its own GPU in ``CUDA_VISIBLE_DEVICES``, so ``cuda:0`` names a
different card in every process of a node. A peer's pool is reachable over CUDA IPC only if
the card holding it is among the cards this process sees; this module says which local
index that card has here, and nothing else. It imports no CUDA library at import time and
never initialises CUDA unless asked for the local map (``visible_gpus``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuId:
    """One physical GPU: its UUID ('GPU-...') and PCI bus id ('0000:3b:00.0')."""

    uuid: str
    pci_bus_id: str

    def key(self) -> str:
        """The identity sent over the wire: the UUID, else the bus id (never empty)."""
        return self.uuid or self.pci_bus_id


def _uuid_str(raw: object) -> str:
    text = str(raw)
    return text if not text or text.startswith("GPU-") else f"GPU-{text}"


def visible_gpus() -> list[GpuId]:
    """The GPUs this process sees, in local index order (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = (
            f"{getattr(p, 'pci_domain_id', 0):04x}:{getattr(p, 'pci_bus_id', 0):02x}:"
            f"{getattr(p, 'pci_device_id', 0):02x}.0"
        )
        out.append(GpuId(uuid=_uuid_str(getattr(p, "uuid", "")), pci_bus_id=bus))
    return out


def gpu_key(index: int, gpus: list[GpuId] | None = None) -> str:
    """The wire identity of local device ``index``."""
    gpus = visible_gpus() if gpus is None else gpus
    if not 0 <= index < len(gpus):
        raise ValueError(f"device: cuda:{index} is not visible ({len(gpus)} GPUs)")
    return gpus[index].key()


def local_index(key: str | None, gpus: list[GpuId]) -> int | None:
    """Local index of the GPU named ``key`` (UUID or PCI bus id), or None if not visible."""
    if not key:
        return None
    norm = key.lower()
    for i, g in enumerate(gpus):
        if norm in (g.uuid.lower(), g.pci_bus_id.lower()):
            return i
    return None
