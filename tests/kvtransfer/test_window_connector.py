"""PrefillKVConnector with a window pool: it needs ``window_pool=True``, every request then
needs a window target too (and only then), and the window pool is paired under its own
identity, so it never pairs with a pool of every layer. ``DecodeKVConnector`` likewise fills
a window pool only with ``window_pool=True``, through a receiver under that identity."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kvtransfer import KVTarget
from pdserve.kvtransfer.blocks import pool_layout
from pdserve.kvtransfer.connector import PrefillKVConnector, window_identity
from pdserve.kvtransfer.decode_connector import DecodeKVConnector


def _pool(num_layers: int) -> torch.Tensor:
    return torch.zeros(num_layers, 2, 8, 4, 1, 8)


def _target(rid: str, pool: torch.Tensor, model: str) -> KVTarget:
    return KVTarget(
        transport="shm", address="127.0.0.1:1", node_id="n", request_id=rid, block_ids=(1,),
        deadline=time.time() + 5, token="t" * 16, layout=pool_layout(pool, model),
    )  # fmt: skip


def test_window_targets_are_required_exactly_with_a_window_pool() -> None:
    plain = PrefillKVConnector()
    plain.register_kv_caches(_pool(2), "m")
    with pytest.raises(ValueError, match="window_pool=True"):
        plain.register_window_kv_caches(_pool(2), "m", layers=(0, 2), window=8)
    with pytest.raises(ValueError, match="window_target"):
        plain.register_target(
            "r", _target("r", _pool(2), "m"), window_target=_target("r", _pool(2), "m")
        )

    windowed = PrefillKVConnector(window_pool=True)
    windowed.register_kv_caches(_pool(2), "m")
    with pytest.raises(ValueError, match="not distinct layers"):
        windowed.register_window_kv_caches(_pool(2), "m", layers=(0, 7), window=8)
    windowed.register_window_kv_caches(_pool(2), "m", layers=(0, 2), window=8)
    with pytest.raises(ValueError, match="window_target"):
        windowed.register_target("r", _target("r", _pool(2), "m"))
    identity = window_identity("m", 8)
    windowed.register_target(
        "r", _target("r", _pool(2), "m"), window_target=_target("r", _pool(2), identity)
    )
    assert identity != "m" and "8" in identity
    # A pool of every layer differs from the window pool's layout by name and layers.
    assert pool_layout(_pool(4), "m").mismatch(pool_layout(_pool(2), identity)) is not None
    windowed.close()
    plain.close()


def test_a_window_pool_registered_with_a_layout_keeps_its_identity_and_scales() -> None:
    """A tensor-parallel rank passes its window pool's layout: it must carry the window
    identity; a quantized window pool's scales (its layers' rows) are the layout's."""
    pool = torch.zeros(2, 2, 8, 4, 1, 8, dtype=torch.int8)
    scales = torch.tensor([[[0.5], [0.25]], [[0.125], [1.0]]])  # [L_window=2, K/V, H=1]
    connector = PrefillKVConnector(window_pool=True)
    connector.register_kv_caches(torch.zeros(1, 2, 8, 4, 1, 8, dtype=torch.int8), "m")
    with pytest.raises(ValueError, match="expected"):
        connector.register_window_kv_caches(
            pool, "m", layers=(0, 2), window=8, layout=pool_layout(pool, "m")
        )
    layout = pool_layout(pool, window_identity("m", 8), kv_scales=scales)
    connector.register_window_kv_caches(pool, "m", layers=(0, 2), window=8, layout=layout)
    window = connector._window
    assert window is not None and window.sender.layout == layout
    assert window.sender.layout.kv_scales == (0.5, 0.25, 0.125, 1.0)
    connector.close()


def test_decode_connector_fills_a_window_pool_only_when_asked() -> None:
    """The decode side's connector: a window pool needs ``window_pool=True``; its receiver
    then expects the window blocks under the window identity, and ``pending`` / ``cancel``
    cover both pools."""
    plain = DecodeKVConnector()
    plain.register_kv_caches(_pool(2), "m")
    with pytest.raises(ValueError, match="window_pool=True"):
        plain.register_window_kv_caches(_pool(2), "m", layers=(0, 2), window=8)
    assert not plain.receives_window_pool
    with pytest.raises(ValueError, match="no window pool"):
        plain.expect_window("r", 0, [1], time.time() + 5)

    windowed = DecodeKVConnector(window_pool=True)
    windowed.register_kv_caches(_pool(2), "m")
    windowed.register_window_kv_caches(_pool(2), "m", layers=(0, 2), window=8)
    assert windowed.receives_window_pool
    # The engine's scheduler reserved 10 tokens (3 blocks of 4); the window (8 tokens) of
    # the first decoded token starts in prompt block 1.
    windowed.register_load("r")
    windowed.update_state_after_alloc("r", [5, 6, 7], 0, 10)
    (full,) = windowed.expect("r", time.time() + 5)
    window = windowed.expect_window("r", 1, [3, 4], time.time() + 5)
    assert full.block_ids == (5, 6, 7) and full.layout.model == "m"
    assert (window.first_block, window.block_ids) == (1, (3, 4))
    assert window.layout.model == window_identity("m", 8)
    assert windowed.pending() == ["r"]
    windowed.cancel("r")
    assert windowed.pending() == []
    windowed.close()
    plain.close()
