"""Random paged-attention batches (fixed seeds) for the kernel tests and
``pdserve.kernels.triton.gpu_check``.

Not used by the serving path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ATTN_TOL",
    "PagedBatch",
    "make_batch",
    "max_abs_error",
    "quantize_batch",
    "random_lengths",
]

# Max abs error of attention outputs (values O(1)) against the float32-math reference, per
# dtype: bfloat16 keeps 8 mantissa bits (and the Triton interpreter truncates, not rounds).
ATTN_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass(frozen=True)
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [N, B, Hkv, D]
    v_cache: torch.Tensor  # [N, B, Hkv, D]
    cu_seqlens_q: torch.Tensor  # [S+1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, M] int32, unused entries -1
    scale: float

    def attention_args(
        self,
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float
    ]:
        """Positional arguments of ``ops.paged_attention``."""
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.cu_seqlens_q,
            self.seq_lens,
            self.block_tables,
            self.scale,
        )

    def decode_args(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """Positional arguments of ``ops.paged_decode_attention`` (every q_len must be 1)."""
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.scale)


def make_batch(
    seed: int,
    q_lens: list[int],
    ctx_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    spare_blocks: int = 7,
    device: torch.device | str = "cpu",
) -> PagedBatch:
    """Sequences with shuffled, non-contiguous blocks; ``ctx_lens`` include the new tokens.

    Unused block-table entries are -1, so kernels that read past a sequence's blocks fail.
    """
    if not all(0 < q <= c for q, c in zip(q_lens, ctx_lens, strict=True)):
        raise ValueError("q_lens: each must be in [1, its context length]")
    gen = torch.Generator().manual_seed(seed)
    data_gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [(c + block_size - 1) // block_size for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=data_gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=data_gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + 1  # one extra column of padding
    block_tables = torch.full((len(ctx_lens), width), -1, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn((int(cu[-1]), num_q_heads, head_dim), generator=data_gen, device=device)
    return PagedBatch(
        q=q.to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        scale=head_dim**-0.5,
    )


def quantize_batch(
    batch: PagedBatch, kv_dtype: torch.dtype
) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    """``batch`` with its caches quantized to ``kv_dtype`` (int8 / float8_e4m3fn) at
    per-head absmax scales; returns it with ``k_scale`` and ``v_scale`` ([Hkv] float32)."""
    from dataclasses import replace

    from pdserve.kernels.kv_quant import kv_qmax, quantize_kv

    qmax = kv_qmax(kv_dtype)
    out = []
    for cache in (batch.k_cache, batch.v_cache):
        n, b, h, d = cache.shape
        scale = cache.float().abs().amax(dim=(0, 1, 3)).clamp(min=1e-6) / qmax
        flat = quantize_kv(cache.reshape(n * b, h, d), scale, kv_dtype)
        out.append((flat.view(n, b, h, d), scale.contiguous()))
    (kq, ks), (vq, vs) = out
    return replace(batch, k_cache=kq, v_cache=vq), ks, vs


def random_lengths(
    seed: int, num_seqs: int, *, max_ctx: int, max_new: int, decode_every: int = 2
) -> tuple[list[int], list[int]]:
    """Mixed batch: every ``decode_every``-th sequence decodes (q_len 1), the rest prefill a
    chunk of up to ``max_new`` tokens after a cached prefix; total contexts in [1, max_ctx]."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = [], []
    for s in range(num_seqs):
        ctx = int(torch.randint(1, max_ctx + 1, (1,), generator=gen))
        if s % decode_every == 0:
            q_len = 1
        else:
            q_len = int(torch.randint(1, min(max_new, ctx) + 1, (1,), generator=gen))
        q_lens.append(q_len)
        ctx_lens.append(ctx)
    return q_lens, ctx_lens


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference; inf on a shape/dtype mismatch or a NaN."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return float("inf")
    if actual.numel() == 0:
        return 0.0
    err = (actual.float() - expected.float()).abs().max().item()
    return err if err == err else float("inf")
