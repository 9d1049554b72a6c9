"""The I/O threads copy single-threaded without changing the engine's thread count (the
per-thread setting itself is tested in tests/kernels/test_cpu_runtime.py)."""

from __future__ import annotations

import torch

from tests.kvtransfer.procs import LAYOUT, make_receiver, source_pool


def test_a_transfer_leaves_the_engines_thread_count_alone() -> None:
    from pdserve.kvtransfer.sender import KVSender

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    receiver, pool, alloc = make_receiver(LAYOUT, "shm", 8)
    sender = KVSender(LAYOUT)
    try:
        src = source_pool(LAYOUT, 8, 3)
        target = receiver.expect("r", [6, 1, 4])
        handle = sender.open(target, [0, 5, 2])
        for layer in range(LAYOUT.num_layers):
            sender.send_layer(handle, layer, src)
        assert sender.finish(handle).ok
        assert receiver.wait("r").ok
        assert torch.equal(pool[:, :, [6, 1, 4]], src[:, :, [0, 5, 2]])
        assert torch.get_num_threads() == 2
    finally:
        sender.close()
        receiver.close()
        alloc.close()
        torch.set_num_threads(before)
