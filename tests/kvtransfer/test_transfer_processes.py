"""Two real processes per transport: random blocks arrive byte-identical at the destination
block ids, with non-contiguous, differently ordered ids on both sides and several requests
in flight at once."""

from __future__ import annotations

import multiprocessing as mp
import random
import time

import pytest
import torch

from pdserve.kvtransfer.shm import list_segments
from tests.kvtransfer.procs import LAYOUT, make_receiver, sender_main, source_pool

SRC_BLOCKS = 48
DST_BLOCKS = 64


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_random_blocks_arrive_byte_identical(transport: str) -> None:
    seed = 1234
    ctx = mp.get_context("spawn")
    receiver, pool, alloc = make_receiver(LAYOUT, transport, DST_BLOCKS)
    segment = alloc.segment_for(pool).name
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=sender_main, args=(child, LAYOUT.model_dump_json(), seed, SRC_BLOCKS, None)
    )
    proc.start()
    try:
        rng = random.Random(seed)
        run_dst, run_src = [40, 41, 42], [10, 11, 12]
        dst_free = [b for b in rng.sample(range(DST_BLOCKS), DST_BLOCKS) if b not in run_dst]
        src_free = [b for b in rng.sample(range(SRC_BLOCKS), SRC_BLOCKS) if b not in run_src]
        jobs = []
        for i, n in enumerate([5, 9, 1, 7]):
            dst = [dst_free.pop() for _ in range(n)]
            src = [src_free.pop() for _ in range(n)]
            jobs.append((receiver.expect(f"req-{i}", dst, time.time() + 60), src))
        # The contiguous case too: runs on both sides, at different offsets.
        jobs.append((receiver.expect("req-run", run_dst, time.time() + 60), run_src))
        used_dst = {b for t, _ in jobs for b in t.block_ids}
        assert len(used_dst) == sum(len(t.block_ids) for t, _ in jobs)
        parent.send([(t.model_dump_json(), s) for t, s in jobs])

        results = [receiver.wait(t.request_id) for t, _ in jobs]
        assert parent.poll(60), "sender process did not report"
        sent, sender_open = parent.recv()
        proc.join(30)
        assert proc.exitcode == 0

        expected = source_pool(LAYOUT, SRC_BLOCKS, seed)
        for (target, src), result in zip(jobs, results, strict=True):
            want_bytes = LAYOUT.num_layers * len(src) * LAYOUT.block_bytes()
            assert result.ok and result.bytes == want_bytes
            got = pool[:, :, list(target.block_ids)].contiguous().view(torch.uint8)
            assert torch.equal(got, expected[:, :, src].contiguous().view(torch.uint8))
        for raw in sent:
            assert '"ok":true' in raw
        untouched = [b for b in range(DST_BLOCKS) if b not in used_dst]
        assert torch.count_nonzero(pool[:, :, untouched]) == 0
        assert receiver.pending() == [] and sender_open == []
    finally:
        if proc.is_alive():
            proc.kill()
        receiver.close()
        alloc.close()
    assert segment not in list_segments()
