"""Kernel tests run every Triton kernel in Triton's CPU interpreter.

Interpretation is decided when ``@triton.jit`` runs, for triton's own library functions
already at ``import triton``, so TRITON_INTERPRET=1 is set here, at collection, before
anything imports triton. Only on a machine without CUDA: there the compiled kernels are
never used; on a GPU machine the interpreter tests skip (unless TRITON_INTERPRET=1 was set
by hand) and test_gpu_check runs the compiled kernels against the references instead.
Also patches three bugs of triton 3.5.1's interpreter.
"""

from __future__ import annotations

import os
import sys

import torch

TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_interpreter() -> None:
    """Fix three bugs of triton 3.5.1's interpreter that break correct kernels on CPU."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: the triton tests skip themselves
        return
    if getattr(interpreter, "_pdserve_patched", False):
        return
    interpreter._pdserve_patched = True
    _patch_index(interpreter)
    _patch_bf16_dot(interpreter)
    _patch_fp8_rounding(interpreter)


def _patch_fp8_rounding(interpreter) -> None:  # type: ignore[no-untyped-def]
    """A float cast to e4m3 whose rounding carries out of the mantissa (124 -> 128) loses
    the carry and lands a whole binade low (64). Convert with torch instead: round to
    nearest even, as the GPU's ``cvt.rn`` does."""
    import numpy as np
    import triton.language as tl

    original = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):  # type: ignore[no-untyped-def]
        if output_dtype != tl.float8e4nv or input_dtype not in (tl.float32, tl.bfloat16):
            return original(input, input_dtype, output_dtype, rounding_mode)
        if input_dtype == tl.bfloat16:  # stored as its uint16 bit pattern
            x = (input.astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            x = input.astype(np.float32)
        out = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float8_e4m3fn)
        return out.view(torch.uint8).numpy().reshape(input.shape)

    interpreter._convert_float = convert


def _patch_bf16_dot(interpreter) -> None:  # type: ignore[no-untyped-def]
    """``tl.dot`` on bfloat16 multiplies the raw uint16 bit patterns (interpreter stores bf16
    as uint16). Widen bf16 operands to float32 first: exact, and what the GPU's bf16 MMA
    with a float32 accumulator computes."""
    import numpy as np
    import triton.language as tl

    original = interpreter.InterpreterBuilder.create_dot

    def widen(h):  # type: ignore[no-untyped-def]
        if h.dtype != tl.bfloat16:
            return h
        bits = h.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _patch_index(interpreter) -> None:  # type: ignore[no-untyped-def]
    """Work around triton-lang/triton#9171 (fixed after triton 3.5.1).

    numpy >= 2.4 refuses ``int()`` of a 1-element 1-D array, which the 3.5 interpreter uses
    for scalar loop bounds (``for i in range(start, end)`` with tensor bounds).
    """
    original = interpreter._patch_lang_tensor

    def patched(tensor):  # type: ignore[no-untyped-def]
        original(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    interpreter._patch_lang_tensor = patched


_patch_interpreter()
