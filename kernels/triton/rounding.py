"""float32 -> bfloat16 rounding done on the bits, for kernels whose tests run in Triton's
interpreter: the GPU's cast rounds to nearest even, but the interpreter truncates, which
would hide every rounding point of a kernel from its CPU tests."""

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


def interpreted_bf16(t: torch.Tensor) -> bool:
    """Whether ``t`` is a bf16 tensor that Triton's interpreter (CPU tensors) will see."""
    return t.device.type != "cuda" and t.dtype == torch.bfloat16
