"""The FP8 (e4m3) matrix-vector step for one row of x: four weights a 32-bit word,
converted two at a time by the hardware, multiplied in float32.

At one row an FP8 GEMM has to stream a byte a weight. The value-by-value gemv tile
(:func:`.quant_tiles.quant_gemv_tile`) compiles to about 7.4 sm_90 instructions a weight
with x's tile reshuffled through shared memory each step, near the 8 a weight that the
copy bandwidth leaves; the tensor-core tiles the table picks at one row read at 51-74% of
copy bandwidth (docs/weight-formats.md). This step:

* reads the weight as words, 16 bytes a thread, two K steps ahead (:mod:`.gemv_words`);
  or, with ``STAGED`` (a config's ``staged``), through shared memory: the loop names its
  stages, so Triton's pipeliner turns the word loads into asynchronous copies
  ``STAGED - 1`` steps ahead, which hold no registers while the bytes travel. The one-row
  kernels wait on their loads most of the time (Nsight, session 28): more bytes in flight
  is what they lack, and registers were what capped them;
* turns each half of a word into an fp16 pair with one ``cvt.rn.f16x2.e4m3x2`` (exact:
  every e4m3 value is an fp16 value) and the pairs into float32;
* multiplies in float32 against x's columns, which each thread converts (and, for
  128x128 blocks, multiplies by the step's block scale) once for all the rows it holds.

No fp16 arithmetic, so no overflow for any x: about 2.5 instructions a weight in the
loop. Scales apply where they are uniform: a block scale over the tile's rows is one
number a K step, folded into x; a per-row scale over the whole of K multiplies the sums
once at the end (:func:`uniform_scale` says which; other groupings keep the value-by-value
tile).

The interpreter cannot run PTX: with ``EMULATE`` an e4m3 byte is decoded by arithmetic
on its sign, exponent and mantissa, the same values in the same order of products, so
CPU tests check the indexing and scaling and the GPU tests compare the two.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ninfer_kernels.triton.gemv_words import step_words, x_of

# One word of four e4m3 weights against their four float32 x values: $1 the word, $2..$5
# x, $6 the running sum; $0 the new sum (float32 bits throughout).
_WORD_DOT = tl.constexpr("""
{
.reg .b16 lo, hi, h0, h1, h2, h3;
.reg .b32 p01, p23;
.reg .f32 f0, f1, f2, f3, sum;
mov.b32 {lo, hi}, $1;
cvt.rn.f16x2.e4m3x2 p01, lo;
cvt.rn.f16x2.e4m3x2 p23, hi;
mov.b32 {h0, h1}, p01;
mov.b32 {h2, h3}, p23;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
cvt.f32.f16 f2, h2;
cvt.f32.f16 f3, h3;
mov.b32 sum, $6;
fma.rn.f32 sum, f0, $2, sum;
fma.rn.f32 sum, f1, $3, sum;
fma.rn.f32 sum, f2, $4, sum;
fma.rn.f32 sum, f3, $5, sum;
mov.b32 $0, sum;
}
""")

#: the scale is one number a K step for the tile (folded into x) ...
STEP_SCALE = 1
#: ... or one number a row for all of K (applied to the sums at the end)
ROW_SCALE = 2


def uniform_scale(block: tuple[int, int], block_n: int, k: int) -> int:
    """How :func:`fp8_gemv_row` applies an ``(bn, bk)`` block scale to ``block_n``-row
    tiles: :data:`STEP_SCALE`, :data:`ROW_SCALE`, or 0 when neither holds (the caller
    takes another tile). K steps never straddle a scale group (the caller's BLOCK_K
    divides ``bk``)."""
    bn, bk = block
    if bn % block_n == 0:
        return STEP_SCALE
    if bn == 1 and bk >= k:
        return ROW_SCALE
    return 0


@triton.jit
def _e4m3(byte):
    """float32 of the e4m3 code in the low 8 bits of ``byte`` (emulation: no NaN codes)."""
    exponent = (byte >> 3) & 0xF
    mantissa = (byte & 7).to(tl.float32)
    value = tl.where(exponent == 0, mantissa * 0.001953125,  # subnormal: m * 2**-9
                     (8.0 + mantissa) * tl.exp2((exponent - 10).to(tl.float32)))
    return tl.where((byte & 0x80) != 0, -value, value)


@triton.jit
def _word_dot(word, x0, x1, x2, x3, acc, EMULATE: tl.constexpr):
    if EMULATE:
        acc = acc + _e4m3(word) * x0
        acc = acc + _e4m3(word >> 8) * x1
        acc = acc + _e4m3(word >> 16) * x2
        return acc + _e4m3(word >> 24) * x3
    out = tl.inline_asm_elementwise(_WORD_DOT, "=r,r,r,r,r,r,r", [word, x0, x1, x2, x3, acc],
                                    dtype=tl.int32, is_pure=True, pack=1)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _step_x(x_pairs, k0, k_end, WORDS: tl.constexpr, X_BF16: tl.constexpr, EVEN_K: tl.constexpr):
    """x's columns 4w .. 4w + 3 of the K step at ``k0`` as float32 [1, WORDS] each (one
    8-byte load a word: two raw pairs)."""
    offs_w = tl.multiple_of(k0 // 4 + tl.arange(0, WORDS), WORDS)
    w_ok = (offs_w < k_end // 4) | EVEN_K
    r0, r1 = tl.split(tl.load(x_pairs + offs_w[:, None] * 2 + tl.arange(0, 2)[None, :], mask=w_ok[:, None], other=0))
    r0, r1 = r0[None, :], r1[None, :]
    return x_of(r0, False, X_BF16), x_of(r0, True, X_BF16), x_of(r1, False, X_BF16), x_of(r1, True, X_BF16)


@triton.jit
def fp8_gemv_row(x_row, w_ptr, s_ptr, offs_n, n_ok, k_begin, k_end, stride_wn, stride_sn, stride_sk,
                 group_n, group_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr,
                 X_BF16: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr, AHEAD: tl.constexpr = False,
                 UNROLL: tl.constexpr = 1, VEC: tl.constexpr = 4, STAGED: tl.constexpr = 0):
    """float32 [1, BLOCK_N]: the row of x at ``x_row`` times ``W[offs_n, k_begin:k_end]^T``
    for an e4m3 weight (rows ``stride_wn`` bytes apart, a multiple of 4) with ``(group_n,
    group_k)`` block scales applied as ``SCALE`` says (:func:`uniform_scale`). With
    ``AHEAD`` a step's block scale and its columns of x are loaded one step before (as
    int4's can be: :func:`.int4_fp16.int4_gemv_row`; a table entry's ``ahead``)."""
    WORDS: tl.constexpr = BLOCK_K // 4
    x_pairs = x_row.to(tl.pointer_type(tl.int32), bitcast=True)  # columns (2i, 2i + 1) in word i
    w_rows = _word_rows(w_ptr, offs_n, n_ok, stride_wn)
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    row_block = tl.min(offs_n, 0) // group_n  # every row of the tile shares it (STEP_SCALE)
    scale_row = s_ptr + row_block * stride_sn
    if STAGED > 0:  # the words through shared memory, STAGED - 1 steps ahead (gemv_words)
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGED):
            words = step_words(w_rows, None, k0, k_end, 1, 4, WORDS, EVEN_K, VEC)
            x0, x1, x2, x3 = _step_x(x_pairs, k0, k_end, WORDS, X_BF16, EVEN_K)
            acc = _scaled_step(words, x0, x1, x2, x3, acc, scale_row, k0, group_k, stride_sk, SCALE, EMULATE)
        return _row_sums(acc, s_ptr, offs_n, n_ok, stride_sn, SCALE)
    following = step_words(w_rows, None, k_begin, k_end, 1, 4, WORDS, EVEN_K, VEC)
    after = step_words(w_rows, None, k_begin + BLOCK_K, k_end, 1, 4, WORDS, EVEN_K, VEC)
    next_s = tl.load(scale_row + (k_begin // group_k) * stride_sk) if SCALE == 1 and AHEAD else 1.0
    if AHEAD:
        n0, n1, n2, n3 = _step_x(x_pairs, k_begin, k_end, WORDS, X_BF16, EVEN_K)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, loop_unroll_factor=UNROLL):
        words = following
        following = after
        after = step_words(w_rows, None, k0 + 2 * BLOCK_K, k_end, 1, 4, WORDS, EVEN_K, VEC)
        if AHEAD:
            s, x0, x1, x2, x3 = next_s, n0, n1, n2, n3
            # the next step's; after the last, the last group and (whole steps) the last
            # columns again: no masks
            if SCALE == 1:
                next_s = tl.load(scale_row + (tl.minimum(k0 + BLOCK_K, k_end - 1) // group_k) * stride_sk)
            k_next = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K) if EVEN_K else k0 + BLOCK_K
            n0, n1, n2, n3 = _step_x(x_pairs, k_next, k_end, WORDS, X_BF16, EVEN_K)
        else:
            s = tl.load(scale_row + (k0 // group_k) * stride_sk) if SCALE == 1 else 1.0
            x0, x1, x2, x3 = _step_x(x_pairs, k0, k_end, WORDS, X_BF16, EVEN_K)
        if SCALE == 1:
            x0, x1, x2, x3 = x0 * s, x1 * s, x2 * s, x3 * s
        acc = _word_dot(words, x0, x1, x2, x3, acc, EMULATE)
    return _row_sums(acc, s_ptr, offs_n, n_ok, stride_sn, SCALE)


@triton.jit
def fp8_gemv_two(x_row, w_ptr, s_ptr, rows_a, rows_b, n_ok, k_end, stride_wn, stride_sn, stride_sk,
                 group_n, group_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr,
                 X_BF16: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr, STAGED: tl.constexpr):
    """:func:`fp8_gemv_row` of two row sets at once (a MoE expert's gate rows and their up
    rows, each set inside one block-scale row group): x's columns converted once a step, both
    sets' words staged in one loop (``STAGED`` >= 2 stages), each set scaled by its own block.
    The sums are :func:`fp8_gemv_row`'s, each set's in the same order. The two calls one
    after the other let the second set's loads start only when the first set's loop ended;
    the bf16 and int4 one-token kernels already load both (:mod:`.moe_single_token`)."""
    WORDS: tl.constexpr = BLOCK_K // 4
    x_pairs = x_row.to(tl.pointer_type(tl.int32), bitcast=True)
    w_a = _word_rows(w_ptr, rows_a, n_ok, stride_wn)
    w_b = _word_rows(w_ptr, rows_b, n_ok, stride_wn)
    scale_a = s_ptr + (tl.min(rows_a, 0) // group_n) * stride_sn
    scale_b = s_ptr + (tl.min(rows_b, 0) // group_n) * stride_sn
    acc_a = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    for k0 in tl.range(0, k_end, BLOCK_K, num_stages=STAGED):
        words_a = step_words(w_a, None, k0, k_end, 1, 4, WORDS, EVEN_K)
        words_b = step_words(w_b, None, k0, k_end, 1, 4, WORDS, EVEN_K)
        x0, x1, x2, x3 = _step_x(x_pairs, k0, k_end, WORDS, X_BF16, EVEN_K)
        acc_a = _scaled_step(words_a, x0, x1, x2, x3, acc_a, scale_a, k0, group_k, stride_sk, SCALE, EMULATE)
        acc_b = _scaled_step(words_b, x0, x1, x2, x3, acc_b, scale_b, k0, group_k, stride_sk, SCALE, EMULATE)
    return (_row_sums(acc_a, s_ptr, rows_a, n_ok, stride_sn, SCALE),
            _row_sums(acc_b, s_ptr, rows_b, n_ok, stride_sn, SCALE))


@triton.jit
def _word_rows(w_ptr, offs_n, n_ok, stride_wn):
    """int32 pointers [BLOCK_N, 1] to the first word of rows ``offs_n`` (rows past N point at
    row 0: read, never stored, so no load needs a mask)."""
    safe_n = tl.where(n_ok, offs_n, 0)[:, None]
    return w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + safe_n.to(tl.int64) * (stride_wn // 4)


@triton.jit
def _scaled_step(words, x0, x1, x2, x3, acc, scale_row, k0, group_k, stride_sk, SCALE: tl.constexpr,
                 EMULATE: tl.constexpr):
    """``acc`` plus a staged step's products; under STEP_SCALE x carries the step's block scale."""
    if SCALE == 1:
        s = tl.load(scale_row + (k0 // group_k) * stride_sk)
        x0, x1, x2, x3 = x0 * s, x1 * s, x2 * s, x3 * s
    return _word_dot(words, x0, x1, x2, x3, acc, EMULATE)


@triton.jit
def _row_sums(acc, s_ptr, offs_n, n_ok, stride_sn, SCALE: tl.constexpr):
    """float32 [1, BLOCK_N]: each row's products summed, times its scale under ROW_SCALE."""
    total = tl.sum(acc, 1)
    if SCALE == 2:
        total = total * tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)
    return total[None, :]
