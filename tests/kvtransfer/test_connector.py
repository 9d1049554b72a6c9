"""PrefillKVConnector driven the way the engine drives it (begin_step, layer_computed per
layer, end_step, poll_finished), without a model: what it reports and when."""

from __future__ import annotations

import time

import pytest

from pdserve.engine.kv_connector import KVConnector, PendingSend
from pdserve.kvtransfer.connector import PrefillKVConnector
from tests.kvtransfer.procs import LAYOUT, make_receiver, source_pool
from tests.support import wait_until


def _poll_until(connector: PrefillKVConnector, rid: str, timeout: float = 20) -> list[str]:
    """Poll the connector the way the engine does until ``rid`` is reported; every id
    reported on the way."""
    seen: list[str] = []

    def reported() -> bool:
        seen.extend(connector.poll_finished())
        return rid in seen

    wait_until(reported, timeout, interval=0.005, what=f"the connector to report {rid!r}")
    return seen


def test_connector_streams_layers_and_reports_after_the_step() -> None:
    receiver, pool, alloc = make_receiver(LAYOUT, "shm", 16)
    connector = PrefillKVConnector()
    assert isinstance(connector, KVConnector)
    src = source_pool(LAYOUT, 8, 9)
    connector.register_kv_caches(src, LAYOUT.model)  # what the engine does after allocating
    assert connector.sender.layout == LAYOUT
    try:
        tokens = 2 * LAYOUT.block_size + 1  # 3 blocks, the last one partly filled
        target = receiver.expect("a", [9, 2, 14], time.time() + 20)
        connector.register_target("a", target)
        # The engine's block table may hold one more block than the prompt needs.
        connector.begin_step([PendingSend("a", [5, 1, 6, 7], tokens), PendingSend("stray", [0], 4)])
        for layer in range(LAYOUT.num_layers):
            connector.layer_computed(layer, src)
        # The sends complete while the "step" is still running.
        wait_until(
            lambda: "a" not in connector.sender.open_handles(),
            timeout=20,
            what="request a's send to complete",
        )
        # Ids begun in this step are not reported by its own end_step: the engine only
        # tracks them as sending after processing the step's outputs.
        assert connector.end_step() == []
        seen = _poll_until(connector, "a")
        assert sorted(seen) == ["a", "stray"]
        result = connector.take_result("a")
        assert result is not None and result.ok
        stray = connector.take_result("stray")
        assert stray is not None and not stray.ok and "no KVTarget" in (stray.error or "")
        assert receiver.wait("a").ok
        assert connector.poll_finished() == []
        assert (pool[:, :, [9, 2, 14]] == src[:, :, [5, 1, 6]]).all()
    finally:
        connector.sender.close()
        receiver.close()
        alloc.close()


def test_connector_refuses_a_target_sized_for_another_prompt() -> None:
    receiver, _pool, alloc = make_receiver(LAYOUT, "shm", 16)
    connector = PrefillKVConnector()
    connector.register_kv_caches(source_pool(LAYOUT, 4, 0), LAYOUT.model)
    try:
        connector.register_target("a", receiver.expect("a", [1, 2], time.time() + 20))
        connector.begin_step([PendingSend("a", [0, 1, 2], 3 * LAYOUT.block_size)])
        assert connector.end_step() == []
        assert connector.poll_finished() == ["a"]
        result = connector.take_result("a")
        assert result is not None and "2 blocks for 12 tokens" in (result.error or "")
        receiver.cancel("a")
    finally:
        connector.sender.close()
        receiver.close()
        alloc.close()


def test_connector_gives_blocks_back_when_the_peer_never_answers() -> None:
    """A decode peer that accepts the connection and then says nothing: the send is
    reported finished (failed) once its deadline passes, so the engine frees the blocks."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))
    host, port = silent.getsockname()[:2]
    receiver, _pool, alloc = make_receiver(LAYOUT, "shm", 4)
    connector = PrefillKVConnector()
    connector.register_kv_caches(source_pool(LAYOUT, 2, 0), LAYOUT.model)
    try:
        target = receiver.expect("a", [1], time.time() + 1.0)
        receiver.cancel("a")
        # Same credentials and layout, but pointing at a listener that never replies.
        connector.register_target("a", target.model_copy(update={"address": f"{host}:{port}"}))
        connector.begin_step([PendingSend("a", [0], LAYOUT.block_size)])
        for layer in range(LAYOUT.num_layers):
            connector.layer_computed(layer, source_pool(LAYOUT, 2, 0))
        assert connector.end_step() == []
        start = time.time()
        assert _poll_until(connector, "a") == ["a"]
        assert time.time() - start < 2.0 + 1.0
        result = connector.take_result("a")
        assert result is not None and not result.ok
    finally:
        connector.sender.close()
        receiver.close()
        alloc.close()
        silent.close()


def test_connector_has_a_sender_only_once_one_pool_is_registered() -> None:
    connector = PrefillKVConnector()
    with pytest.raises(RuntimeError, match="no KV pool registered"):
        connector.sender  # noqa: B018 - the property raises
    connector.register_kv_caches(source_pool(LAYOUT, 2, 0), LAYOUT.model)
    try:
        with pytest.raises(RuntimeError, match="already registered"):
            connector.register_kv_caches(source_pool(LAYOUT, 2, 0), LAYOUT.model)
        with pytest.raises(ValueError, match="kv_cache: shape"):
            PrefillKVConnector().register_kv_caches(source_pool(LAYOUT, 2, 0)[0], "m")
    finally:
        connector.sender.close()
