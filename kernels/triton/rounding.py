"""Number formats done by hand in Triton kernels.

Rounding, for kernels whose tests run in Triton's interpreter: the GPU's casts round to
nearest even, but the interpreter truncates float32 -> bfloat16 and drops the carry of
float32 -> float8 e4m3 into the next power of two, which would hide every rounding point
of a kernel from its CPU tests (or move it). And the e2m1 (fp4) decode the nvfp4 weight
and KV kernels share."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def nearest_bf16(v):
    """float32 ``v`` rounded to the nearest bfloat16 (ties to even), still float32."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(v, dtype, ROUND: tl.constexpr):
    """``v.to(dtype)``, rounded by hand with ROUND (bf16 on CPU tensors, see above)."""
    if ROUND:
        v = nearest_bf16(v)
    return v.to(dtype)


@triton.jit
def round_half_even(x):
    """``x`` rounded to the nearest integer, ties to even (as torch.round), for |x| < 2**22."""
    r = tl.floor(x + 0.5)
    return tl.where((r - x == 0.5) & ((r.to(tl.int32) & 1) != 0), r - 1.0, r)


@triton.jit
def round_e4m3(x):
    """float32 ``x`` rounded to the nearest float8 e4m3 value (ties to even, saturating at
    448), still as float32: converting it is then exact on every backend (Triton's
    interpreter drops the carry when rounding up crosses a power of two)."""
    a = tl.minimum(tl.abs(x), 448.0)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits; subnormals below 2**-6
    r = round_half_even(a / ulp) * ulp
    return tl.where(x < 0, -r, r)


def interpreted_bf16(t: torch.Tensor) -> bool:
    """Whether ``t`` is a bf16 tensor that Triton's interpreter (CPU tensors) will see."""
    return t.device.type != "cuda" and t.dtype == torch.bfloat16


@triton.jit
def e2m1_half(code):
    """fp16 value of int32 e2m1 ``code`` (0..15), exactly: the sign and the magnitude's 3 bits
    moved to fp16's bits 15 and 11..9 make the value times 2**-14 (0.5 a subnormal), and
    the product with 2**14 is exact. Integer logic and one multiply, no exp2 or table."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True) * 16384.0
