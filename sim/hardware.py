"""Datasheet numbers the roofline cost model needs: GPUs, links and Llama-3 model shapes.

Peak numbers are dense (no sparsity) BF16 tensor FLOP/s and HBM bandwidth of the SXM parts
(PCIe for L4); the cost model applies achievable fractions on top. Link bandwidths are per
direction, per GPU pair, as one prefill GPU sees its decode peer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_flops: float  # dense tensor-core peak, FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float  # per direction; 0 = none (PCIe only)


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bytes_per_s: float  # per direction
    latency_s: float  # one message's fixed cost (RDMA/TCP setup amortised per layer message)


@dataclass(frozen=True)
class ModelShape:
    """A dense Llama-family decoder (GQA)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: int = 2  # bf16 weights and KV cache

    @property
    def params(self) -> int:
        h, kv = self.hidden, self.num_kv_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2  # q, o and k, v projections
        mlp = 3 * h * self.intermediate
        return self.num_layers * (attn + mlp) + 2 * self.vocab * h  # untied embed + lm head

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies by (the embedding is a lookup)."""
        return self.params - self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_param


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("H100-SXM-80GB", 989e12, 3.35e12, 80e9, 450e9),
    "h200": GPUSpec("H200-SXM-141GB", 989e12, 4.8e12, 141e9, 450e9),
    "a100": GPUSpec("A100-SXM-80GB", 312e12, 2.039e12, 80e9, 300e9),
    "l4": GPUSpec("L4-24GB", 121e12, 0.3e12, 24e9, 0.0),
}

LINKS: dict[str, LinkSpec] = {
    "nvlink": LinkSpec("NVLink (same node)", 450e9, 5e-6),
    "infiniband": LinkSpec("InfiniBand NDR 400 Gb/s", 50e9, 5e-6),
    "ethernet": LinkSpec("Ethernet 100 Gb/s (TCP)", 12.5e9, 50e-6),
}

MODELS: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
}


T = TypeVar("T")


def lookup(table: Mapping[str, T], key: str, what: str) -> T:
    """``table[key]`` with a ValueError that names the bad key and the choices."""
    try:
        return table[key.lower()]
    except KeyError:
        raise ValueError(f"unknown {what} {key!r}; choose from {sorted(table)}") from None
