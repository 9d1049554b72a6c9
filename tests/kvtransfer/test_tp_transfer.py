"""KV hand-off between tensor-parallel replicas, over real sockets and transports: a prefill
replica of TP=a (one connector and pool per rank, each holding its KV heads) sends into a
decode replica of TP=b (one receiver and pool per rank). Every decode rank's pool ends up
byte-identical to its heads of the source blocks, and the bytes on the wire are each decode
rank's heads once: no head sent twice, none by a replica copy.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pdserve.kvtransfer import (
    KVLayout,
    KVLayoutMismatchError,
    KVTarget,
    KVTransferError,
    KVTransferRefusedError,
    TransferResult,
)
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.tp_plan import rank_layout
from tests.kvtransfer.procs import (
    make_receiver,
    prefill_ranks,
    rank_pool,
    run_prefill_step,
    source_pool,
    tp_prefill_main,
)

SRC_BLOCKS = 12
DST_BLOCKS = 16


def _model(heads: int) -> KVLayout:
    return KVLayout(
        model="tiny-tp", num_layers=3, num_kv_heads=heads, head_dim=8, block_size=4, dtype="float32"
    )


@contextmanager
def decode_replica(
    model_layout: KVLayout, tp: int, transport: str
) -> Iterator[list[tuple[KVReceiver, torch.Tensor]]]:
    """A TP=``tp`` decode replica: one receiver per rank, its pool holding its heads."""
    ranks, allocs = [], []
    try:
        for rank in range(tp):
            receiver, pool, alloc = make_receiver(
                rank_layout(model_layout, tp, rank), transport, DST_BLOCKS
            )
            ranks.append((receiver, pool))
            allocs.append(alloc)
        yield ranks
    finally:
        for receiver, _ in ranks:
            receiver.close()
        for alloc in allocs:
            alloc.close()


def _requests(seed: int) -> list[tuple[str, list[int], list[int], int]]:
    """(request id, decode block ids, prefill block ids, prompt tokens): scattered ids, and
    one request whose last block is partly filled."""
    rng = random.Random(seed)
    dst = rng.sample(range(DST_BLOCKS), 8)
    src = rng.sample(range(SRC_BLOCKS), 8)
    return [("r0", dst[:5], src[:5], 5 * 4), ("r1", dst[5:], src[5:], 2 * 4 + 1)]


def _expect_all(
    ranks: list[tuple[KVReceiver, torch.Tensor]], reqs: list[tuple[str, list[int], list[int], int]]
) -> list[tuple[str, list[KVTarget], list[int], int]]:
    """Every decode rank expects every request (same block ids on every rank)."""
    deadline = time.time() + 30
    return [
        (rid, [r.expect(rid, dst, deadline, num_tokens=tokens) for r, _ in ranks], src, tokens)
        for rid, dst, src, tokens in reqs
    ]


def _check_landed(
    model_layout: KVLayout,
    source: torch.Tensor,
    ranks: list[tuple[KVReceiver, torch.Tensor]],
    reqs: list[tuple[str, list[int], list[int], int]],
    sent: list[dict[str, TransferResult]],
) -> None:
    """Each decode rank holds exactly its heads of the source blocks; bytes add up."""
    for rid, dst, src, _ in reqs:
        kv_bytes = 0
        for receiver, pool in ranks:
            layout = receiver.layout
            landed = receiver.wait(rid)
            want_bytes = model_layout.num_layers * len(dst) * layout.block_bytes()
            assert landed.ok and landed.bytes == want_bytes
            kv_bytes += want_bytes
            want = rank_pool(source, layout)[:, :, src]
            got = pool[:, :, dst]
            assert torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))
        results = [rank[rid] for rank in sent]
        assert all(r.ok for r in results), [r.error for r in results]
        # On the wire: every decode rank's heads once (decode replicas each need theirs).
        assert sum(r.bytes for r in results) == kv_bytes
        if len(ranks) <= model_layout.num_kv_heads:  # no replica on the decode side
            assert kv_bytes == model_layout.num_layers * len(dst) * model_layout.block_bytes()
    used = sorted({b for _, dst, _, _ in reqs for b in dst})
    for receiver, pool in ranks:
        untouched = [b for b in range(DST_BLOCKS) if b not in used]
        assert torch.count_nonzero(pool[:, :, untouched]) == 0
        assert receiver.pending() == []


CASES = [
    # (KV heads, prefill TP, decode TP)
    (4, 2, 1),
    (4, 1, 2),
    (4, 2, 4),
    (4, 4, 2),
    (2, 2, 4),  # GQA, decode replicates: two decode ranks per head
    (2, 4, 2),  # GQA, prefill replicates: replica ranks send nothing
    (1, 1, 4),  # MQA
    (1, 2, 4),  # MQA, replicated on both sides
]


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
@pytest.mark.parametrize(("heads", "a", "b"), CASES)
def test_tp_replicas_hand_off_each_rank_its_heads(
    transport: str, heads: int, a: int, b: int
) -> None:
    model_layout = _model(heads)
    source = source_pool(model_layout, SRC_BLOCKS, seed=heads * 100 + a * 10 + b)
    connectors, pools = prefill_ranks(model_layout, a, source)
    try:
        with decode_replica(model_layout, b, transport) as ranks:
            reqs = _requests(seed=a * 10 + b)
            sent = run_prefill_step(connectors, pools, _expect_all(ranks, reqs))
            _check_landed(model_layout, source, ranks, reqs, sent)
            for rank, connector in enumerate(connectors):
                if connector.sender.layout.kv_head_replica:  # sends nothing, still ok
                    assert all(r.ok and r.bytes == 0 for r in sent[rank].values())
                assert connector.sender.open_handles() == []
    finally:
        for connector in connectors:
            connector.sender.close()


@pytest.mark.parametrize(
    ("transport", "heads", "a", "b"), [("torch_dist", 4, 2, 4), ("shm", 1, 2, 4)]
)
def test_a_prefill_replica_in_another_process(transport: str, heads: int, a: int, b: int) -> None:
    model_layout = _model(heads)
    seed = 77
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=tp_prefill_main, args=(child, model_layout.model_dump_json(), a, seed, SRC_BLOCKS)
    )
    proc.start()
    try:
        with decode_replica(model_layout, b, transport) as ranks:
            reqs = _requests(seed)
            jobs = _expect_all(ranks, reqs)
            parent.send(
                [
                    (rid, [t.model_dump_json() for t in targets], src, tokens)
                    for rid, targets, src, tokens in jobs
                ]
            )
            assert parent.poll(60), "the prefill process did not report"
            answer, still_open = parent.recv()
            sent = [
                {rid: TransferResult.model_validate_json(r) for rid, r in rank.items()}
                for rank in answer
            ]
            source = source_pool(model_layout, SRC_BLOCKS, seed)
            _check_landed(model_layout, source, ranks, reqs, sent)
            assert still_open == [[]] * a
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_another_models_total_heads_are_refused_naming_both(transport: str) -> None:
    """Same heads per rank, same everything else: only the model's total KV heads differ."""
    prefill = rank_layout(_model(4), 2, 0)  # 2 of 4 heads
    decode = rank_layout(_model(8), 4, 0)  # 2 of 8 heads
    receiver, pool, alloc = make_receiver(decode, transport, DST_BLOCKS)
    src = rank_pool(source_pool(_model(4), 4, 1), prefill)
    connectors, pools = prefill_ranks(_model(4), 2, source_pool(_model(4), 4, 1))
    sender = KVSender(prefill)
    try:
        # The connector checks the pair before any byte moves.
        target = receiver.expect("a", [1, 2], time.time() + 20)
        sent = run_prefill_step(connectors[:1], pools[:1], [("a", [target], [0, 1], 8)])
        assert not sent[0]["a"].ok
        assert "total_kv_heads: local=4 peer=8" in (sent[0]["a"].error or "")
        # A sender that opens anyway is refused by the decode side's handshake.
        handle = sender.open(target, [0, 1])
        for layer in range(prefill.num_layers):
            sender.send_layer(handle, layer, src)
        with pytest.raises(KVLayoutMismatchError) as info:
            sender.finish(handle)
        assert "total_kv_heads: local=8 peer=4" in str(info.value)
        assert torch.count_nonzero(pool) == 0
        receiver.cancel("a")
        assert receiver.pending() == [] and sender.open_handles() == []
    finally:
        sender.close()
        for connector in connectors:
            connector.sender.close()
        receiver.close()
        alloc.close()


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_a_head_landing_twice_fails_the_request(transport: str) -> None:
    """Two prefill pools both holding heads [0, 2) canonically (a misconfigured pair of
    ranks) send the same request: the second open is refused, the request fails."""
    model_layout = _model(4)
    first = rank_layout(model_layout, 2, 0)
    second = first.model_copy(update={"tp_rank": 1})  # claims rank 0's heads
    decode = rank_layout(model_layout, 1, 0)
    receiver, pool, alloc = make_receiver(decode, transport, DST_BLOCKS)
    src = rank_pool(source_pool(model_layout, 4, 3), first)
    a, b = KVSender(first), KVSender(second)
    try:
        target = receiver.expect("r", [4, 9], time.time() + 20)
        ha = a.open(target, [0, 1])
        a.send_layer(ha, 0, src)
        assert ha.opened.wait(10)
        hb = b.open(target, [2, 3])
        for layer in range(model_layout.num_layers):
            b.send_layer(hb, layer, src)
        with pytest.raises(KVTransferRefusedError, match=r"heads \[0, 1\] .* would land twice"):
            b.finish(hb)
        with pytest.raises(KVTransferError, match="would land twice"):
            receiver.wait("r")
        # The first sender was stopped too (fenced), and nothing is left open anywhere.
        assert not a.finish(ha, check=False).ok
        assert receiver.pending() == [] and a.open_handles() == [] and b.open_handles() == []
    finally:
        a.close()
        b.close()
        receiver.close()
        alloc.close()


def test_the_receiver_refuses_heads_it_does_not_hold() -> None:
    """A target whose layout lies about the decode pool's heads (stale or forged): the
    decode side refuses the open, naming the heads, and nothing lands."""
    model_layout = _model(4)
    decode = rank_layout(model_layout, 2, 1)  # heads [2, 4)
    receiver, pool, alloc = make_receiver(decode, "shm", DST_BLOCKS)
    full = KVSender(model_layout.model_copy(update={"total_kv_heads": 4}))
    replica = KVSender(rank_layout(_model(1), 2, 1))
    try:
        target = receiver.expect("r", [1], time.time() + 20)
        lying = target.model_copy(update={"layout": rank_layout(model_layout, 1, 0)})
        handle = full.open(lying, [0])  # sends all 4 heads
        for layer in range(model_layout.num_layers):
            full.send_layer(handle, layer, source_pool(model_layout, 2, 0))
        with pytest.raises(
            KVTransferRefusedError, match=r"heads \[0, 4\) are not all held by this pool"
        ):
            full.finish(handle)
        assert torch.count_nonzero(pool) == 0
        with pytest.raises(ValueError, match="none of which this pool .* sends"):
            replica.open(target.model_copy(update={"layout": rank_layout(_model(1), 1, 0)}), [0])
        receiver.cancel("r")
        assert receiver.pending() == []
    finally:
        full.close()
        replica.close()
        receiver.close()
        alloc.close()


def test_register_target_takes_one_or_many() -> None:
    connectors, _ = prefill_ranks(_model(2), 1, source_pool(_model(2), 2, 0))
    connector = connectors[0]
    try:
        target = KVTarget(
            transport="shm",
            address="127.0.0.1:1",
            node_id="n",
            request_id="x",
            block_ids=(0,),
            deadline=time.time() + 5,
            token="t" * 16,
            layout=_model(2),
        )
        connector.register_target("x", target)
        connector.register_target("x", [target, target])
        with pytest.raises(ValueError, match="no KVTarget given"):
            connector.register_target("x", [])
        with pytest.raises(ValueError, match="'x' differs from 'y'"):
            connector.register_target("y", [target])
        with pytest.raises(TypeError, match="expected KVTarget"):
            connector.register_target("x", [target, "nope"])  # type: ignore[list-item]
    finally:
        connector.sender.close()


def test_the_gpu_checks_tp_step_passes_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """``gpu_check``'s TP step (CUDA IPC / NCCL on a GPU) run over gloo: its logic, which
    the GPU run relies on, holds."""
    from pdserve.kvtransfer import gpu_check

    assert gpu_check.tp_transfer_check("gloo", "cpu", "cpu", "torch_dist", num_blocks=16)
    assert "ok   gloo: head slices 4->2 and 1->2" in capsys.readouterr().out
