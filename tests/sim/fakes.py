"""A cost model simple enough to compute a simulation by hand: every token of a step costs
``s_per_token`` seconds, context and attention are free, the KV moves instantly."""

from __future__ import annotations


class LinearCost:
    def __init__(
        self,
        s_per_token: float = 0.001,
        capacity_tokens: int = 1 << 20,
        transfer_s_per_token: float = 0.0,
    ) -> None:
        self.s_per_token = s_per_token
        self.kv_bytes_per_token = 1
        self.kv_capacity_tokens = capacity_tokens
        self.num_layers = 1
        self.transfer_s_per_token = transfer_s_per_token

    def step_s(self, tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: int) -> float:
        return tokens * self.s_per_token

    def transfer_s(self, prompt_tokens: int) -> float:
        return prompt_tokens * self.transfer_s_per_token
