"""The I/O threads copy single-threaded without changing the engine's thread count."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from pdserve.kvtransfer.threads import single_threaded_copies
from tests.kvtransfer.procs import LAYOUT, make_receiver, source_pool


def _uses_libgomp() -> bool:
    return "libgomp" in Path("/proc/self/maps").read_text()


def _in_thread(fn):  # noqa: ANN001, ANN202
    out: dict[str, object] = {}

    def body() -> None:
        out["value"] = fn()

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    return out["value"]


def test_limits_only_the_calling_thread() -> None:
    if not _uses_libgomp():
        pytest.skip("torch is not built with GNU OpenMP here")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        took, inside = _in_thread(lambda: (single_threaded_copies(), torch.get_num_threads()))
        assert took and inside == 1
        assert torch.get_num_threads() == 2
        # A thread that never asked keeps the process-wide setting.
        assert _in_thread(torch.get_num_threads) == 2
    finally:
        torch.set_num_threads(before)


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
