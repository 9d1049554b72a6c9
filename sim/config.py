"""What the simulator adds to a pdserve ``AppConfig``: the hardware under each pool and the
timings a real cluster has but a config does not state.

The cluster itself (pool sizes and bounds, engine limits, SLOs, policy, routers, transport
timeout, autoscaling delays) comes from the very ``AppConfig`` the real cluster deploys, so
a YAML under ``configs/`` simulates as it serves.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.deployments.config import PoolRole

ROLES: tuple[PoolRole, ...] = ("prefill", "decode")  # the pools, in reporting order


class SharedCpuSettings(BaseModel):
    """The CPUs a local cluster's serving processes share with engines that have no CPUs of
    their own (``pdserve.sim.shared_cpu``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    roles: tuple[PoolRole, ...] = Field(
        description="Pools whose engines compute on the shared CPUs (the cluster's CPU plan "
        "gives them none of their own); none: the serving path still queues its work there, "
        "and the tokens it streams wait behind it."
    )
    num_cpus: int = Field(default=1, ge=1, description="How many CPUs are shared.")
    s_per_request: float = Field(
        ge=0,
        description="CPU seconds the serving path (ingress, proxy, the decode replica's own "
        "threads) spends on the shared CPUs per request, besides its output tokens, measured.",
    )
    s_per_output_token: float = Field(
        default=0.0,
        ge=0,
        description="CPU seconds the serving path spends on the shared CPUs per output token "
        "it streams (the decode replica's loop, the ingress, the proxy), measured: this load "
        "follows the tokens the decode engines emit, so it peaks while they decode bursts.",
    )
    s_per_decode_step: float = Field(
        default=0.0,
        ge=0,
        description="CPU seconds the serving path spends on the shared CPUs per decode step "
        "that streams tokens, whatever its batch (the decode replica's loop wakes once per "
        "step and hands that step's tokens out; each hop handles the chunks that arrive "
        "together in one pass), measured: a token streamed in a batch of n costs "
        "s_per_output_token + s_per_decode_step / n.",
    )
    s_per_prompt_token: float = Field(
        default=0.0,
        ge=0,
        description="CPU seconds the serving path spends on the shared CPUs per prompt token "
        "(tokenizing, the token ids through each hop, receiving the KV), measured; counted "
        "with the request's arrival.",
    )
    engine_s_per_request: float = Field(
        default=0.0,
        ge=0,
        description="CPU seconds an engine process on the shared CPUs spends per request "
        "besides its profiled engine steps (its RPC, the KV send, Python per request), "
        "measured: the process's CPU time less the profile's compute of its prompts. It runs "
        "at the same share as the steps and holds up the next one.",
    )
    engine_s_per_prompt_token: float = Field(
        default=0.0,
        ge=0,
        description="Per prompt token, the same (the per-layer KV send of a prompt), measured.",
    )
    background: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Fraction of the shared CPUs the cluster's daemons use with nothing to serve.",
    )


class SimSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus_per_prefill_replica: int = Field(
        default=1, ge=1, description="GPUs (tensor-parallel degree) of one prefill replica."
    )
    gpus_per_decode_replica: int = Field(
        default=1, ge=1, description="GPUs (tensor-parallel degree) of one decode replica."
    )
    rpc_s: float = Field(
        default=0.001,
        ge=0,
        description=(
            "One hop between processes (ingress -> decode, decode -> prefill and back): "
            "Serve's handle call, serialisation, the network."
        ),
    )
    ingress_s: float = Field(
        default=0.002,
        ge=0,
        description="Ingress work before a request reaches a decode replica (parse, tokenize).",
    )
    replica_startup_s: float = Field(
        default=60.0,
        ge=0,
        description="From an autoscaler's scale-up to the new replica serving (weights load).",
    )
    autoscale_period_s: float = Field(
        default=1.0, gt=0, description="How often the autoscaling policies are asked."
    )
    autoscaling_policy: Literal["deployment", "application"] = Field(
        default="deployment",
        description=(
            "Which live autoscaling the cluster runs: one policy per pool as `serve.run` "
            "attaches them, or the joint application-level policy a Serve config deploys."
        ),
    )
    look_back_s: float = Field(
        default=10.0, gt=0, description="Window the autoscaling metrics average over."
    )
    macro_steps: bool = Field(
        default=True,
        description="Advance decode-only batches many steps per event (exact; much faster).",
    )
    shared_cpu: SharedCpuSettings | None = Field(
        default=None,
        description="Engines computing on CPUs shared with the serving processes (a small "
        "local cluster); None = every engine has its hardware to itself.",
    )
    max_queue_s: float = Field(
        default=600.0,
        gt=0,
        description="A request not placed on a decode replica after this long fails.",
    )
