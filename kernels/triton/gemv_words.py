"""What the packed steps share (:mod:`.int4_fp16`, :mod:`.fp8_gemv`, the int4 tiles of
:mod:`.quant_tiles`).

Both read a row-major weight as 32-bit words (eight int4 or four e4m3 values each), a
``[BLOCK_N, WORDS]`` tile a K step, and keep the words of the next two steps in flight
while a step computes: Triton pipelines only loads that feed ``tl.dot``, and with a
one-step prefetch the compiler issued the load at the end of the loop body, just before
its use. At one row a GEMV is all weight stream, so bytes in flight are what keeps the
memory system busy.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def step_words(w_rows, n_ok, k0, k_end, stride_wk, VALUES: tl.constexpr, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """int32 [BLOCK_N, WORDS]: the words of the K step at ``k0``, ``VALUES`` weights a word
    (zeros from ``k_end`` on; ``EVEN_K``: every step is whole)."""
    offs_w = tl.multiple_of(k0 // VALUES + tl.arange(0, WORDS), WORDS)
    if EVEN_K:  # whole steps: one test for the step
        w_ok = tl.zeros([WORDS], dtype=tl.int32) + k0 < k_end
    else:
        w_ok = offs_w < k_end // VALUES
    return tl.load(w_rows + offs_w[None, :] * stride_wk, mask=n_ok[:, None] & w_ok[None, :], other=0)


@triton.jit
def half_of(bits, HIGH: tl.constexpr):
    """The fp16 in the low or high half of int32 ``bits``, as float32."""
    if HIGH:
        return ((bits >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def x_of(pair, HIGH: tl.constexpr, X_BF16: tl.constexpr):
    """float32 of the low or high column of a pair of x's (bf16 or fp16) columns read as
    one int32: a bf16's bits are a float32's high half."""
    if X_BF16:
        if HIGH:
            return (pair & -65536).to(tl.float32, bitcast=True)
        return (pair << 16).to(tl.float32, bitcast=True)
    return half_of(pair, HIGH)
