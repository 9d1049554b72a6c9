"""Moving a request's blocks of one layer: gather into one buffer, scatter out of one, or
copy straight from one pool into another (shared memory / CUDA IPC).

The block dimension is -4 (``[..., N, B, Hkv, D]``), as in pdserve.kernels.ops. On CPU the pools are
seen as rows (one row = one block of one K or V plane), and a copy picks, per call:
- few runs of consecutive ids on both sides: one memcpy per run (``_foreach_copy_``);
- destination ids one run (a gather into a staging buffer): ``index_select(out=...)``;
- source ids one run (a scatter from a staging buffer): ``index_copy_``;
- otherwise: ``index_select`` into a reused scratch buffer, then ``index_copy_``.
Both index kernels are parallel row memcpys, faster than the per-row ``_foreach_copy_`` (a
C++ loop of small copies on one thread). Rows are viewed as
int64 where possible: torch's ``index_copy_`` is several times slower on bytes.
On CUDA, gather and scatter go through ``pdserve.kernels.ops`` (Triton) unless there are few runs.
"""

from __future__ import annotations

import math

import torch

from pdserve.kernels import ops
from pdserve.kvtransfer.staging import Scratch
from pdserve.kvtransfer.types import KVLayout


def runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal (src_start, dst_start, length) runs where both id lists advance by one."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if out:
            s0, d0, n = out[-1]
            if s == s0 + n and d == d0 + n:
                out[-1] = (s0, d0, n + 1)
                continue
        out.append((s, d, 1))
    return out


def _few(num_runs: int, num_blocks: int) -> bool:
    """Whether one copy per run beats the index kernels (long runs, or very few blocks)."""
    return num_runs <= max(2, num_blocks // 8)


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` [..., N, B, H, D] as [prod(...) * N, row] rows (int64 when the row allows),
    if that is a view."""
    if not t.is_contiguous():
        return None
    rows = t.view(math.prod(t.shape[:-3]), math.prod(t.shape[-3:]))
    if (rows.shape[1] * rows.element_size()) % 8 == 0 and t.data_ptr() % 8 == 0:
        return rows.view(torch.int64)
    return rows


def _is_run(ids: list[int]) -> bool:
    return all(b == ids[0] + i for i, b in enumerate(ids))


def copy_blocks(
    src: torch.Tensor,  # [..., N_src, B, H, D]
    src_ids: list[int],
    dst: torch.Tensor,  # [..., N_dst, B, H, D]
    dst_ids: list[int],
    scratch: Scratch | None = None,
) -> None:
    """dst[..., dst_ids[i], :, :, :] = src[..., src_ids[i], :, :, :] for every i.

    ``scratch`` (reused across calls by the caller) holds the intermediate rows when both
    id lists are scattered; without it a temporary is allocated."""
    if src.shape[:-4] != dst.shape[:-4] or src.shape[-3:] != dst.shape[-3:]:
        raise ValueError(f"copy_blocks: shapes {tuple(src.shape)} and {tuple(dst.shape)} differ")
    if src.dtype != dst.dtype:
        raise ValueError(f"copy_blocks: dtypes {src.dtype} and {dst.dtype} differ")
    n = len(src_ids)
    plan = runs(src_ids, dst_ids)
    if src.device.type == "cuda" or dst.device.type == "cuda":
        if _few(len(plan), n) or not (src.is_contiguous() and dst.is_contiguous()):
            # A head slice is strided: torch's copies and index kernels handle it.
            _copy_strided(src, dst, plan, src_ids, dst_ids)
        else:
            src_index = torch.tensor(src_ids, dtype=torch.int64, device=src.device)
            dst_index = torch.tensor(dst_ids, dtype=torch.int64, device=dst.device)
            scatter(gather(src, src_index).to(dst.device), dst, dst_index)
        return
    src_rows, dst_rows = _rows(src), _rows(dst)
    if src_rows is None or dst_rows is None or src_rows.dtype != dst_rows.dtype:
        _copy_strided(src, dst, plan, src_ids, dst_ids)  # e.g. a slice of the heads
        return
    n_src, n_dst = src.shape[-4], dst.shape[-4]
    lead = math.prod(src.shape[:-4])
    if _few(len(plan), n):
        torch._foreach_copy_(
            [dst_rows[j * n_dst + d : j * n_dst + d + k] for j in range(lead) for _, d, k in plan],
            [src_rows[j * n_src + s : j * n_src + s + k] for j in range(lead) for s, _, k in plan],
        )
        return
    src_index = torch.tensor(src_ids, dtype=torch.int64)
    dst_index = torch.tensor(dst_ids, dtype=torch.int64)
    tmp = None
    if not _is_run(dst_ids) and not _is_run(src_ids):
        nbytes = n * src_rows.shape[1] * src_rows.element_size()
        flat = (
            scratch.get(nbytes) if scratch is not None else torch.empty(nbytes, dtype=torch.uint8)
        )
        tmp = flat[:nbytes].view(src_rows.dtype).view(n, src_rows.shape[1])
    for j in range(lead):
        s_rows = src_rows[j * n_src : (j + 1) * n_src]
        d_rows = dst_rows[j * n_dst : (j + 1) * n_dst]
        if _is_run(dst_ids):
            torch.index_select(s_rows, 0, src_index, out=d_rows[dst_ids[0] : dst_ids[0] + n])
        elif _is_run(src_ids):
            d_rows.index_copy_(0, dst_index, s_rows[src_ids[0] : src_ids[0] + n])
        else:
            assert tmp is not None
            torch.index_select(s_rows, 0, src_index, out=tmp)
            d_rows.index_copy_(0, dst_index, tmp)


def _copy_strided(
    src: torch.Tensor,
    dst: torch.Tensor,
    plan: list[tuple[int, int, int]],
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    """Block copy for views that are not plain rows (a slice of the heads, or pools on two
    devices): one strided copy per run when runs are few, else the index kernels."""
    dim = src.dim() - 4
    if _few(len(plan), len(src_ids)):
        torch._foreach_copy_(
            [dst.narrow(dim, d, k) for _, d, k in plan],
            [src.narrow(dim, s, k) for s, _, k in plan],
        )
        return
    picked = src.index_select(dim, torch.tensor(src_ids, dtype=torch.int64, device=src.device))
    index = torch.tensor(dst_ids, dtype=torch.int64, device=dst.device)
    dst.index_copy_(dim, index, picked.to(dst.device))


def gather(kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., N, B, H, D] -> [..., n, B, H, D] contiguous (``kv`` may be a head slice)."""
    if kv.device.type == "cuda":
        if not kv.is_contiguous():  # a head slice: torch's index kernel takes any strides
            return kv.index_select(kv.dim() - 4, block_ids.to(kv.device)).contiguous()
        return ops.gather_blocks(kv, block_ids)
    ids = block_ids.tolist()
    buf = kv.new_empty((*kv.shape[:-4], len(ids), *kv.shape[-3:]))
    copy_blocks(kv, ids, buf, list(range(len(ids))))
    return buf


def scatter(buf: torch.Tensor, kv: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write ``buf`` [..., n, B, H, D] into blocks ``block_ids`` of ``kv`` in place (``kv``
    may be a head slice)."""
    if kv.device.type == "cuda":
        if not kv.is_contiguous():
            kv.index_copy_(kv.dim() - 4, block_ids.to(kv.device), buf.to(kv.device))
        else:
            ops.scatter_blocks(buf, kv, block_ids)
        return
    ids = block_ids.tolist()
    copy_blocks(buf, list(range(len(ids))), kv, ids)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pool_layout(
    kv_cache: torch.Tensor,
    model: str,
    *,
    kv_head_start: int = 0,
    total_kv_heads: int | None = None,
    kv_head_replica: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    kv_scales: torch.Tensor | None = None,  # [L, 2, H] float32: an int8 / float8 pool's
) -> KVLayout:
    """The layout of an engine's pool ``[L, P, N, B, H, D]`` (P = 2 planes, K and V, or 1
    for an MLA latent) filled by model ``model`` (with ``kv_scales``, the scales of a
    quantized pool).

    A tensor-parallel rank's pool holds the global KV heads ``[kv_head_start,
    kv_head_start + H)`` of the model's ``total_kv_heads``; ``kv_head_replica`` > 0 marks a
    replicated copy (more ranks than KV heads), which never sends."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] not in (1, 2):
        raise ValueError(
            f"kv_cache: shape {tuple(kv_cache.shape)} is not [L, P, N, B, H, D] with P 1 or 2"
        )
    num_layers, planes, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return KVLayout(
        model=model,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_planes=planes,
        dtype=dtype_name(kv_cache.dtype),
        kv_head_start=kv_head_start,
        total_kv_heads=total_kv_heads,
        kv_head_replica=kv_head_replica,
        tp_size=tp_size,
        tp_rank=tp_rank,
        kv_scales=() if kv_scales is None else tuple(kv_scales.float().flatten().tolist()),
    )


def heads(kv: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """The view of heads ``[start, start + count)`` of ``kv`` [..., H, D] (``kv`` itself,
    still contiguous, when that is every head)."""
    if start == 0 and count == kv.shape[-2]:
        return kv
    return kv.narrow(-2, start, count)


def registered_layout(
    kv_cache: torch.Tensor,
    model: str,
    layout: KVLayout | None,
    *,
    kv_scales: torch.Tensor | None = None,
) -> KVLayout:
    """The layout a connector registers its engine's pool under: ``layout`` (a tensor-parallel
    rank's, with its head range) checked against ``kv_cache``, or by default the layout of a
    single-rank pool holding every head (``pool_layout``, with ``kv_scales`` for a quantized
    pool). ValueError on a mismatch."""
    if layout is None:
        return pool_layout(kv_cache, model, kv_scales=kv_scales)
    check_pool(kv_cache, layout)
    return layout


def check_pool(kv_cache: torch.Tensor, layout: KVLayout) -> None:
    """Raise ValueError unless ``kv_cache`` is a [L, P, N, B, H, D] pool matching ``layout``."""
    planes = layout.num_planes
    want = (layout.num_layers, planes, None, layout.block_size, layout.num_kv_heads)
    got = tuple(kv_cache.shape)
    if len(got) != 6 or any(
        w is not None and w != g for w, g in zip((*want, layout.head_dim), got, strict=True)
    ):
        raise ValueError(
            f"kv_cache: shape {got} does not match layout "
            f"[num_layers={layout.num_layers}, num_planes={planes}, N, "
            f"block_size={layout.block_size}, "
            f"num_kv_heads={layout.num_kv_heads}, head_dim={layout.head_dim}]"
        )
    if dtype_name(kv_cache.dtype) != layout.dtype:
        raise ValueError(f"kv_cache: dtype {kv_cache.dtype} does not match layout {layout.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache: must be contiguous")
