"""torch.distributed point-to-point groups, one two-rank group per prefill/decode pair.

Each pair gets its own ``ProcessGroup`` object (gloo for CPU pools, NCCL when both pools
are on CUDA), built from an explicit ``TCPStore`` on an OS-chosen port, so a process can be
paired with many peers at once and never touches torch.distributed's global default group.
The decode side (rank 1) hosts the store; the prefill side (rank 0) connects to it.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch.distributed as dist

SENDER_RANK = 0
RECEIVER_RANK = 1


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def store_master(host: str, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on ``host`` and a port the OS picks (read it from ``.port``)."""
    return dist.TCPStore(
        host, 0, world_size=2, is_master=True, timeout=_td(timeout_s), wait_for_workers=False
    )


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size=2, is_master=False, timeout=_td(timeout_s))


def pair_group(
    store: dist.Store, rank: int, backend: str, bind_host: str, timeout_s: float
) -> dist.ProcessGroup:
    """Build this side of the pair's group (blocks until the peer builds its side)."""
    # torch's stubs omit ProcessGroupGloo._Options and type the backends as a ``Backend``
    # without the collectives they bind, hence the ignores below.
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        opts._timeout = _td(timeout_s)
        return dist.ProcessGroupGloo(store, rank, 2, opts)  # type: ignore[return-value]
    if backend == "nccl":
        survive_peer_failures()
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)  # type: ignore[return-value]
    raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")


# torch's NCCL watchdog defaults to tearing the whole process down when a collective fails
# or times out (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, "SkipCleanUp"), and its heartbeat monitor
# kills a process whose watchdog hangs on a dead peer. A KV pair's failure must only fail
# that pair: 2 ("CleanUpOnly") aborts the communicator and raises in the waiting thread,
# which drops the pair (recreated on next use) and lets decode fall back to local prefill.
NCCL_SURVIVE_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


def survive_peer_failures() -> None:
    """Set the NCCL error policy above (read by torch when a group is built). Set here and
    not at the edge because it is the transport's contract, not a deployment choice."""
    for key, value in NCCL_SURVIVE_ENV.items():
        os.environ[key] = value


def backend_for(sender_device: str, receiver_device: str) -> str:
    """NCCL when both pools are on CUDA, gloo otherwise (CUDA data staged through host)."""
    return "nccl" if sender_device == receiver_device == "cuda" else "gloo"


def wait(work: dist.Work, timeout_s: float) -> None:
    work.wait(_td(timeout_s))


def shutdown(group: dist.ProcessGroup | None, backend: str) -> None:
    """Best-effort teardown of a pair's group (the peer may already be gone).

    NCCL communicators are aborted (a dead peer would hang a clean destroy). Gloo groups
    are simply dropped by the caller: aborting one while the peer tears down its side
    concurrently can take the process down from gloo's I/O thread."""
    if group is None or backend != "nccl":
        return
    with contextlib.suppress(Exception):  # teardown of a half-dead group must not raise
        group.abort()


def tag_of(seq: int) -> int:
    """Gloo/NCCL tags are non-negative C ints; sequence numbers wrap."""
    return seq % (1 << 30)
