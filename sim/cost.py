"""Engine cost models: how long one continuous-batching step takes, what the KV cache holds,
and how long a prompt's KV takes to move from a prefill to a decode replica.

A step is described by four numbers, whatever mix of prefill chunks and decodes it holds:

- ``tokens``: every token the step computes (prefill chunk tokens + one per decode);
- ``prefill_attn``: token-context pairs of the prefill chunks (a chunk of n tokens starting
  at position s attends to n * (s + n / 2) keys);
- ``decode_seqs``: sequences that decode one token;
- ``decode_ctx``: context tokens those decodes read from the KV cache.

Two models answer ``step_s``: ``RooflineCost`` (GPU datasheet numbers x achievable fractions)
and ``ProfileCost`` (a step-time profile measured with the real engine by
``pdserve.sim.profile``). Both are linear in ``decode_ctx`` for a fixed batch, which lets the
replica model advance a decode-only batch many steps at once. Pure arithmetic: no torch.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pdserve.sim.hardware import GPUS, LINKS, MODELS, GPUSpec, LinkSpec, ModelShape, lookup


class CostModel(Protocol):
    """What the simulated engine asks of a cost model."""

    kv_bytes_per_token: int
    kv_capacity_tokens: int  # KV cache of one replica, in tokens

    def step_s(self, tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: int) -> float:
        """Seconds one engine step takes."""
        ...

    def transfer_s(self, prompt_tokens: int) -> float:
        """Seconds to move one prompt's KV from a prefill replica to a decode replica."""
        ...


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of the datasheet peaks (vLLM-class engines on Hopper reach about
    half of peak FLOP/s on long prefills and most of HBM bandwidth on large decode batches).
    """

    mfu: float = 0.55
    mbu: float = 0.80
    step_overhead_s: float = 0.0015  # launch + scheduling per step (CUDA graphs for decodes)
    memory_utilization: float = 0.90  # share of HBM the engine may use
    activation_reserve_bytes: float = 2e9  # per GPU: activations, graphs, allocator slack


class RooflineCost:
    """Step time = max(compute, memory traffic) + per-step overhead + tensor-parallel
    all-reduces, for one replica of ``tp`` GPUs."""

    def __init__(
        self,
        model: ModelShape,
        gpu: GPUSpec,
        *,
        tp: int = 1,
        link: LinkSpec | None = None,
        eff: Efficiency | None = None,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.model, self.gpu, self.tp = model, gpu, tp
        self.link = link or LINKS["nvlink"]
        self.eff = eff or Efficiency()
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.num_layers = model.num_layers
        free = (
            gpu.memory_bytes * self.eff.memory_utilization - self.eff.activation_reserve_bytes
        ) * tp - model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) does not fit on "
                f"{tp} x {gpu.name}; raise tp"
            )
        self.kv_capacity_tokens = int(free // model.kv_bytes_per_token)
        m = model
        self._flops_per_token = 2.0 * (m.matmul_params - m.vocab * m.hidden)
        self._flops_per_sample = 2.0 * m.vocab * m.hidden
        self._attn_flops_per_pair = 4.0 * m.num_layers * m.num_heads * m.head_dim
        self._weight_bytes = model.weight_bytes  # a computed property: once, not per step
        self._peak_flops = gpu.bf16_flops * self.eff.mfu * tp
        self._peak_bytes = gpu.hbm_bytes_per_s * self.eff.mbu * tp
        # Ring all-reduce of the hidden states, twice per layer, over NVLink.
        nvlink = gpu.nvlink_bytes_per_s or 32e9  # PCIe 4 x16 when the part has no NVLink
        self._allreduce_s_per_token = (
            0.0
            if tp == 1
            else 2 * m.num_layers * 2 * (tp - 1) / tp * m.hidden * m.bytes_per_param / nvlink
        )
        self._allreduce_fixed_s = 0.0 if tp == 1 else 2 * m.num_layers * 8e-6

    def step_s(self, tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: int) -> float:
        if tokens <= 0:
            return 0.0
        flops = (
            self._flops_per_token * tokens
            + self._flops_per_sample * max(decode_seqs, 1)
            + self._attn_flops_per_pair * (prefill_attn + decode_ctx)
        )
        traffic = self._weight_bytes + self.kv_bytes_per_token * (decode_ctx + tokens)
        return (
            max(flops / self._peak_flops, traffic / self._peak_bytes)
            + self.eff.step_overhead_s
            + self._allreduce_s_per_token * tokens
            + self._allreduce_fixed_s
        )

    def transfer_s(self, prompt_tokens: int) -> float:
        # Each of the tp GPUs sends its own KV-head shard over its own link, one message per
        # layer (blocks coalesced, see kvtransfer).
        data = prompt_tokens * self.kv_bytes_per_token / (self.link.bytes_per_s * self.tp)
        return data + self.model.num_layers * self.link.latency_s


def roofline(
    model: str, gpu: str, *, tp: int = 1, link: str = "nvlink", eff: Efficiency | None = None
) -> RooflineCost:
    """``RooflineCost`` from table names (ValueError naming an unknown one)."""
    return RooflineCost(
        lookup(MODELS, model, "model"),
        lookup(GPUS, gpu, "gpu"),
        tp=tp,
        link=lookup(LINKS, link, "link"),
        eff=eff,
    )


@dataclass(frozen=True)
class StepProfile:
    """A measured step-time profile (written by ``pdserve.sim.profile``).

    ``token_points`` / ``token_seconds``: step time vs tokens in the step at short context
    (decode batches for small counts, prefill chunks for large ones, the latter with their
    own attention taken out); ``attn_s_per_pair`` and ``ctx_s_per_token``: the extra time
    per prefill token-context pair and per decode context token.
    """

    token_points: tuple[int, ...]
    token_seconds: tuple[float, ...]
    attn_s_per_pair: float
    ctx_s_per_token: float
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    transfer_bytes_per_s: float
    transfer_latency_s: float
    num_layers: int = 1  # the KV goes layer by layer: the last layer's share shows after
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.token_points) < 2 or len(self.token_points) != len(self.token_seconds):
            raise ValueError(f"profile needs >= 2 matching token points, got {self.token_points}")
        if list(self.token_points) != sorted(set(self.token_points)):
            raise ValueError(f"profile token points must increase: {self.token_points}")

    @classmethod
    def load(cls, path: str | Path) -> StepProfile:
        data = json.loads(Path(path).read_text())
        data.pop("raw", None)  # the measurements behind the fit, kept for people
        data["token_points"] = tuple(data["token_points"])
        data["token_seconds"] = tuple(data["token_seconds"])
        return cls(**data)


class ProfileCost:
    """Step time interpolated from a measured ``StepProfile`` (linear between points,
    extrapolated along the last segment)."""

    def __init__(self, profile: StepProfile) -> None:
        self.profile = profile
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        self.kv_capacity_tokens = profile.kv_capacity_tokens
        self.num_layers = profile.num_layers
        self._x = list(profile.token_points)
        self._y = list(profile.token_seconds)

    def tokens_s(self, tokens: int) -> float:
        x, y = self._x, self._y
        i = min(max(bisect.bisect_left(x, tokens), 1), len(x) - 1)
        x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
        return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), 0.0)

    def step_s(self, tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: int) -> float:
        if tokens <= 0:
            return 0.0
        p = self.profile
        return (
            self.tokens_s(tokens)
            + p.attn_s_per_pair * prefill_attn
            + p.ctx_s_per_token * decode_ctx
        )

    def transfer_s(self, prompt_tokens: int) -> float:
        p = self.profile
        return p.transfer_latency_s + prompt_tokens * p.kv_bytes_per_token / p.transfer_bytes_per_s


class LoopOverheadCost:
    """``cost`` plus ``step_overhead_s`` per step: what a replica's engine loop adds to each
    ``LLMEngine.step()`` that a profile of the bare engine does not time (the step's outputs
    handed to the replica's event loop, its stats, the GIL that loop shares with the engine
    thread). Measured in place by ``bench.sim_validate measure``: the interval between the tokens
    of requests served one at a time, less the profile's step for one decode."""

    def __init__(self, cost: CostModel, step_overhead_s: float) -> None:
        self.cost = cost
        self.step_overhead_s = step_overhead_s
        self.kv_bytes_per_token = cost.kv_bytes_per_token
        self.kv_capacity_tokens = cost.kv_capacity_tokens
        self.num_layers = getattr(cost, "num_layers", 1)

    def step_s(self, tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: int) -> float:
        if tokens <= 0:
            return 0.0
        return (
            self.cost.step_s(tokens, prefill_attn, decode_seqs, decode_ctx) + self.step_overhead_s
        )

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.cost.transfer_s(prompt_tokens)


def loop_overhead_s(
    cost: CostModel, tpot_s: float, prompt_tokens: int, output_tokens: int
) -> float:
    """A replica's engine-loop overhead per step (``LoopOverheadCost``): ``tpot_s``, the
    mean interval between the tokens of requests of ``prompt_tokens`` and ``output_tokens``
    served one at a time (every step a decode of one sequence), less ``cost``'s step for that
    decode at its mean context; never negative."""
    ctx = prompt_tokens + output_tokens / 2
    return max(0.0, tpot_s - cost.step_s(1, 0.0, 1, round(ctx)))


def prefill_s(cost: CostModel, prompt_tokens: int, chunk: int) -> float:
    """Seconds one replica computes a prompt alone in chunks of ``chunk``."""
    seconds, start = 0.0, 0
    while start < prompt_tokens:
        n = min(chunk, prompt_tokens - start)
        seconds += cost.step_s(n, n * (start + n / 2), 0, 0)
        start += n
    return seconds


def prefill_tokens_per_s(cost: CostModel, prompt_tokens: int, chunk: int) -> float:
    """Prefill throughput of one replica computing a prompt alone in chunks of ``chunk``."""
    seconds = prefill_s(cost, prompt_tokens, chunk)
    return prompt_tokens / seconds if seconds > 0 else math.inf
