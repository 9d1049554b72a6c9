"""The decode connector's scheduler half, driven by the engine's scheduler: a reservation
for a remote prefill tells the connector which blocks receive which prompt tokens, and the
connector forgets the request when it leaves (no pool or receiver needed for that half)."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.scheduler import Scheduler
from pdserve.kvtransfer.decode_connector import DecodeKVConnector, LoadPlan
from tests.engine.fakes import make_request


def _scheduler(connector: DecodeKVConnector) -> Scheduler:
    return Scheduler(
        KVCacheManager(16, 4, True),
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_model_len=64,
        kv_connector=connector,
    )


def test_reservation_tells_the_connector_where_the_prompt_kv_goes() -> None:
    connector = DecodeKVConnector()
    scheduler = _scheduler(connector)
    connector.register_load("r")
    blocks = scheduler.reserve_remote_prefill(make_request("r", list(range(1, 11))))
    assert blocks is not None and len(blocks) == 3  # 10 tokens in blocks of 4
    plan = connector.plan("r")
    assert plan is not None
    assert list(plan.block_ids) == blocks
    assert (plan.num_computed_tokens, plan.num_external_tokens) == (0, 10)
    scheduler.abort("r")
    assert connector.plan("r") is None  # request_finished: the connector forgot it
    scheduler.check_integrity()
    assert scheduler.kv.num_free_blocks == 16


def test_a_prompt_not_registered_for_a_load_is_not_reserved() -> None:
    connector = DecodeKVConnector()
    scheduler = _scheduler(connector)
    with pytest.raises(ValueError, match="loads 0 of its 10"):
        scheduler.reserve_remote_prefill(make_request("r", list(range(1, 11))))
    assert connector.plan("r") is None
    assert scheduler.kv.num_free_blocks == 16 and not scheduler.requests


def test_expect_needs_a_reservation() -> None:
    connector = DecodeKVConnector()
    connector.register_load("r")
    with pytest.raises(ValueError, match="no KV reserved"):
        connector.expect("r")


def test_a_reservation_keeps_the_cached_prefix_and_loads_only_the_rest() -> None:
    """A prompt whose first two blocks are cached here: the reservation takes them from the
    cache, the connector loads the 6 tokens past them, and the transfer writes only the
    blocks from the third on (``LoadPlan.delta``)."""
    connector = DecodeKVConnector()
    scheduler = _scheduler(connector)
    prompt = list(range(1, 15))  # 14 tokens: blocks of 4 -> 3 full + 1 partial
    earlier = make_request("e", prompt[:9])  # computed and cached: 2 full blocks
    assert scheduler.kv.allocate_slots(earlier, 9) is not None
    earlier.num_computed_tokens = 9
    scheduler.kv.cache_full_blocks(earlier)
    cached = list(earlier.block_ids[:2])
    scheduler.kv.free(earlier)

    connector.register_load("r")
    blocks = scheduler.reserve_remote_prefill(make_request("r", prompt))
    assert blocks is not None and blocks[:2] == cached
    plan = connector.plan("r")
    assert plan is not None
    assert (plan.num_computed_tokens, plan.num_external_tokens) == (8, 6)
    first, loaded = plan.delta(4)
    assert first == 2 and list(loaded) == blocks[2:4]
    assert scheduler.get_request("r").num_cached_tokens == 8  # type: ignore[union-attr]
    scheduler.abort("r")
    scheduler.check_integrity()
    assert scheduler.kv.num_free_blocks == 16


def test_a_plan_must_start_on_a_block_boundary() -> None:
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        LoadPlan((0, 1, 2), 5, 6).delta(4)
    with pytest.raises(ValueError, match="the prompt needs 3 blocks"):
        LoadPlan((0, 1), 4, 6).delta(4)
