"""Tensor parallelism: which slice of the model a rank holds, and the collectives it calls.

Megatron-style, as vLLM and SGLang split the Llama family: attention heads and the MLP's
intermediate columns are split evenly over the ranks (column-parallel QKV and gate/up,
row-parallel O and down followed by an all-reduce), the vocabulary is split for the
embedding (masked lookup + all-reduce) and the LM head (all-gather of the sampled rows'
logits). KV heads are split like query heads while there are at least as many as ranks;
with fewer (MQA, or GQA at a high TP) each KV head is replicated on ``tp / num_kv_heads``
consecutive ranks, and the first of them holds the *canonical* copy (the one a KV transfer
sends). ``TPShard`` is the pure arithmetic; ``TPGroup`` adds the process group.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pdserve.engine.loader import ModelConfig


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} of size {self.size}")

    def split(self, n: int, what: str) -> range:
        """This rank's share of ``n`` items split evenly (``n`` must divide by the size)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({self.size})")
        per = n // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, num_kv_heads: int) -> range:
        """Global indices of the KV heads this rank holds."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size ({self.size}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads}) when it exceeds it"
            )
        head = self.rank // (self.size // num_kv_heads)
        return range(head, head + 1)

    def kv_replica(self, num_kv_heads: int) -> int:
        """0 if this rank holds the canonical copy of its KV heads, else its copy's index."""
        if num_kv_heads >= self.size:
            return 0
        return self.rank % (self.size // num_kv_heads)

    def vocab(self, vocab_size: int) -> range:
        """This rank's rows of the (padded) vocabulary: ceil(V / size) each; the last rank's
        range may run past ``vocab_size`` (padding rows, never a real token)."""
        per = -(-vocab_size // self.size)
        return range(self.rank * per, (self.rank + 1) * per)


def check_model(cfg: ModelConfig, size: int) -> None:
    """ValueError naming the dimension that does not split over ``size`` ranks."""
    if cfg.mla is not None:
        _check_mla(cfg, size)
        return
    for rank in (0, size - 1):
        shard = TPShard(rank, size)
        shard.split(cfg.num_heads, "num_attention_heads")
        shard.kv_heads(cfg.num_kv_heads)
        shard.split(cfg.intermediate_size, "intermediate_size")
        if cfg.moe is not None:  # each expert's intermediate columns split like a dense MLP's
            shard.split(cfg.moe.intermediate_size, "moe_intermediate_size")
    if size > 1 and cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({cfg.num_heads}) is not a multiple of "
            f"num_key_value_heads ({cfg.num_kv_heads})"
        )


def _check_mla(cfg: ModelConfig, size: int) -> None:
    """Multi-head latent attention splits its query heads; its one latent KV head is on
    every rank (never split), so the heads, the dense MLPs' and the experts' intermediate
    columns must divide."""
    shard = TPShard(0, size)
    shard.split(cfg.num_heads, f"{cfg.architecture}: num_attention_heads")
    if cfg.moe is None or len(cfg.moe.sparse_layers) < cfg.num_layers:  # dense layers
        shard.split(cfg.intermediate_size, f"{cfg.architecture}: intermediate_size")
    if cfg.moe is not None:
        shard.split(cfg.moe.intermediate_size, f"{cfg.architecture}: moe_intermediate_size")


class TPGroup:
    """A rank's view of its tensor-parallel group: its shard and the collectives.

    With one rank every collective is the identity and no process group exists, so the
    single-device engine pays nothing."""

    def __init__(self, shard: TPShard, group: dist.ProcessGroup | None = None):
        self.shard = shard
        self.group = group
        if shard.size > 1 and group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a process group")

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.group is not None:
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order)."""
        if self.group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def abort(self) -> None:
        """Drop the group (NCCL communicators are aborted: a dead peer would hang a destroy)."""
        group, self.group = self.group, None
        if group is not None and self.size > 1 and group.name() == "nccl":
            with contextlib.suppress(Exception):
                group.abort()


SINGLE = TPGroup(TPShard())


def store_master(host: str, size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on ``host`` and a port the OS picks (``.port``)."""
    return dist.TCPStore(
        host, 0, world_size=size, is_master=True, timeout=_td(timeout_s), wait_for_workers=False
    )


def join_group(
    rank: int,
    size: int,
    store_address: tuple[str, int],
    device: torch.device,
    timeout_s: float,
    store: dist.TCPStore | None = None,
) -> TPGroup:
    """Build this rank's side of the group (blocks until every rank joined): NCCL on CUDA,
    gloo on CPU. An explicit group, not torch's default one, so a replica's KV-transfer
    groups and its TP group never collide. A peer that dies makes the others' collectives
    fail (gloo: the connection closes; NCCL: the timeout) instead of hanging."""
    if size == 1:
        return SINGLE
    host, port = store_address
    if store is None:
        store = dist.TCPStore(host, port, world_size=size, is_master=False, timeout=_td(timeout_s))
    prefixed = dist.PrefixStore("pdserve-tp", store)
    # torch's stubs omit ProcessGroupGloo._Options and type the backends as a ``Backend``
    # without the collectives they bind, hence the ignores below.
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout_s)
        group: dist.ProcessGroup = dist.ProcessGroupNCCL(prefixed, rank, size, opts)  # type: ignore[assignment]
    else:
        gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        gloo._timeout = _td(timeout_s)
        group = dist.ProcessGroupGloo(prefixed, rank, size, gloo)  # type: ignore[assignment]
    return TPGroup(TPShard(rank, size), group)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))
