"""What the packed steps share (:mod:`.int4_fp16`, :mod:`.fp8_gemv`, the int4 tiles of
:mod:`.quant_tiles`).

Both read a row-major weight as 32-bit words (eight int4 or four e4m3 values each), a
``[BLOCK_N, WORDS]`` tile a K step, and keep the words of the next two steps in flight
while a step computes: Triton pipelines only loads that feed ``tl.dot``, and with a
one-step prefetch the compiler issued the load at the end of the loop body, just before
its use. At one row a GEMV is all weight stream, so bytes in flight are what keeps the
memory system busy.

They (and the FP8 tiles) also read per-row scales with :func:`row_values`, in the layout
of the tile they scale, so no step waits on a layout change through shared memory.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def step_words(w_rows, n_ok, k0, k_end, stride_wk, VALUES: tl.constexpr, WORDS: tl.constexpr, EVEN_K: tl.constexpr,
               VEC: tl.constexpr = 4):
    """int32 [BLOCK_N, WORDS]: the words of the K step at ``k0``, ``VALUES`` weights a word.

    ``n_ok`` None: every row of ``w_rows`` is a real one (the caller points rows past N at
    row 0 and never stores them), so no row is masked. ``EVEN_K`` (every step whole): a
    step from ``k_end`` on, a prefetch past the split's end, reads the split's last step
    again, never used, rather than being masked. Without either mask the loads need no
    predicates nor zeroed registers (4 x 16 bytes a step at 128 rows x 4 warps: 9 sm_90
    instructions fewer of 413); otherwise zeros from ``k_end`` on.

    ``VEC``: the words a thread loads from a row at once. At 4 (16 bytes) a thread of the
    128-row, 8-warp tile holds 2 rows x 4 words, at 2 it holds 4 rows x 2 words: half the
    columns of x to convert for as many words (sm_90 under Triton 3.6, int4 with
    ``unroll``: 224 -> 200 instructions a step; FP8 64 rows x 8 warps: 157 -> 133)."""
    # a prefetch past the split's end reads its last step again (k_end is a whole step past k_begin)
    k_at = tl.minimum(k0, k_end - WORDS * VALUES) if EVEN_K else k0
    if VEC < 4:  # the hints sized as the loads should be (a hint binds where its value is made)
        offs_w = tl.max_contiguous(tl.multiple_of(k_at // VALUES + tl.arange(0, WORDS), VEC), VEC)
    else:
        offs_w = tl.multiple_of(k_at // VALUES + tl.arange(0, WORDS), WORDS)
    ptrs = w_rows + offs_w[None, :] * stride_wk
    if EVEN_K and n_ok is None:
        words = tl.load(ptrs)
    elif EVEN_K:
        words = tl.load(ptrs, mask=n_ok[:, None], other=0)
    elif n_ok is None:
        words = tl.load(ptrs, mask=(offs_w < k_end // VALUES)[None, :], other=0)
    else:
        words = tl.load(ptrs, mask=n_ok[:, None] & (offs_w < k_end // VALUES)[None, :], other=0)
    return words


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


@triton.jit
def row_values(ptrs, ASM: tl.constexpr):
    """float32 of the floats (2 or 4 bytes) at ``ptrs``, a row's scale each, read by PTX with
    ``ASM`` so the values land in the layout of ``ptrs``, which Triton derives from the
    tile they scale. A tl.load of them took a layout of its own, one row a thread, and came
    back through shared memory with two barriers each K step: every warp of the program
    then waits for the slowest. Without ``ASM`` (the interpreter) a plain load. ``ptrs``
    must all be valid (point rows past the end at a real one)."""
    if not ASM:
        return tl.load(ptrs).to(tl.float32)
    # 64-bit addresses in and integer registers out, the float type by bitcast: the
    # plainest operands inline PTX takes
    addrs = ptrs.to(tl.int64)
    if ptrs.dtype.element_ty.primitive_bitwidth == 32:
        bits = tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [addrs], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        bits = tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [addrs], dtype=tl.int16,
                                         is_pure=True, pack=1)
    return bits.to(ptrs.dtype.element_ty, bitcast=True).to(tl.float32)
