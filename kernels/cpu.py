"""Fast CPU implementations of the ops the engine runs every step (batched torch, no Python
loop over tokens).

The engine runs these on CPU every step, so they must not be what limits it: decode gathers
the blocks of all sequences at once into a padded ``[S, L, Hkv, D]`` buffer and runs one
grouped-query SDPA call with a length mask; whole float32 prompts of equal length share one
call of SDPA's fused causal kernel; prefill chunks after a cached prefix go through the
decode function's padded path in groups whose padding waste is bounded. KV writes are one
``index_copy_`` per cache; float32 RMSNorm uses torch's fused kernel and rotary writes into
preallocated outputs. Checked against ``kernels/reference.py``.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from kernels import reference

__all__ = [
    "apply_rotary_cpu",
    "paged_attention_cpu",
    "paged_decode_attention_cpu",
    "rms_norm_cpu",
    "write_kv_cpu",
]

# Gathering a step's KV into freshly allocated memory costs more than the attention itself
# (page faults on hundreds of MB), so gathers reuse a per-thread scratch buffer. Thread-local
# because several engines may share a process, each stepping in its own thread.
_MAX_SCRATCH_BYTES = 1 << 30
_scratch = threading.local()

# A group of prefills is padded to its longest query/context; a new group starts when the
# padded work would exceed this multiple of the useful work.
_MAX_PADDING_WASTE = 1.5


def _scratch_buffer(
    slot: str, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """A reusable 1-D buffer of at least ``numel`` elements, or None if too big to keep."""
    if numel * torch.empty((), dtype=dtype).element_size() > _MAX_SCRATCH_BYTES:
        return None
    buffers: dict[tuple, torch.Tensor] = _scratch.__dict__.setdefault("buffers", {})
    key = (slot, dtype, device)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        buffers[key] = buf
    return buf[:numel]


def _gather_padded(
    cache: torch.Tensor,  # [N, B, Hkv, D]
    block_tables: torch.Tensor,  # [P, M]
    max_len: int,
    slot: str,
) -> torch.Tensor:  # [P, nb*B, Hkv, D]
    num_blocks, block_size, hkv, d = cache.shape
    nb = (max_len + block_size - 1) // block_size
    # Entries past a sequence's last block may hold anything (padding); they are masked out,
    # so clamp them to a valid id rather than trusting them.
    ids = block_tables[:, :nb].to(cache.device, torch.int64).clamp(0, num_blocks - 1).flatten()
    if not cache.is_contiguous():  # reshape would copy the whole cache
        return cache[ids].view(block_tables.shape[0], nb * block_size, hkv, d)
    rows = cache.view(num_blocks, block_size * hkv * d)
    buf = _scratch_buffer(slot, ids.numel() * rows.shape[1], cache.dtype, cache.device)
    if buf is None:
        gathered = rows.index_select(0, ids)
    else:
        gathered = torch.index_select(rows, 0, ids, out=buf.view(ids.numel(), rows.shape[1]))
    return gathered.view(block_tables.shape[0], nb * block_size, hkv, d)


def _grouped_attention(
    q: torch.Tensor,  # [P, Lq, Hq, D]
    k: torch.Tensor,  # [P, L, Hkv, D]
    v: torch.Tensor,  # [P, L, Hkv, D]
    q_pos: torch.Tensor,  # [P, Lq] int64: absolute position of each query
    kv_len: torch.Tensor,  # [P] int64: valid context length
    scale: float,
) -> torch.Tensor:  # [P, Lq, Hq, D]
    """Causal, length-masked attention; each KV head is read once for its query-head group."""
    p, lq, hq, d = q.shape
    length, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    # Fold the query-head group into the query axis: [P, Hkv, Lq*G, D].
    qf = q.view(p, lq, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(p, hkv, lq * g, d)
    kf = k.transpose(1, 2)  # [P, Hkv, L, D]
    vf = v.transpose(1, 2)
    k_idx = torch.arange(length, device=q.device)
    # Rows with no visible key (empty sequences) would softmax to NaN: let them see key 0
    # and zero them below.
    empty = kv_len <= 0
    visible = (k_idx[None, None, :] <= q_pos[:, :, None]) & (
        k_idx[None, None, :] < kv_len.clamp(min=1)[:, None, None]
    )  # [P, Lq, L]
    visible = visible.repeat_interleave(g, dim=1)[:, None]  # [P, 1, Lq*G, L]
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=visible, scale=scale)
    out = out.view(p, hkv, lq, g, d).permute(0, 2, 1, 3, 4).reshape(p, lq, hq, d)
    if bool(empty.any()):
        out = out.masked_fill(empty[:, None, None, None], 0.0)
    return out


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
) -> torch.Tensor:  # [S, Hq, D]
    """All decode sequences in one padded grouped-query attention call."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    lens = seq_lens.to(q.device, torch.int64)
    max_len = max(int(lens.max()), 1)
    k = _gather_padded(k_cache, block_tables, max_len, "k")
    v = _gather_padded(v_cache, block_tables, max_len, "v")
    q_pos = (lens - 1).clamp(min=0)[:, None]  # [S, 1]
    return _grouped_attention(q[:, None], k, v, q_pos, lens, scale)[:, 0]


def _plan_groups(q_lens: list[int], ctx_lens: list[int], seqs: list[int]) -> list[list[int]]:
    """Split prefill sequences (sorted by context) into groups with bounded padding waste."""
    order = sorted(seqs, key=lambda s: (ctx_lens[s], q_lens[s]))
    groups: list[list[int]] = []
    current: list[int] = []
    useful = 0
    max_q = max_ctx = 0
    for s in order:
        new_max_q, new_max_ctx = max(max_q, q_lens[s]), max(max_ctx, ctx_lens[s])
        new_useful = useful + q_lens[s] * ctx_lens[s]
        padded = (len(current) + 1) * new_max_q * new_max_ctx
        if current and padded > _MAX_PADDING_WASTE * new_useful:
            groups.append(current)
            current, useful, max_q, max_ctx = [], 0, 0, 0
            new_max_q, new_max_ctx, new_useful = q_lens[s], ctx_lens[s], q_lens[s] * ctx_lens[s]
        current.append(s)
        useful, max_q, max_ctx = new_useful, new_max_q, new_max_ctx
    if current:
        groups.append(current)
    return groups


def paged_attention_cpu(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, M] int32
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Mixed prefill/decode batch: all decodes in one call; whole prompts (nothing cached)
    with SDPA's own causal mask, which skips the masked half (float32: equal lengths
    batched); other prefill chunks in padded groups."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    ctx_lens = seq_lens.tolist()
    num_seqs = len(ctx_lens)
    q_lens = [cu[s + 1] - cu[s] for s in range(num_seqs)]
    decodes = [s for s in range(num_seqs) if q_lens[s] == 1]
    prompts = [s for s in range(num_seqs) if 1 < q_lens[s] == ctx_lens[s]]
    prefills = [s for s in range(num_seqs) if 1 < q_lens[s] < ctx_lens[s]]
    if decodes:
        idx = torch.tensor(decodes, dtype=torch.int64, device=q.device)
        rows = torch.tensor([cu[s] for s in decodes], dtype=torch.int64, device=q.device)
        out[rows] = paged_decode_attention_cpu(
            q[rows], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale
        )
    if q.dtype == torch.float32:
        by_length: dict[int, list[int]] = {}
        for s in prompts:
            by_length.setdefault(ctx_lens[s], []).append(s)
        for length, group in by_length.items():
            _whole_prompts(q, k_cache, v_cache, group, cu, length, block_tables, scale, out)
    else:
        # Half precision keeps SDPA's GQA math path: its rounding follows transformers'.
        for s in prompts:
            length = ctx_lens[s]
            k = _gather_padded(k_cache, block_tables[s : s + 1], length, "k")[0, :length]
            v = _gather_padded(v_cache, block_tables[s : s + 1], length, "v")[0, :length]
            qs = q[cu[s] : cu[s + 1]].transpose(0, 1)  # [Hq, L, D]
            o = F.scaled_dot_product_attention(
                qs,
                k.transpose(0, 1),
                v.transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[cu[s] : cu[s + 1]] = o.transpose(0, 1)
    for group in _plan_groups(q_lens, ctx_lens, prefills):
        inputs = _prefill_group(q, k_cache, v_cache, group, cu, q_lens, ctx_lens, block_tables)
        padded = _grouped_attention(*inputs, scale=scale)  # [P, Lq, Hq, D]
        for i, s in enumerate(group):
            out[cu[s] : cu[s + 1]] = padded[i, : q_lens[s]]
    return out


def _whole_prompts(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: list[int],  # sequences whose new tokens are their whole context, all of ``length``
    cu: list[int],
    length: int,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,  # [T, Hq, D], written in place
) -> None:
    """Causal attention of equal-length whole float32 prompts in one SDPA call.

    Query heads are laid out as [P * Hkv, G, L, D] against K/V expanded (not copied) over
    the group, which keeps SDPA on its fused causal kernel for grouped-query models.
    """
    p, hq, d = len(group), q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    g = hq // hkv
    idx = torch.tensor(group, dtype=torch.int64, device=q.device)
    k = _gather_padded(k_cache, block_tables[idx], length, "k")[:, :length]  # [P, L, Hkv, D]
    v = _gather_padded(v_cache, block_tables[idx], length, "v")[:, :length]
    if p == 1:
        qs = q[cu[group[0]] : cu[group[0]] + length][None]
    else:
        qs = torch.stack([q[cu[s] : cu[s] + length] for s in group])  # [P, L, Hq, D]
    qf = qs.view(p, length, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(p * hkv, g, length, d)
    kf = k.permute(0, 2, 1, 3).reshape(p * hkv, 1, length, d).expand(-1, g, -1, -1)
    vf = v.permute(0, 2, 1, 3).reshape(p * hkv, 1, length, d).expand(-1, g, -1, -1)
    o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    o = o.view(p, hkv, g, length, d).permute(0, 3, 1, 2, 4).reshape(p, length, hq, d)
    for i, s in enumerate(group):
        out[cu[s] : cu[s] + length] = o[i]


def write_kv_cpu(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
) -> None:
    """Store each token's K/V row at its slot: one ``index_copy_`` per cache.

    Needs caches whose block and offset dims flatten into one slot dim (always true for
    the pool layout); otherwise falls back to the reference's two-index assignment.
    """
    n, b, hkv, d = k_cache.shape
    if (
        not (k_cache[0].is_contiguous() and v_cache[0].is_contiguous())
        or k_cache.stride(0) != b * hkv * d
        or v_cache.stride(0) != b * hkv * d
    ):
        reference.write_kv_ref(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(n * b, hkv, d).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(n * b, hkv, d).index_copy_(0, slots, value.to(v_cache.dtype))


def rms_norm_cpu(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with the reference's semantics; float32 uses torch's fused kernel."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return reference.rms_norm_ref(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
    out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return out if residual is None else (out, x)


def apply_rotary_cpu(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [P, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference rotation (same float32 operations, same rounding) written into
    preallocated outputs instead of concatenating temporaries."""
    if q.dtype != torch.float32 or k.dtype != torch.float32:
        return reference.apply_rotary_ref(positions, q, k, cos_sin_cache)
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache[positions.to(cos_sin_cache.device, torch.int64)].float()  # [T, D]
    cos = rows[:, None, :half]
    sin = rows[:, None, half:]
    return _rotate_into(q, cos, sin), _rotate_into(k, cos, sin)


def _rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    lo, hi = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=lo)
    lo.sub_(x2 * sin)
    torch.mul(x2, cos, out=hi)
    hi.add_(x1 * sin)
    return out


def _prefill_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: list[int],
    cu: list[int],
    q_lens: list[int],
    ctx_lens: list[int],
    block_tables: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded inputs of ``_grouped_attention`` for one group of prefill sequences."""
    max_q = max(q_lens[s] for s in group)
    max_ctx = max(ctx_lens[s] for s in group)
    dev = q.device
    idx = torch.tensor(group, dtype=torch.int64, device=dev)
    lens = torch.tensor([ctx_lens[s] for s in group], dtype=torch.int64, device=dev)
    qlen = torch.tensor([q_lens[s] for s in group], dtype=torch.int64, device=dev)
    starts = torch.tensor([cu[s] for s in group], dtype=torch.int64, device=dev)
    j = torch.arange(max_q, dtype=torch.int64, device=dev)
    # Padded query rows repeat the sequence's last token; their outputs are discarded.
    rows = starts[:, None] + torch.minimum(j[None, :], qlen[:, None] - 1)  # [P, max_q]
    q_pad = q[rows]  # [P, max_q, Hq, D]
    q_pos = lens[:, None] - qlen[:, None] + torch.minimum(j[None, :], qlen[:, None] - 1)
    k = _gather_padded(k_cache, block_tables[idx], max_ctx, "k")
    v = _gather_padded(v_cache, block_tables[idx], max_ctx, "v")
    return q_pad, k, v, q_pos, lens
