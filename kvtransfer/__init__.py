"""Moves paged KV blocks from a prefill engine to a decode engine.

Decode side: ``KVReceiver.expect`` -> ``KVTarget`` -> ``wait``/``cancel``. Prefill side:
``KVSender.open`` -> ``send_layer`` per computed layer -> ``finish``. Knows nothing of Ray.
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
