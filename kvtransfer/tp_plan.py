"""Which KV heads move from which prefill rank to which decode rank.

A prefill replica of TP=a and a decode replica of TP=b each spread the model's H KV heads
over their ranks (``rank_heads``: a contiguous share per rank when H >= t, one replicated
head per rank when H < t). A prefill rank sends a decode rank the heads it holds
canonically (never a replica copy) that the decode rank holds: one contiguous slice per
pair, or nothing (``send_slice``). ``plan`` checks a whole pair of replicas: every head of
every decode rank arrives exactly once.

Pure arithmetic over ``KVLayout``s: this module never touches tensors or sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kvtransfer.types import KVLayout, KVLayoutMismatchError


def rank_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[range, int]:
    """The global KV heads rank ``tp_rank`` of ``tp_size`` holds, and its replica index
    (0 = the canonical copy). Raises ValueError when the heads do not split over the ranks."""
    if total_kv_heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(
            f"rank_heads: total_kv_heads={total_kv_heads}, tp_size={tp_size}, "
            f"tp_rank={tp_rank} (need positive sizes and 0 <= tp_rank < tp_size)"
        )
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(
                f"total_kv_heads ({total_kv_heads}) is not a multiple of tp_size ({tp_size})"
            )
        per = total_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per), 0
    if tp_size % total_kv_heads:
        raise ValueError(
            f"tp_size ({tp_size}) must be a multiple of total_kv_heads ({total_kv_heads}) "
            "when it exceeds it"
        )
    copies = tp_size // total_kv_heads
    head = tp_rank // copies
    return range(head, head + 1), tp_rank % copies


def rank_layout(model_layout: KVLayout, tp_size: int, tp_rank: int) -> KVLayout:
    """The layout of rank ``tp_rank``'s pool, from the layout of the whole model's pool."""
    total = model_layout.heads_total
    heads, replica = rank_heads(total, tp_size, tp_rank)
    return model_layout.model_copy(
        update={
            "num_kv_heads": len(heads),
            "kv_head_start": heads.start,
            "total_kv_heads": total,
            "kv_head_replica": replica,
            "tp_size": tp_size,
            "tp_rank": tp_rank,
        }
    )


@dataclass(frozen=True)
class HeadSlice:
    """The heads one prefill rank sends one decode rank: ``num_heads`` global heads from
    ``first_head``, at head offset ``src_start`` of the sender's pool and ``dst_start`` of
    the receiver's."""

    first_head: int
    num_heads: int
    src_start: int
    dst_start: int

    @property
    def heads(self) -> range:
        return range(self.first_head, self.first_head + self.num_heads)

    @property
    def src(self) -> slice:
        """The sender pool's local head slice."""
        return slice(self.src_start, self.src_start + self.num_heads)

    @property
    def dst(self) -> slice:
        """The receiver pool's local head slice."""
        return slice(self.dst_start, self.dst_start + self.num_heads)


def check_pair(sender: KVLayout, receiver: KVLayout) -> None:
    """Raise ``KVLayoutMismatchError`` (naming both sides' values) unless heads can be
    mapped between the two pools: same model, layers, head size, block size, dtype and
    total heads, each side's heads inside the model's."""
    problem = sender.mismatch(receiver)
    if problem is not None:
        raise KVLayoutMismatchError(
            f"KV layout mismatch (local=prefill {sender.describe_heads()}, peer=decode "
            f"{receiver.describe_heads()}): {problem}"
        )


def send_slice(sender: KVLayout, receiver: KVLayout) -> HeadSlice | None:
    """The heads ``sender`` sends ``receiver``: its canonical heads that the receiver holds
    (None when there are none, e.g. a replica copy or disjoint ranges)."""
    check_pair(sender, receiver)
    mine, theirs = sender.canonical_heads, receiver.kv_heads
    lo, hi = max(mine.start, theirs.start), min(mine.stop, theirs.stop)
    if lo >= hi:
        return None
    return HeadSlice(
        first_head=lo,
        num_heads=hi - lo,
        src_start=lo - sender.kv_head_start,
        dst_start=lo - receiver.kv_head_start,
    )


def plan(
    prefill: Sequence[KVLayout], decode: Sequence[KVLayout]
) -> dict[tuple[int, int], HeadSlice]:
    """Every (prefill index, decode index) pair that moves heads, with its slice.

    Raises ``KVLayoutMismatchError`` for a pair whose heads cannot be mapped, and
    ValueError unless every head of every decode rank comes from exactly one prefill rank."""
    if not prefill or not decode:
        raise ValueError(
            f"plan: needs prefill and decode ranks, got {len(prefill)} and {len(decode)}"
        )
    slices: dict[tuple[int, int], HeadSlice] = {}
    for j, dst in enumerate(decode):
        sources: dict[int, list[int]] = {h: [] for h in dst.kv_heads}
        for i, src in enumerate(prefill):
            part = send_slice(src, dst)
            if part is None:
                continue
            slices[(i, j)] = part
            for h in part.heads:
                sources[h].append(i)
        missing = [h for h, who in sources.items() if not who]
        twice = {h: who for h, who in sources.items() if len(who) > 1}
        if missing:
            raise ValueError(
                f"plan: decode rank {j} ({dst.describe_heads()}) gets no canonical copy of "
                f"heads {missing} from the prefill ranks "
                f"{[p.describe_heads() for p in prefill]}"
            )
        if twice:
            raise ValueError(
                f"plan: decode rank {j} ({dst.describe_heads()}) would get heads more than "
                f"once: {', '.join(f'head {h} from prefill ranks {w}' for h, w in twice.items())}"
            )
    return slices
