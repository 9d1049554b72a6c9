"""Window pools across the served P/D split, and the refusal of a peer that lacks one.

A model that mixes sliding-window and full-attention layers (gpt-oss, Gemma 2/3) keeps its
window layers' KV in a pool of their own when its engine's KV connector moves that pool
(``engine/window_kv.py``); the hand-off then sends the window layers only the first decoded
token's window. Both replicas of a hand-off must agree: a prefill replica with a window pool
has no blocks of the window layers outside the window to send, and a decode replica with one
has no room for them. The serving layer therefore builds both pools' connectors to move a
window pool (``window_pool=True``, single-rank and tensor-parallel alike); each engine then
keeps the pool where its model has window layers and ``EngineConfig.window_kv_pool`` is on
(both pools' engines share the model, so they agree). Under tensor parallelism every rank
keeps its heads' window pool and the decode replica sends one window target per rank, as for
the full pool.

A peer that still disagrees (a replica of another pdserve version during a rolling upgrade,
an engine built with other settings) is refused per request with ``WindowPairingError``
(``check_window_pairing``): the prefill call fails before any byte moves and the decode
replica recomputes that prompt locally, as for any failed remote prefill (vLLM's
``kv_load_failure_policy: recompute``). Nothing is mixed: the two layouts never pair.
"""

from __future__ import annotations


class WindowPairingError(ValueError):
    """The prefill and decode replicas of a hand-off disagree about the window pool."""


def check_window_pairing(
    *, prefill_has_window_pool: bool, num_window_targets: int, num_targets: int
) -> None:
    """Refuse a request whose decode replica's window targets do not match this prefill
    replica's pools: one window target per full-pool target (one per decode rank) exactly
    when this side keeps a window pool."""
    if prefill_has_window_pool and num_window_targets == 0:
        raise WindowPairingError(
            "this prefill replica keeps its window layers' KV in a pool of their own and "
            "sends only the first decoded token's window of them, but the decode replica sent "
            "no window-pool target (its engine keeps every block of the window layers); both "
            "pools must keep a window pool or neither: the decode replica recomputes this "
            "prompt locally"
        )
    if not prefill_has_window_pool and num_window_targets:
        raise WindowPairingError(
            f"the decode replica sent {num_window_targets} window-pool target(s), but this "
            "prefill replica keeps every layer's KV in one pool (its engine keeps no window "
            "pool: built with window_kv_pool=False, or another pdserve version); both pools "
            "must keep a window pool or neither: the decode replica recomputes this prompt "
            "locally"
        )
    if num_window_targets and num_window_targets != num_targets:
        raise WindowPairingError(
            f"window_kv_targets: {num_window_targets} given for {num_targets} kv_targets; a "
            "window-pool hand-off has one per decode rank in each pool"
        )
