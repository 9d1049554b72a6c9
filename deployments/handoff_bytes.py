"""What one prefill -> decode hand-off moves: the bytes behind the routers' transfer estimate.

A replica whose window layers keep a pool of their own (``engine.window_kv``) hands off
the full-attention layers' KV of every token the decode side lacks, but the window layers'
KV only of the blocks the first decoded token's window reaches (the window target's
``first_block``, ``(n - W + 1) // B`` for an n-token prompt; see docs/models.md, "The
hand-off with the window pool on"). Counting every layer for every token overstates a long
prompt's transfer by up to the ratio of all layers to the full ones.

Pure arithmetic, so the routers and the simulator share it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # routers imports this module; only its report type
    from pdserve.deployments.routers import PrefillTerms


def handoff_window_tokens(
    prompt_tokens: int, transfer_tokens: int, window: int, block_size: int
) -> int:
    """Tokens of the window layers' KV one hand-off moves: from the first block the first
    decoded token's window reaches to the prompt's end, and never more than the
    ``transfer_tokens`` the decode side lacks."""
    first = max(0, (prompt_tokens - window + 1) // block_size) * block_size
    return max(0, min(transfer_tokens, prompt_tokens - first))


def handoff_bytes(
    prompt_tokens: int,
    transfer_tokens: int,
    full_bytes_per_token: int,
    window_bytes_per_token: int = 0,
    window: int = 0,
    block_size: int = 16,
) -> int:
    """Bytes of one hand-off of an n-token prompt whose last ``transfer_tokens`` the decode
    side lacks: the full layers' for each of those tokens plus, with a window pool
    (``window_bytes_per_token`` and ``window`` > 0), the window layers' for the window's."""
    moved = transfer_tokens * full_bytes_per_token
    if window_bytes_per_token and window:
        kept = handoff_window_tokens(prompt_tokens, transfer_tokens, window, block_size)
        moved += kept * window_bytes_per_token
    return moved


def transfer_s(t: PrefillTerms, prompt_tokens: int, transfer_tokens: int) -> float:
    """Seconds to hand off the ``transfer_tokens`` of an n-token prompt the decode side lacks."""
    moved = handoff_bytes(
        prompt_tokens,
        transfer_tokens,
        t.kv_bytes_per_token,
        t.window_kv_bytes_per_token,
        t.kv_window,
        t.block_size,
    )
    return moved / t.transfer_bytes_per_s
