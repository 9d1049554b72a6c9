"""Native CPU kernels (``kernels/cpu/csrc``): built on first use with the system C++ compiler,
loaded with ctypes.

CPU ops where torch and its libraries have no good fit:

- decode attention (``csrc/paged_decode.cpp``): SDPA's fused kernel pays a fixed cost per
  (sequence, head) that dwarfs the work of a three-row query against a few hundred keys, and
  it needs the paged context gathered into a padded copy first. The kernel reads the blocks
  in place, as vLLM's CPU backend does.
- float32 linears with bfloat16-held weights (``csrc/linear_bf16w.cpp``) for CPUs without
  native bf16 (AVX2 + FMA): a bf16 checkpoint served in float32 there reads half the weight
  bytes per decode step; oneDNN and MKL offer no bf16-weight / fp32-compute matmul on AVX2.
- bfloat16 linears on CPUs with AVX512-BF16 but no AMX (``csrc/linear_bf16.cpp``): oneDNN's
  packed bf16 matmul reads a decode step's weights at well under the memory bandwidth.
- int8-weight linears (W8A8 and weight-only, ``csrc/linear_int8.cpp`` on AVX512-VNNI and
  ``csrc/linear_int8_amx.cpp`` on AMX-INT8 tiles, wrapped by ``kernels/cpu/int8_native.py``):
  torch's int8 matmuls read the weights of a decode step no faster than the bf16 matmul
  reads twice the bytes.
- the row-wise ops of every layer (``csrc/layer_ops.cpp``): residual add + RMSNorm, rotary
  embedding of q and k, SiLU-and-mul; in torch each is a chain of kernels with a full pass
  over memory and a temporary per link (a noticeable share of a bf16 prefill step).
- binding an engine thread's OpenMP team thread by thread (``csrc/omp_team.cpp``): helper
  threads on a node's shared CPUs (``pdserve.kernels.cpu.runtime``); torch can only set a
  thread count, and OpenMP's places bind a whole process.

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
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "available",
    "bind_omp_team",
    "library",
    "bf16_weight_linear",
    "bf16_linear",
    "bf16_linear_available",
    "bf16_linear_float32",
    "bf16_weight_linear_available",
    "pack_bf16_linear_weight",
    "pack_bf16_weight",
    "paged_decode_attention",
    "rms_norm",
    "rotary",
    "silu_and_mul",
]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [
    _CSRC / n
    for n in (
        "paged_decode.cpp",
        "linear_bf16w.cpp",
        "linear_bf16.cpp",
        "linear_int8.cpp",
        "linear_int8_amx.cpp",
        "layer_ops.cpp",
        "omp_team.cpp",
    )
]
_HEADERS = [_CSRC / "cpu_math.h", _CSRC / "int8_rows.h"]
_ABI_VERSION = 2
CACHE_ENV = "PDSERVE_KERNEL_CACHE"
# -fno-trapping-math: nothing here reads floating-point exception flags, and without it GCC
# keeps the exp/softmax/SiLU loops scalar where the CPU has no AVX-512 masks (AVX2): a
# conditional around an operation that could raise an FP exception is not if-converted.
# It changes no result (unlike -ffast-math; contraction stays off where a file says so).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++17",
]

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
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_RMS_NORM_ARGS: list[type[ctypes._SimpleCData[Any]]] = [_I32, _I32, _I32, _I32, _P, _I64]
_RMS_NORM_ARGS += [_P, _I64, _P, _P, _P]
_RMS_NORM_ARGS += [_I64, _I64, _F32]
_LAYER_OPS_ARGS = {
    "pdserve_rotary": [_P, _P, _I64, _I64, _I32, _P, _I64, _I64, _I32, _I32, _P, _P, _I64],
    "pdserve_silu_and_mul": [_P, _I64, _I64, _I64, _P],
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
            [*(src.read_bytes() for src in _SOURCES + _HEADERS), version.encode()]
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
    lib.pdserve_linear_bf16_supported.restype = _I32
    lib.pdserve_bf16_packed_words.argtypes = [_I64, _I64]
    lib.pdserve_bf16_packed_words.restype = _I64
    lib.pdserve_pack_bf16.argtypes = [_P, _I64, _I64, _I64, _P]
    lib.pdserve_pack_bf16.restype = None
    lib.pdserve_linear_bf16.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64]
    lib.pdserve_linear_bf16.restype = None
    lib.pdserve_linear_bf16_f32out.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64]
    lib.pdserve_linear_bf16_f32out.restype = None
    for name, argtypes in _LAYER_OPS_ARGS.items():
        for suffix in _SUFFIX.values():
            getattr(lib, f"{name}_{suffix}").argtypes = argtypes
            getattr(lib, f"{name}_{suffix}").restype = None
    lib.pdserve_rms_norm.argtypes = _RMS_NORM_ARGS
    lib.pdserve_rms_norm.restype = None
    lib.pdserve_bind_omp_team.argtypes = [_I32, _P, _P, _I32]
    lib.pdserve_bind_omp_team.restype = _I32
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _lib = _load()
                _tried = True
    return _lib


def library() -> ctypes.CDLL | None:
    """The loaded library (built on first call), or None where it is unavailable; for the
    wrapper modules of its other kernels (``kernels/cpu/int8_native.py``)."""
    return _library()


def available() -> bool:
    """Whether the native kernels built and loaded on this machine (builds on first call)."""
    return _library() is not None


def bind_omp_team(cpu_sets: Sequence[Collection[int]], helper_nice: int = 0) -> bool:
    """Bind the OpenMP team of the calling thread: thread i of a team of ``len(cpu_sets)``
    to ``cpu_sets[i]`` (thread 0 is the caller), threads 1.. niced to at least
    ``helper_nice``. The team keeps its binding for later regions of any size, torch's
    included. Returns whether every thread bound; False without the library or on another
    OS. The region asks for its own team size: torch's thread count is left as it was."""
    if not cpu_sets or any(not cpus for cpus in cpu_sets):
        raise ValueError(f"cpu_sets: every thread needs at least one CPU, got {cpu_sets!r}")
    lib = _library()
    if lib is None:
        return False
    flat = [c for cpus in cpu_sets for c in sorted(cpus)]
    offsets = [0]
    for cpus in cpu_sets:
        offsets.append(offsets[-1] + len(cpus))
    offs = (ctypes.c_int * len(offsets))(*offsets)
    cpus_arr = (ctypes.c_int * len(flat))(*flat)
    bound = lib.pdserve_bind_omp_team(len(cpu_sets), offs, cpus_arr, helper_nice)
    return bound == len(cpu_sets)


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
    head dim (the caller then uses torch). Arguments are checked by ``pdserve.kernels.ops``."""
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


def _pack(
    what: str,
    weight: torch.Tensor,
    available: bool,
    words: Callable[[int, int], int],  # packed int32 words of an [N, K] weight
    packer: str,
) -> torch.Tensor:
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(
            f"{what}: want a 2-D CPU bfloat16 weight, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}"
        )
    if not available:
        raise RuntimeError(f"{what}: the native kernel is unavailable on this machine")
    n, k = weight.shape
    w = weight.contiguous()
    packed = torch.empty(words(n, k), dtype=torch.int32)
    getattr(_library(), packer)(w.data_ptr(), k, n, k, packed.data_ptr())
    return packed


def _linear(
    fn: str,
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    rows, in_features = x.shape
    out = torch.empty((rows, out_features), dtype=out_dtype or x.dtype)
    if rows:
        getattr(_library(), fn)(
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


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (CPU, bfloat16) in the kernel's panel layout: a flat int32 tensor of
    ``ceil(N / 16) * K * 8`` words (the same bytes as the bf16 weight, padded to 16 rows)."""
    return _pack(
        "pack_bf16_weight",
        weight,
        bf16_weight_linear_available(),
        lambda n, k: -(-n // BF16W_PANEL) * k * 8,
        "pdserve_pack_bf16w",
    )


def bf16_weight_linear(
    x: torch.Tensor,  # [M, K] float32, rows contiguous
    packed: torch.Tensor,  # from pack_bf16_weight
    out_features: int,
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    """``x @ W^T + bias`` in float32 with the packed bf16 ``W``; arguments are checked by
    ``pdserve.kernels.cpu.linear.Bf16WeightLinear``, which owns the packed weight."""
    return _linear("pdserve_linear_bf16w", x, packed, out_features, bias)


def bf16_linear_available() -> bool:
    """Whether ``bf16_linear`` runs here: the library loaded and was built for a CPU with
    AVX512-BF16."""
    lib = _library()
    return lib is not None and bool(lib.pdserve_linear_bf16_supported())


def _bf16_packed_words(n: int, k: int) -> int:
    lib = _library()
    assert lib is not None  # _pack checks availability before it asks
    return int(lib.pdserve_bf16_packed_words(n, k))


def pack_bf16_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (CPU, bfloat16) in ``bf16_linear``'s layout: a flat int32 tensor
    (input pairs interleaved in panels of 16 outputs, zero-padded; csrc/linear_bf16.cpp)."""
    return _pack(
        "pack_bf16_linear_weight",
        weight,
        bf16_linear_available(),
        _bf16_packed_words,
        "pdserve_pack_bf16",
    )


def bf16_linear(
    x: torch.Tensor,  # [M, K] bfloat16, rows contiguous
    packed: torch.Tensor,  # from pack_bf16_linear_weight
    out_features: int,
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] bfloat16
    """``x @ W^T + bias`` with float32 sums rounded once to bf16; arguments are checked by
    ``pdserve.kernels.cpu.linear.Bf16Linear``, which owns the packed weight."""
    return _linear("pdserve_linear_bf16", x, packed, out_features, bias)


def bf16_linear_float32(
    x: torch.Tensor,  # [M, K] float32 or bfloat16
    packed: torch.Tensor,  # from pack_bf16_linear_weight
    out_features: int,
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    """``x @ W^T + bias`` with float32 sums and a float32 result (the logits): ``x`` enters
    rounded to bf16 once, as every input of this kernel does: taking it exactly as well (two
    bf16 parts) cost more than the projection and changed nothing ``bench.numerics``
    measures (docs/cpu.md)."""
    rows = x.to(torch.bfloat16).contiguous()
    return _linear("pdserve_linear_bf16_f32out", rows, packed, out_features, bias, torch.float32)


def _layer_op(name: str, *tensors: torch.Tensor) -> Callable[..., None] | None:
    """The native ``name`` for these tensors' dtype, or None where it does not apply: the
    library is unavailable, or the tensors are not all CPU float32/bfloat16 of one dtype
    with a contiguous last dim."""
    dtype = tensors[0].dtype
    suffix = _SUFFIX.get(dtype)
    if suffix is None or any(
        t.dtype != dtype or t.device.type != "cpu" or (t.numel() and t.stride(-1) != 1)
        for t in tensors
    ):
        return None
    lib = _library()
    return None if lib is None else getattr(lib, f"{name}_{suffix}")


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None,  # [T, H]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``pdserve.kernels.reference.rms_norm_ref`` in one pass (the sum in the residual's
    dtype, the norm in float32, the output rounded once to ``out_dtype``, default x's);
    None where the native op does not apply (2-D float32/bfloat16 CPU tensors with
    contiguous rows only). Shapes are checked by ``pdserve.kernels.ops``."""
    out_dtype = out_dtype or x.dtype
    tensors = [x, weight, *([] if residual is None else [residual])]
    if (
        x.dim() != 2
        or (residual is not None and residual.dim() != 2)
        or out_dtype not in _SUFFIX
        or any(
            t.dtype not in _SUFFIX or t.device.type != "cpu" or (t.numel() and t.stride(-1) != 1)
            for t in tensors
        )
    ):
        return None
    lib = _library()
    if lib is None:
        return None
    rows, hidden = x.shape
    weight = weight.contiguous()
    out = torch.empty((rows, hidden), dtype=out_dtype)
    summed = None if residual is None else torch.empty((rows, hidden), dtype=residual.dtype)
    if rows:
        bf16 = torch.bfloat16
        lib.pdserve_rms_norm(
            x.dtype == bf16,
            residual is not None and residual.dtype == bf16,
            weight.dtype == bf16,
            out_dtype == bf16,
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            None if summed is None else summed.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
        )
    return out if summed is None else (out, summed)


def rotary(
    rows: torch.Tensor,  # [T, D] float32: cos in the first half, sin in the second
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Neox-style rotation of q and k by each token's cos/sin row, float32 math rounded
    once, into new contiguous tensors; None where the native op does not apply."""
    fn = _layer_op("pdserve_rotary", q, k)
    if fn is None or rows.dtype != torch.float32 or rows.device.type != "cpu":
        return None
    rows = rows.contiguous()
    tokens, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((tokens, hq, d), dtype=q.dtype)
    k_out = torch.empty((tokens, hk, d), dtype=k.dtype)
    if tokens:
        fn(
            rows.data_ptr(),
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            hq,
            k.data_ptr(),
            k.stride(0),
            k.stride(1),
            hk,
            d,
            q_out.data_ptr(),
            k_out.data_ptr(),
            tokens,
        )
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:  # [T, 2I] -> [T, I]
    """``silu(x[:, :I]) * x[:, I:]`` in one pass, float32 math rounded once; None where the
    native op does not apply (2-D input only)."""
    if x.dim() != 2 or x.shape[1] % 2:
        return None
    fn = _layer_op("pdserve_silu_and_mul", x)
    if fn is None:
        return None
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype)
    if rows:
        fn(x.data_ptr(), x.stride(0), rows, inter, out.data_ptr())
    return out
