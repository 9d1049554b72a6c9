"""Native CPU kernels (``kernels/csrc``): built on first use with the system C++ compiler,
loaded with ctypes.

Two CPU ops where torch and its libraries have no good fit:

- decode attention (``csrc/paged_decode.cpp``): SDPA's fused kernel pays a fixed cost per
  (sequence, head) that dwarfs the work of a three-row query against a few hundred keys, and
  it needs the paged context gathered into a padded copy first. The kernel reads the blocks
  in place, as vLLM's CPU backend does.
- float32 linears with bfloat16-held weights (``csrc/linear_bf16w.cpp``) for CPUs without
  native bf16 (AVX2 + FMA): a bf16 checkpoint served in float32 there reads half the weight
  bytes per decode step; oneDNN and MKL offer no bf16-weight / fp32-compute matmul on AVX2.

The library is plain C ABI (no Python or torch headers), so it builds in about a second;
the build is cached per source, compiler and CPU (``-march=native``) under
``$PDSERVE_KERNEL_CACHE`` or ``~/.cache/pdserve/kernels``. It is loaded after torch and
links ``libgomp.so.1`` by soname, so it runs on torch's own OpenMP threads, as many as
``torch.get_num_threads()``. Where no compiler is found or the build fails, ``available()``
is False and callers keep their torch path; nothing here raises at import time.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = [
    "available",
    "bf16_weight_linear",
    "bf16_weight_linear_available",
    "pack_bf16_weight",
    "paged_decode_attention",
]

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name("csrc") / n for n in ("paged_decode.cpp", "linear_bf16w.cpp")]
_ABI_VERSION = 1
CACHE_ENV = "PDSERVE_KERNEL_CACHE"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_I64, _I32, _F32, _P = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_DECODE_ARGS = [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I32, _P, _I64, _I32, _P, _P]
_DECODE_ARGS += [_I64, _I64, _I32, _I32, _I32, _I32, _I32, _F32]
_DECODE_FN = {
    torch.float32: "pdserve_paged_decode_f32",
    torch.bfloat16: "pdserve_paged_decode_bf16",
}


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown-cpu"
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "pdserve" / "kernels"


def _build(compiler: str) -> Path:
    """Compile the library into the cache (once per source, compiler and CPU)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    key = hashlib.sha256(
        b"\0".join(
            [*(src.read_bytes() for src in _SOURCES), version.encode()]
            + [_cpu_signature().encode()]
            + [f.encode() for f in _FLAGS]
        )
    ).hexdigest()[:16]
    target = _cache_dir() / f"pdserve_native_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: replicas starting together may race here.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, "-o", tmp, *map(str, _SOURCES)],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.warning("no C++ compiler found: CPU decode attention and linears stay on torch")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
        if lib.pdserve_native_abi_version() != _ABI_VERSION:
            raise OSError("stale library: ABI version mismatch")
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("native CPU kernels unavailable (%s); using torch", detail)
        return None
    for fn in _DECODE_FN.values():
        getattr(lib, fn).argtypes = _DECODE_ARGS
        getattr(lib, fn).restype = None
    lib.pdserve_linear_bf16w_supported.restype = _I32
    lib.pdserve_pack_bf16w.argtypes = [_P, _I64, _I64, _I64, _P]
    lib.pdserve_pack_bf16w.restype = None
    lib.pdserve_linear_bf16w.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64]
    lib.pdserve_linear_bf16w.restype = None
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _lib = _load()
                _tried = True
    return _lib


def available() -> bool:
    """Whether the native kernels built and loaded on this machine (builds on first call)."""
    return _library() is not None


def paged_decode_attention(
    q: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
) -> torch.Tensor | None:  # [S, Hq, D], or None where the native kernel does not apply
    """Decode attention read in place from the paged caches, float32 math; None when the
    library is unavailable or the tensors are not CPU float32/bfloat16 with a contiguous
    head dim (the caller then uses torch). Arguments are checked by ``kernels.ops``."""
    fn_name = _DECODE_FN.get(q.dtype)
    if (
        fn_name is None
        or q.device.type != "cpu"
        or k_cache.dtype != q.dtype
        or v_cache.dtype != q.dtype
        or k_cache.stride() != v_cache.stride()
        or k_cache.stride(3) != 1
        or q.stride(2) != 1
    ):
        return None
    lib = _library()
    if lib is None:
        return None
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    if num_seqs == 0:
        return out
    getattr(lib, fn_name)(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_blocks,
        tables.data_ptr(),
        tables.stride(0),
        tables.shape[1],
        lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
    )
    return out


BF16W_PANEL = 16  # output columns per packed panel (csrc/linear_bf16w.cpp)


def bf16_weight_linear_available() -> bool:
    """Whether ``bf16_weight_linear`` runs here: the library loaded and was built for a CPU
    with AVX2 and FMA."""
    lib = _library()
    return lib is not None and bool(lib.pdserve_linear_bf16w_supported())


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (CPU, bfloat16) in the kernel's panel layout: a flat int32 tensor of
    ``ceil(N / 16) * K * 8`` words (the same bytes as the bf16 weight, padded to 16 rows)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(
            f"pack_bf16_weight: want a 2-D CPU bfloat16 weight, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}"
        )
    if not bf16_weight_linear_available():
        raise RuntimeError("pack_bf16_weight: the native bf16-weight linear is unavailable")
    n, k = weight.shape
    w = weight.contiguous()
    packed = torch.empty(-(-n // BF16W_PANEL) * k * 8, dtype=torch.int32)
    _library().pdserve_pack_bf16w(w.data_ptr(), k, n, k, packed.data_ptr())
    return packed


def bf16_weight_linear(
    x: torch.Tensor,  # [M, K] float32, rows contiguous
    packed: torch.Tensor,  # from pack_bf16_weight
    out_features: int,
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    """``x @ W^T + bias`` in float32 with the packed bf16 ``W``; arguments are checked by
    ``kernels.linear.Bf16WeightLinear``, which owns the packed weight."""
    rows, in_features = x.shape
    out = torch.empty((rows, out_features), dtype=torch.float32)
    if rows:
        _library().pdserve_linear_bf16w(
            x.data_ptr(),
            x.stride(0),
            rows,
            in_features,
            packed.data_ptr(),
            out_features,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
        )
    return out
