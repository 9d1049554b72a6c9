"""The head mapping between tensor-parallel replicas (``tp_plan``), over GQA, MQA and MHA
head counts: moving every planned slice between per-rank copies of a pool whose heads are
numbered rebuilds exactly each decode rank's heads, each head once."""

from __future__ import annotations

import pydantic
import pytest
import torch

from pdserve.kvtransfer import KVLayout, KVLayoutMismatchError
from pdserve.kvtransfer.blocks import pool_layout
from pdserve.kvtransfer.tp_plan import (
    HeadSlice,
    check_pair,
    plan,
    rank_heads,
    rank_layout,
    send_slice,
)


def _model(heads: int) -> KVLayout:
    return KVLayout(
        model="tp-plan", num_layers=2, num_kv_heads=heads, head_dim=4, block_size=2, dtype="float32"
    )


PAIRS = [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (1, 4)]
# GQA (2, 4 and 8 KV heads), MQA (1), MHA (8 KV heads = 8 query heads: the same at the KV level)
HEADS = [1, 2, 4, 8]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_the_plan_rebuilds_every_decode_rank_from_canonical_copies(
    heads: int, a: int, b: int
) -> None:
    model = _model(heads)
    prefill = [rank_layout(model, a, r) for r in range(a)]
    decode = [rank_layout(model, b, r) for r in range(b)]
    # Each head's values are its global index; a rank's pool holds its own heads.
    full = torch.arange(heads, dtype=torch.float32)
    src = [full[p.kv_head_start : p.kv_head_start + p.num_kv_heads] for p in prefill]
    dst = [torch.full((d.num_kv_heads,), -1.0) for d in decode]
    moved = 0
    slices = plan(prefill, decode)
    for (i, j), part in slices.items():
        assert prefill[i].kv_head_replica == 0, "a replica copy never sends"
        assert torch.all(dst[j][part.dst] == -1), "a head lands twice"
        dst[j][part.dst] = src[i][part.src]
        moved += part.num_heads
        assert send_slice(prefill[i], decode[j]) == part
    for j, d in enumerate(decode):
        assert torch.equal(dst[j], full[d.kv_head_start : d.kv_head_start + d.num_kv_heads])
    # Each decode rank's heads once: no replica on either side adds a byte.
    assert moved == sum(d.num_kv_heads for d in decode)
    senders = {i for i, _ in slices}
    assert senders == {i for i, p in enumerate(prefill) if p.kv_head_replica == 0}


def test_known_plans() -> None:
    gqa = _model(4)
    two = [rank_layout(gqa, 2, r) for r in range(2)]
    four = [rank_layout(gqa, 4, r) for r in range(4)]
    # 2 -> 4: each prefill rank halves its heads between two decode ranks.
    assert plan(two, four) == {
        (0, 0): HeadSlice(first_head=0, num_heads=1, src_start=0, dst_start=0),
        (0, 1): HeadSlice(first_head=1, num_heads=1, src_start=1, dst_start=0),
        (1, 2): HeadSlice(first_head=2, num_heads=1, src_start=0, dst_start=0),
        (1, 3): HeadSlice(first_head=3, num_heads=1, src_start=1, dst_start=0),
    }
    # 4 -> 2: two senders fill one decode rank, each half of its heads.
    assert plan(four, two) == {
        (0, 0): HeadSlice(0, 1, 0, 0),
        (1, 0): HeadSlice(1, 1, 0, 1),
        (2, 1): HeadSlice(2, 1, 0, 0),
        (3, 1): HeadSlice(3, 1, 0, 1),
    }
    # MQA over 2 -> 4: prefill rank 1 holds a replica and sends nothing; every decode rank
    # (each a copy of the one head) gets it from rank 0.
    mqa = _model(1)
    p2 = [rank_layout(mqa, 2, r) for r in range(2)]
    d4 = [rank_layout(mqa, 4, r) for r in range(4)]
    assert [p.kv_head_replica for p in p2] == [0, 1]
    assert [d.kv_head_replica for d in d4] == [0, 1, 2, 3]
    assert plan(p2, d4) == {(0, j): HeadSlice(0, 1, 0, 0) for j in range(4)}
    assert send_slice(p2[1], d4[0]) is None
    # GQA with fewer heads than ranks: H=2 over 4 ranks holds head r // 2.
    assert [rank_heads(2, 4, r) for r in range(4)] == [
        (range(0, 1), 0),
        (range(0, 1), 1),
        (range(1, 2), 0),
        (range(1, 2), 1),
    ]


def test_the_handshake_ignores_placement_but_not_the_model() -> None:
    gqa = _model(4)
    a, b = rank_layout(gqa, 2, 0), rank_layout(gqa, 4, 3)
    assert a.mismatch(b) is None and gqa.mismatch(a) is None
    other = rank_layout(_model(8), 4, 0)  # 2 heads per rank, like ``a``, of another model
    msg = a.mismatch(other)
    assert msg == "total_kv_heads: local=4 peer=8"
    with pytest.raises(KVLayoutMismatchError) as info:
        check_pair(a, other)
    text = str(info.value)
    assert "total_kv_heads: local=4 peer=8" in text
    assert "heads [0, 2) of 4 (tp rank 0/2)" in text and "heads [0, 2) of 8 (tp rank 0/4)" in text
    with pytest.raises(KVLayoutMismatchError, match="head_dim: local=4 peer=8"):
        send_slice(a, b.model_copy(update={"head_dim": 8}))
    # A range outside the model (only constructible by skipping validation, e.g. forged).
    forged = KVLayout.model_construct(**{**a.model_dump(), "kv_head_start": 3})
    assert "outside the model's [0, 4)" in (a.mismatch(forged) or "")


def test_layouts_and_splits_are_validated() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"\[3, 5\) run past total_kv_heads=4"):
        KVLayout.model_validate({**_model(2).model_dump(), "kv_head_start": 3, "total_kv_heads": 4})
    with pytest.raises(pydantic.ValidationError, match="tp_rank: 2 is not below tp_size=2"):
        KVLayout.model_validate({**_model(2).model_dump(), "tp_size": 2, "tp_rank": 2})
    with pytest.raises(
        ValueError, match=r"total_kv_heads \(6\) is not a multiple of tp_size \(4\)"
    ):
        rank_heads(6, 4, 0)
    with pytest.raises(ValueError, match=r"tp_size \(6\) must be a multiple of total_kv_heads"):
        rank_heads(4, 6, 0)
    with pytest.raises(ValueError, match="tp_rank=4"):
        rank_heads(4, 4, 4)
    with pytest.raises(ValueError, match="needs prefill and decode ranks"):
        plan([], [_model(2)])


def test_plan_refuses_missing_and_doubled_heads() -> None:
    gqa = _model(4)
    two = [rank_layout(gqa, 2, r) for r in range(2)]
    with pytest.raises(
        ValueError, match=r"decode rank 0 .* gets no canonical copy of heads \[2, 3\]"
    ):
        plan(two[:1], [gqa])
    doubled = [two[0], two[1], two[1].model_copy(update={"tp_rank": 0})]
    with pytest.raises(
        ValueError, match=r"heads more than once: head 2 from prefill ranks \[1, 2\]"
    ):
        plan(doubled, [gqa])
    with pytest.raises(KVLayoutMismatchError, match="total_kv_heads"):
        plan(two, [_model(8)])


def test_pool_layout_states_the_ranks_heads() -> None:
    pool = torch.zeros(2, 2, 3, 2, 1, 4)  # [L, 2, N, B, H=1, D]
    layout = pool_layout(
        pool, "m", kv_head_start=1, total_kv_heads=2, kv_head_replica=1, tp_size=4, tp_rank=3
    )
    assert layout.kv_heads == range(1, 2) and layout.heads_total == 2
    assert layout.canonical_heads == range(1, 1)  # a replica copy
    assert layout == rank_layout(_model(2), 4, 3).model_copy(update={"model": "m"})
    single = pool_layout(pool, "m")
    assert (single.kv_heads, single.heads_total, single.tp_size) == (range(0, 1), 1, 1)
    assert single.block_bytes() == 2 * 2 * 1 * 4 * 4 and _model(4).block_bytes(1) == 2 * 2 * 4 * 4
    with pytest.raises(ValueError, match=r"kv heads: \[2, 3\) run past total_kv_heads=2"):
        pool_layout(pool, "m", kv_head_start=2, total_kv_heads=2)
