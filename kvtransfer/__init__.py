"""Moves paged KV blocks from a prefill engine to a decode engine.

Decode side: ``KVReceiver.expect`` -> ``KVTarget`` -> ``wait``/``cancel``. Prefill side:
``KVSender.open`` -> ``send_layer`` per computed layer -> ``finish``; a prompt prefilled in
chunks is sent chunk by chunk (``extend`` with each chunk's blocks, ``send_layer`` of that
span; ``abort`` when the request leaves early), and the receiver completes a request once
every block of every layer of every head landed. The bytes move through
one of three transports behind one interface (``transport``: shared memory and CUDA IPC in
``transport_direct``, torch.distributed in ``transport_torchdist``), chosen in ``node`` from
where the two peers are. Between tensor-parallel replicas every rank has its own sender or
receiver and pool (``KVLayout`` states the rank's KV heads); ``tp_plan`` maps the heads, so
each prefill rank sends each decode rank only the heads both hold. Knows nothing of Ray.
"""

from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.types import (
    KVLayout,
    KVLayoutMismatchError,
    KVTarget,
    KVTransferError,
    KVTransferRefusedError,
    KVTransferTimeoutError,
    TransferResult,
)

__all__ = [
    "KVLayout",
    "KVLayoutMismatchError",
    "KVTarget",
    "KVTransferConfig",
    "KVTransferError",
    "KVTransferRefusedError",
    "KVTransferTimeoutError",
    "TransferResult",
]
