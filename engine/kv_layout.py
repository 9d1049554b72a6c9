"""How each decoder layer's KV looks in the paged cache: heads, key and value head sizes, and
the attention window.

Models describe their layers with ``KVLayerSpec``; the model runner sizes the pool from
the descriptions and the KV hand-off moves whole layers, so both follow from them. Layers
share one pool tensor ``[L, 2, N, B, Hkv, D]``: a value head narrower than its key head
(DeepSeek-V3's 128 next to 192) is stored zero-padded to the key's size. A sliding window
limits what a layer attends; on the native path the window layers of a model that mixes
them with full ones keep only their window, in a second pool (``engine/window_kv.py``),
and elsewhere (a KV connector, tensor parallelism, the transformers path) their KV is kept
whole in the one pool, so the hand-off treats every layer alike. This module never
allocates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayerSpec:
    """One decoder layer's KV in the paged cache."""

    num_kv_heads: int
    key_dim: int
    value_dim: int
    sliding_window: int | None = None  # attends the last this many positions; None: all

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "key_dim", "value_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayerSpec.{name}: must be positive, got {getattr(self, name)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"KVLayerSpec.sliding_window: must be positive, got {self.sliding_window}"
            )

    @property
    def slot_dim(self) -> int:
        """Head size of one cache slot: the wider of key and value."""
        return max(self.key_dim, self.value_dim)


def pool_dims(specs: Sequence[KVLayerSpec], architecture: str) -> tuple[int, int]:
    """``(Hkv, D)`` of the shared pool tensor; ValueError where the layers differ in head
    count (each layer would need its own pool tensor, which the hand-off does not move)."""
    if not specs:
        raise ValueError(f"{architecture}: no attention layers to hold KV for")
    heads = {s.num_kv_heads for s in specs}
    if len(heads) > 1:
        raise ValueError(
            f"architecture {architecture}: layers differ in KV head count ({sorted(heads)}); "
            "pdserve's KV pool holds one head count for every layer"
        )
    return heads.pop(), max(s.slot_dim for s in specs)
