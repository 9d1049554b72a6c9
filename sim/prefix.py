"""Prefix caches of simulated replicas, and multi-turn conversations whose prompts are
block-hash chains, so the simulator can run prefix-aware routing.

``SimPrefixCache`` stands for one engine's prefix cache: an LRU of the full blocks' hashes
the engine computed (prompts prefilled there, KV that landed there), bounded by the
replica's KV blocks. Blocks in use by running requests are not told apart from cached ones
(the real pool evicts only free blocks), so a cache under pressure holds slightly more here
than it would. It publishes its stores and evictions through the live
``KVEventPublisher``, which the routers' live ``PrefixIndex`` applies.

``multiturn_requests`` builds the requests of chat conversations: every turn resends a
system prompt shared by several conversations, the conversation's own context and the whole
history. A prompt is only a length in the simulator, so its blocks are named instead of
hashed: block ``i`` of system prompt ``s`` and block ``i`` of conversation ``c`` are fixed
integers, which makes a turn's chain a prefix of the next turn's, as the engine's hashes are.
Arrivals are open loop: a turn arrives its think time after the previous turn arrived, so
on an overloaded cluster a turn can arrive before the previous answer finished (it then
finds less of its history cached, as a real impatient client would).

Never imports torch or Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.deployments.kv_events import KVEventPublisher
from pdserve.engine.kv_events import KVEvents
from pdserve.sim.request import SimRequest


class SimPrefixCache:
    """One replica's cached block hashes, least recently used first."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._stored: list[int] = []
        self._removed: list[int] = []
        self.stored_any = False  # nothing to publish before the first store
        self.publisher = KVEventPublisher(self._drain, self.hashes)

    def __len__(self) -> int:
        return len(self._blocks)

    def held_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of the chain held here (each one found counts as a use)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """The engine computed or received these blocks; the least recently used go."""
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            self._blocks[h] = None
            self._stored.append(h)
            self.stored_any = True
        while len(self._blocks) > self.capacity_blocks:
            old, _ = self._blocks.popitem(last=False)
            self._removed.append(old)

    def hashes(self) -> list[int]:
        return list(self._blocks)

    def _drain(self) -> KVEvents:
        events = KVEvents(stored=tuple(self._stored), removed=tuple(self._removed))
        self._stored, self._removed = [], []
        return events


@dataclass(frozen=True)
class ConversationSpec:
    """Multi-turn chat traffic: lengths in tokens, times in seconds."""

    conversation_rate: float  # Poisson conversation starts per second
    num_conversations: int
    min_turns: int
    max_turns: int
    system_len: int
    num_system_prompts: int
    context_len: tuple[int, int]  # uniform range of each conversation's own context
    user_len: tuple[int, int]  # uniform range of a user message
    output_len: tuple[int, int]  # uniform range of an answer
    think_s: float  # mean exponential pause before a follow-up turn
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversation_rate <= 0 or self.num_conversations < 1:
            raise ValueError("conversation_rate must be > 0 and num_conversations >= 1")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError(f"need 1 <= min_turns <= max_turns, got {self.min_turns}, "
                             f"{self.max_turns}")  # fmt: skip
        if self.system_len < 0 or self.num_system_prompts < 1 or self.think_s < 0:
            raise ValueError("system_len and think_s must be >= 0, num_system_prompts >= 1")
        for name in ("context_len", "user_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi or (name != "context_len" and lo < 1):
                raise ValueError(f"{name} must be a range lo <= hi of positive lengths")


def chain(
    system_id: int, conversation: int, system_len: int, num_tokens: int, bs: int
) -> tuple[int, ...]:
    """The block hashes of a prompt of ``num_tokens`` (its cacheable full blocks, as
    ``prompt_block_hashes``) that opens with system prompt ``system_id``."""
    shared = system_len // bs  # blocks wholly inside the system prompt
    return tuple(
        hash((0, system_id, i)) if i < shared else hash((1, conversation, i))
        for i in range((num_tokens - 1) // bs)
    )


def multiturn_requests(spec: ConversationSpec, block_size: int) -> list[SimRequest]:
    """Every turn of every conversation, in arrival order, ids from 0."""
    rng = np.random.default_rng(spec.seed)
    starts = np.cumsum(rng.exponential(1 / spec.conversation_rate, spec.num_conversations))
    out: list[SimRequest] = []
    for c, start in enumerate(starts - starts[0]):
        system_id = int(rng.integers(spec.num_system_prompts))
        history = spec.system_len + int(rng.integers(spec.context_len[0], spec.context_len[1] + 1))
        t = float(start)
        for k in range(int(rng.integers(spec.min_turns, spec.max_turns + 1))):
            if k:
                t += float(rng.exponential(spec.think_s)) if spec.think_s else 0.0
            prompt = history + int(rng.integers(spec.user_len[0], spec.user_len[1] + 1))
            output = int(rng.integers(spec.output_len[0], spec.output_len[1] + 1))
            req = SimRequest(len(out), t, prompt, output)
            req.block_hashes = chain(system_id, c, spec.system_len, prompt, block_size)
            req.turn = k + 1
            out.append(req)
            history = prompt + output
    out.sort(key=lambda r: r.arrival)
    for i, req in enumerate(out):
        req.rid = i
    return out
