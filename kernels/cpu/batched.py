"""Fast CPU implementations of the ops the engine runs every step (batched torch, no Python
loop over tokens).

The engine runs these on CPU every step, so they must not be what limits it: decode reads
the paged blocks in place in the native kernel of ``kernels/cpu/native.py`` where it is built
(docs/cpu.md); without it, decode gathers the blocks of
the sequences into a padded ``[P, L, Hkv, D]`` buffer, one group of similar context
lengths at a time, and runs one grouped-query call of SDPA's fused kernel per group with a
length mask; whole prompts of equal length share one call of SDPA's fused causal
kernel; prefill chunks after a cached prefix go in padded groups whose padding waste is
bounded. What derives from a step's metadata alone (grouping, gather indices, masks, rotary
rows) is built once per step and shared by all layers. KV writes are one ``index_copy_``
per cache. RMSNorm (with its residual add), the rotary embedding and SiLU-and-mul run in
one pass each in ``kernels/cpu/native.py`` where it is built, else on torch's kernels (in
float32, rounded once). Checked against ``kernels/reference.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from pdserve.kernels import reference
from pdserve.kernels.cpu import native

__all__ = [
    "apply_rotary_cpu",
    "paged_attention_cpu",
    "paged_decode_attention_cpu",
    "rms_norm_cpu",
    "silu_and_mul_cpu",
    "write_kv_cpu",
]

# Gathering a step's KV into freshly allocated memory costs more than the attention itself
# (page faults on hundreds of MB), so gathers reuse a per-thread scratch buffer. Thread-local
# because several engines may share a process, each stepping in its own thread.
_MAX_SCRATCH_BYTES = 1 << 30
_scratch = threading.local()
_T = TypeVar("_T")

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
    # Buffers made under inference_mode cannot be written outside it (and vice versa).
    key = (slot, dtype, device, torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        buffers[key] = buf
    return buf[:numel]


def _per_step(slot: str, key: tuple[torch.Tensor, ...], build: Callable[[], _T]) -> _T:
    """``build()``, computed once per step and reused by every layer.

    The metadata tensors of a step (block tables, lengths, positions) are the same objects
    in all layers, so what derives from them alone (gather indices, masks, rotary rows) is
    keyed on their identity and version counter (bumped by any in-place change; inference
    tensors have none, and the engine never changes a step's metadata in place). One entry
    per slot and thread; the next step replaces it.
    """
    memo: dict[str, tuple[list[tuple[torch.Tensor, int]], object]] = _scratch.__dict__.setdefault(
        "memo", {}
    )
    stamp = [(t, -1 if t.is_inference() else t._version) for t in key]
    hit = memo.get(slot)
    if (
        hit is not None
        and len(hit[0]) == len(stamp)
        and all(a is b and va == vb for (a, va), (b, vb) in zip(hit[0], stamp, strict=True))
    ):
        return hit[1]  # type: ignore[return-value]
    value = build()
    memo[slot] = (stamp, value)
    return value


def _gather_ids(
    block_tables: torch.Tensor,  # [P, M]
    max_len: int,
    block_size: int,
    num_blocks: int,
    device: torch.device,
) -> torch.Tensor:  # [P * nb] int64: the blocks holding the first max_len slots of each row
    nb = (max_len + block_size - 1) // block_size
    # Entries past a sequence's last block may hold anything (padding); they are masked out,
    # so clamp them to a valid id rather than trusting them.
    return block_tables[:, :nb].to(device, torch.int64).clamp(0, num_blocks - 1).flatten()


def _gather(
    cache: torch.Tensor,  # [N, B, Hkv, D]
    ids: torch.Tensor,  # [P * nb] int64 from _gather_ids
    num_seqs: int,
    slot: str,
) -> torch.Tensor:  # [P, nb*B, Hkv, D]
    num_blocks, block_size, hkv, d = cache.shape
    length = ids.numel() // num_seqs * block_size
    if not cache.is_contiguous():  # reshape would copy the whole cache
        return cache[ids].view(num_seqs, length, hkv, d)
    rows = cache.view(num_blocks, block_size * hkv * d)
    buf = _scratch_buffer(slot, ids.numel() * rows.shape[1], cache.dtype, cache.device)
    if buf is None:
        gathered = rows.index_select(0, ids)
    else:
        gathered = torch.index_select(rows, 0, ids, out=buf.view(ids.numel(), rows.shape[1]))
    return gathered.view(num_seqs, length, hkv, d)


@dataclass(frozen=True)
class _DecodeGroup:
    """Decode sequences of similar length, attended in one call; shared by every layer."""

    rows: torch.Tensor | None  # [P] int64: their rows in q (None: all rows, in order)
    ids: torch.Tensor  # [P * nb] int64: gather indices
    mask: torch.Tensor  # [P, 1, 1, L] bool: key visible
    empty: torch.Tensor | None  # [P] bool: sequences without context (None: there are none)


def _decode_plan(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int
) -> list[_DecodeGroup]:
    """Sequences grouped by length so that padding to a group's longest context stays
    bounded (one long conversation among short ones is not paid for by all of them)."""
    device = block_tables.device
    lens = seq_lens.to(device, torch.int64)
    lens_list = [max(n, 1) for n in lens.tolist()]
    members = _plan_groups([1] * len(lens_list), lens_list, list(range(len(lens_list))))
    groups = []
    for member in members:
        rows = None
        tables, group_lens = block_tables, lens
        if len(members) > 1:
            rows = torch.tensor(member, dtype=torch.int64, device=device)
            tables, group_lens = block_tables[rows], lens[rows]
        longest = max(lens_list[i] for i in member)
        ids = _gather_ids(tables, longest, block_size, num_blocks, device)
        length = ids.numel() // len(member) * block_size
        # Rows with no visible key (empty sequences) would softmax to NaN: let them see
        # key 0 and zero them afterwards.
        visible = torch.arange(length, device=device)[None, :] < group_lens.clamp(min=1)[:, None]
        empty = group_lens <= 0
        groups.append(
            _DecodeGroup(rows, ids, visible[:, None, None, :], empty if bool(empty.any()) else None)
        )
    return groups


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
) -> torch.Tensor:  # [S, Hq, D]
    """Decode attention: the native kernel (blocks read in place) where it is built, else
    one call of SDPA's fused kernel per group of sequences of similar length: K/V
    gathered into a padded ``[P, L, Hkv, D]`` buffer, each query-head group folded into the
    query axis (so each KV head is read once) and a length mask; the grouping, indices and
    masks are built once per step."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    out = native.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if out is not None:
        return out
    num_blocks, block_size = k_cache.shape[:2]
    groups = _per_step(
        f"decode/{num_blocks}/{block_size}",
        (block_tables, seq_lens),
        lambda: _decode_plan(block_tables, seq_lens, block_size, num_blocks),
    )
    out = q.new_empty(q.shape) if len(groups) > 1 else None
    for group in groups:
        qg = q if group.rows is None else q[group.rows]
        o = _attend(qg[:, None], k_cache, v_cache, group.ids, group.mask, group.empty, scale)
        if out is None:
            return o[:, 0]
        out[group.rows] = o[:, 0]
    assert out is not None
    return out


def _attend(
    q: torch.Tensor,  # [P, Lq, Hq, D]: padded queries of P sequences
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,
    ids: torch.Tensor,  # [P * nb] int64 from _gather_ids
    mask: torch.Tensor,  # [P, 1, Lq*G or 1, L] bool: key visible to each (folded) query
    empty: torch.Tensor | None,  # [P] bool: sequences without context, zeroed
    scale: float,
) -> torch.Tensor:  # [P, Lq, Hq, D]
    """One call of SDPA's fused kernel over K/V gathered into a padded buffer, with each
    query-head group folded into the query axis so each KV head is read once."""
    p, lq, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    k = _gather(k_cache, ids, p, "k").transpose(1, 2)  # [P, Hkv, L, D]
    v = _gather(v_cache, ids, p, "v").transpose(1, 2)
    qf = q.reshape(p, lq, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(p, hkv, lq * g, d)
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
    o = o.view(p, hkv, lq, g, d).permute(0, 2, 1, 3, 4).reshape(p, lq, hq, d)
    if empty is not None:
        o = o.masked_fill(empty[:, None, None, None], 0.0)
    return o


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


@dataclass(frozen=True)
class _PromptGroup:
    """Whole prompts (nothing cached before them) of one length: one causal SDPA call."""

    starts: list[int]  # first row of each prompt in q
    length: int
    ids: torch.Tensor  # gather indices of their blocks


@dataclass(frozen=True)
class _PrefillGroup:
    """Prefill chunks after cached context, padded to the group's longest query/context."""

    spans: list[tuple[int, int]]  # rows of each chunk in q
    rows: torch.Tensor  # [P, max_q] int64: q rows (padding repeats a chunk's last row)
    ids: torch.Tensor  # gather indices of their blocks
    mask: torch.Tensor  # [P, 1, max_q*G, L] bool: causal and length mask, head-group folded
    empty: torch.Tensor | None  # [P] bool: chunks without context (None: there are none)


@dataclass(frozen=True)
class _MixedPlan:
    """How one step's mixed batch is split; shared by every layer."""

    decode_rows: torch.Tensor | None  # [Sd] int64 rows of the one-token sequences
    decode_tables: torch.Tensor | None  # [Sd, M]
    decode_lens: torch.Tensor | None  # [Sd]
    prompts: list[_PromptGroup]
    prefills: list[_PrefillGroup]


def _mixed_plan(
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_blocks: int,
    group_size: int,
) -> _MixedPlan:
    dev = block_tables.device
    cu = cu_seqlens_q.tolist()
    ctx_lens = seq_lens.tolist()
    num_seqs = len(ctx_lens)
    q_lens = [cu[s + 1] - cu[s] for s in range(num_seqs)]
    decodes = [s for s in range(num_seqs) if q_lens[s] == 1]
    decode_rows = decode_tables = decode_lens = None
    if decodes:
        idx = torch.tensor(decodes, dtype=torch.int64, device=dev)
        decode_rows = torch.tensor([cu[s] for s in decodes], dtype=torch.int64, device=dev)
        decode_tables, decode_lens = block_tables[idx], seq_lens[idx]
    by_length: dict[int, list[int]] = {}
    for s in range(num_seqs):
        if 1 < q_lens[s] == ctx_lens[s]:
            by_length.setdefault(ctx_lens[s], []).append(s)
    prompts = []
    for length, group in by_length.items():
        idx = torch.tensor(group, dtype=torch.int64, device=dev)
        ids = _gather_ids(block_tables[idx], length, block_size, num_blocks, dev)
        prompts.append(_PromptGroup([cu[s] for s in group], length, ids))
    chunks = [s for s in range(num_seqs) if 1 < q_lens[s] < ctx_lens[s]]
    layout = (block_tables, block_size, num_blocks, group_size)
    prefills = [
        _prefill_group(group, cu, q_lens, ctx_lens, *layout)
        for group in _plan_groups(q_lens, ctx_lens, chunks)
    ]
    return _MixedPlan(decode_rows, decode_tables, decode_lens, prompts, prefills)


def _prefill_group(
    group: list[int],
    cu: list[int],
    q_lens: list[int],
    ctx_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    num_blocks: int,
    group_size: int,  # query heads per KV head
) -> _PrefillGroup:
    dev = block_tables.device
    max_q = max(q_lens[s] for s in group)
    max_ctx = max(ctx_lens[s] for s in group)
    idx = torch.tensor(group, dtype=torch.int64, device=dev)
    lens = torch.tensor([ctx_lens[s] for s in group], dtype=torch.int64, device=dev)
    qlen = torch.tensor([q_lens[s] for s in group], dtype=torch.int64, device=dev)
    starts = torch.tensor([cu[s] for s in group], dtype=torch.int64, device=dev)
    j = torch.minimum(torch.arange(max_q, device=dev)[None, :], qlen[:, None] - 1)
    # Padded query rows repeat the chunk's last token; their outputs are discarded.
    rows = starts[:, None] + j  # [P, max_q]
    q_pos = lens[:, None] - qlen[:, None] + j  # absolute position of each query
    ids = _gather_ids(block_tables[idx], max_ctx, block_size, num_blocks, dev)
    k_idx = torch.arange(ids.numel() // len(group) * block_size, device=dev)
    visible = (k_idx[None, None, :] <= q_pos[:, :, None]) & (
        k_idx[None, None, :] < lens.clamp(min=1)[:, None, None]
    )  # [P, max_q, L]
    mask = visible.repeat_interleave(group_size, dim=1)[:, None]  # [P, 1, max_q*G, L]
    empty = lens <= 0
    spans = [(cu[s], cu[s] + q_lens[s]) for s in group]
    return _PrefillGroup(spans, rows, ids, mask, empty if bool(empty.any()) else None)


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
    of equal length in one call of SDPA's fused causal kernel; other prefill chunks in
    padded groups. The split is planned once per step."""
    out = torch.empty_like(q)
    num_blocks, block_size, hkv, _ = k_cache.shape
    g = q.shape[1] // hkv
    plan = _per_step(
        f"mixed/{num_blocks}/{block_size}/{g}",
        (cu_seqlens_q, seq_lens, block_tables),
        lambda: _mixed_plan(cu_seqlens_q, seq_lens, block_tables, block_size, num_blocks, g),
    )
    if plan.decode_rows is not None:
        assert plan.decode_tables is not None and plan.decode_lens is not None
        out[plan.decode_rows] = paged_decode_attention_cpu(
            q[plan.decode_rows], k_cache, v_cache, plan.decode_tables, plan.decode_lens, scale
        )
    for prompts in plan.prompts:
        _whole_prompts(q, k_cache, v_cache, prompts, scale, out)
    for group in plan.prefills:
        o = _attend(q[group.rows], k_cache, v_cache, group.ids, group.mask, group.empty, scale)
        for i, (start, end) in enumerate(group.spans):
            out[start:end] = o[i, : end - start]
    return out


def _whole_prompts(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _PromptGroup,
    scale: float,
    out: torch.Tensor,  # [T, Hq, D], written in place
) -> None:
    """Causal attention of equal-length whole prompts in one SDPA call.

    Query heads are laid out as [P * Hkv, G, L, D] against K/V expanded (not copied) over
    the group, which keeps SDPA on its fused causal kernel for grouped-query models.
    """
    p, length, hq, d = len(group.starts), group.length, q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    g = hq // hkv
    k = _gather(k_cache, group.ids, p, "k")[:, :length]  # [P, L, Hkv, D]
    v = _gather(v_cache, group.ids, p, "v")[:, :length]
    if p == 1:
        qs = q[group.starts[0] : group.starts[0] + length][None]
    else:
        qs = torch.stack([q[start : start + length] for start in group.starts])  # [P, L, Hq, D]
    qf = qs.view(p, length, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(p * hkv, g, length, d)
    kf = k.permute(0, 2, 1, 3).reshape(p * hkv, 1, length, d).expand(-1, g, -1, -1)
    vf = v.permute(0, 2, 1, 3).reshape(p * hkv, 1, length, d).expand(-1, g, -1, -1)
    o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    o = o.view(p, hkv, g, length, d).permute(0, 3, 1, 2, 4).reshape(p, length, hq, d)
    for i, start in enumerate(group.starts):
        out[start : start + length] = o[i]


def write_kv_cpu(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor | None,  # [T, Hkv, D]; None: a one-plane cache (keys only)
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor | None,  # [N, B, Hkv, D]; None with ``value``
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
) -> None:
    """Store each token's K/V row at its slot: one ``index_copy_`` per cache.

    Needs caches whose block and offset dims flatten into one slot dim (always true for
    the pool layout); otherwise falls back to the reference's two-index assignment.
    """
    n, b, hkv, d = k_cache.shape
    caches = [k_cache] if v_cache is None else [k_cache, v_cache]
    if any(not c[0].is_contiguous() or c.stride(0) != b * hkv * d for c in caches):
        reference.write_kv_ref(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key = slots[keep], key[keep]
        value = None if value is None else value[keep]
    k_cache.view(n * b, hkv, d).index_copy_(0, slots, key.to(k_cache.dtype))
    if value is not None and v_cache is not None:
        v_cache.view(n * b, hkv, d).index_copy_(0, slots, value.to(v_cache.dtype))


def rms_norm_cpu(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with the reference's semantics (the sum in the residual's dtype, float32
    math, one rounding of the output): the native one-pass kernel where it is built, else
    torch's fused kernel in float32."""
    fused = native.rms_norm(x, weight, eps, residual, out_dtype)
    if fused is not None:
        return fused
    out_dtype = out_dtype or x.dtype
    if residual is not None:
        x = residual.float().add(x).to(residual.dtype)
    out = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(out_dtype)
    return out if residual is None else (out, x)


def _rope_halves(
    rows: torch.Tensor,  # [T, D] float32 cos/sin rows of a step's positions
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, 1, D] cos, [T, 1, D] sin with the sign of each half
    half = rows.shape[-1] // 2
    cos, sin = rows[:, :half], rows[:, half:]
    return torch.cat([cos, cos], -1)[:, None], torch.cat([-sin, sin], -1)[:, None]


def apply_rotary_cpu(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [P, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference rotation, float32 math rounded once: in the native kernel where it is
    built, else as ``x * [cos, cos] + [x2, x1] * [-sin, sin]`` (the same products and sums
    as the reference, so the same rounding); the rows of a step are gathered once for all
    layers."""
    rows = _per_step(
        "rope-rows",
        (positions, cos_sin_cache),
        lambda: cos_sin_cache[positions.to(cos_sin_cache.device, torch.int64)].float(),
    )  # [T, D]: cos in the first half, sin in the second
    rotated = native.rotary(rows, q, k)
    if rotated is not None:
        return rotated
    cos, sin = _per_step("rope", (rows,), lambda: _rope_halves(rows))
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    out = xf * cos
    out += torch.cat([xf[..., half:], xf[..., :half]], -1).mul_(sin)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(gate) * up`` of a fused gate/up projection in float32, rounded once: one native
    pass where it is built, else torch's kernels."""
    fused = native.silu_and_mul(x)
    if fused is not None:
        return fused
    gate, up = x.float().split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate).mul_(up).to(x.dtype)
