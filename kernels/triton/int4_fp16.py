"""int4 weights turned into fp16 by bit operations, two values an instruction: the
matrix-vector step for one row of x (:func:`int4_gemv_row`), and the weight tile of the
``tl.dot`` steps for more rows (:func:`int4_fp16_tile`).

At one row an int4 GEMM only has to stream its weight, half a byte a value, so it is
bound by how many instructions each value costs. The value-by-value gemv tile
(:func:`.quant_tiles.quant_gemv_tile`: extract a nibble, make it a float32, multiply)
compiles to about ten sm_90 instructions a value, with x reshuffled through shared
memory eight times a K step; the 27B shape's int4 projections read at 16-24% of copy
bandwidth with it. This step works on 32-bit words and fp16 pairs, two values an
instruction, the way FasterTransformer's and Marlin's int4 kernels do:

* ``lop3(word, 0x000f000f, 0x64006400)`` puts nibbles ``j`` and ``j + 4`` into the
  mantissas of a pair of fp16 1024s: (1024 + q_j, 1024 + q_{j+4}) exactly; the mask
  ``0x00f000f0`` takes the next two nibbles in place, as 1024 + 16 q.
* One fp16 fused multiply-add per pair (by 1/64 or 1/1024, minus (1024 + z) / 64 or
  (64 + z) / 64) leaves (q - z) / 64 exactly: zero points are whole numbers in every
  int4 layout we load. Keeping the weights 64 times smaller keeps a word's eight fp16
  products and their sums (at most 1.9 |x|) far from fp16's limit.
* x's eight columns of the word, paired the same way ((x_0, x_4), (x_1, x_5), ...), are
  converted to fp16 (saturating) once per thread and word, whatever the number of
  weight rows the thread holds.
* Four fp16-pair multiply-adds give the word's two half-sums; they leave as one float32,
  and the group's scale (times 64) applies there.

The fp16 sum of a word's eight products keeps 11 bits, more than a bf16 weight has.
fp16's range bounds both ends: x beyond 65504 saturates there (as in the FP8 and NVFP4
fp16 tiles), and products (q - z) x / 64 below 2**-8 become subnormals whose absolute error
(up to 2**-19 of a unit of x) is a large relative one only when a whole row of x is that
small (rows scaled to 1e-5: 2.6% error, against 0.2% value by value; at 1e-3 and above the
two agree). ``NINFER_PACKED_STEPS=0`` keeps the value-by-value steps; a per-row power of
two applied to x would lift both limits if a model needs it.

For ``tl.dot`` (several rows of x) the same ``lop3`` pairs become a word's eight values
(q - z) in fp16, exact, and x is converted to fp16 (saturating) for the product, which
the tensor cores sum in float32; the group's scale multiplies each K step's partial
product. The value-by-value tile took a nibble at a time from a word loaded once per
nibble (about four instructions a value before the product); this takes nine a word.

The interpreter cannot run PTX: with ``EMULATE`` the same arithmetic runs as Triton
operations (the same pairs and fp16 roundings), so CPU tests check this step's
indexing, pairing and scaling; ptxas checks the assembly when Triton compiles it for
sm_90 (``scripts/triton_ir.py``), and the GPU tests its results.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ninfer_kernels.triton.gemv_words import half_of, row_values, step_words, x_of

#: the weights are taken as (q - z) / WEIGHT_DIVISOR in fp16 (exact; the scale makes up for it)
WEIGHT_DIVISOR = 64.0
_WEIGHT_DIVISOR = tl.constexpr(WEIGHT_DIVISOR)

# One word of eight nibbles against x's four fp16 pairs: $1 the word, $2..$5 the pairs
# (x_j, x_{j+4}) for j = 0..3, $6 -(1024 + z) / 64 twice, $7 -(64 + z) / 64 twice; $0 the
# float32 sum of the word's products with (q - z) / 64 (as bits). 0x2400 is 1/64 in fp16,
# 0x1400 1/1024.
def _nibble_pairs(word: str) -> str:
    """PTX putting the nibbles of ``word`` into fp16 pairs h0..h3 (registers t, h0..h3):
    h0 = (1024 + q_0, 1024 + q_4), h1 = (1024 + 16 q_1, 1024 + 16 q_5), h2 and h3 likewise
    for nibbles 2, 6 and 3, 7."""
    return f"""shr.u32 t, {word}, 8;
lop3.b32 h0, {word}, 0x000f000f, 0x64006400, 0xea;
lop3.b32 h1, {word}, 0x00f000f0, 0x64006400, 0xea;
lop3.b32 h2, t, 0x000f000f, 0x64006400, 0xea;
lop3.b32 h3, t, 0x00f000f0, 0x64006400, 0xea;
"""


_WORD_DOT = tl.constexpr("""
{
.reg .b32 t, h0, h1, h2, h3, acc, lo_mul, hi_mul;
.reg .b16 lo, hi;
.reg .f32 flo, fhi, sum;
mov.b32 lo_mul, 0x24002400;
mov.b32 hi_mul, 0x14001400;
""" + _nibble_pairs("$1") + """fma.rn.f16x2 h0, h0, lo_mul, $6;
fma.rn.f16x2 h1, h1, hi_mul, $7;
fma.rn.f16x2 h2, h2, lo_mul, $6;
fma.rn.f16x2 h3, h3, hi_mul, $7;
mul.rn.f16x2 acc, h0, $2;
fma.rn.f16x2 acc, h1, $3, acc;
fma.rn.f16x2 acc, h2, $4, acc;
fma.rn.f16x2 acc, h3, $5, acc;
mov.b32 {lo, hi}, acc;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 sum, flo, fhi;
mov.b32 $0, sum;
}
""")

# One word's eight values (q - z) as fp16, nibble j in $j: $8 the word, $9 (1024 + z) twice,
# $10 -(64 + z) twice.
_WORD_VALUES = tl.constexpr("""
{
.reg .b32 t, h0, h1, h2, h3, sixteenth;
mov.b32 sixteenth, 0x2c002c00;
""" + _nibble_pairs("$8") + """sub.f16x2 h0, h0, $9;
fma.rn.f16x2 h1, h1, sixteenth, $10;
sub.f16x2 h2, h2, $9;
fma.rn.f16x2 h3, h3, sixteenth, $10;
mov.b32 {$0, $4}, h0;
mov.b32 {$1, $5}, h1;
mov.b32 {$2, $6}, h2;
mov.b32 {$3, $7}, h3;
}
""")

# Two float32 values into one fp16 pair ($1 the high half, $2 the low), saturating.
_PAIR = tl.constexpr("cvt.rn.satfinite.f16x2.f32 $0, $1, $2;")


@triton.jit
def _pair(high, low, EMULATE: tl.constexpr):
    """int32 bits of the fp16 pair (low, high), saturated to fp16's range."""
    if EMULATE:
        lo = tl.clamp(low, -65504.0, 65504.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = tl.clamp(high, -65504.0, 65504.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        return lo | (hi << 16)
    return tl.inline_asm_elementwise(_PAIR, "=r,r,r", [high, low], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _x_pair(first, second, ODD: tl.constexpr, X_BF16: tl.constexpr, EMULATE: tl.constexpr):
    """The fp16 pair (x_j, x_{j+4}) from the raw pairs holding x_j (``first``) and
    x_{j+4} (``second``): their low halves for even j, high halves for odd j."""
    return _pair(x_of(second, ODD, X_BF16), x_of(first, ODD, X_BF16), EMULATE)


@triton.jit
def group_zeros(ptrs, mask):
    """float32 zero points at ``ptrs``. A symmetric weight's kernels get an integer pointer
    instead of its zeros (:func:`.quant_gemm.zero_args`: the weight's own words,
    never read through it), and its zero point is 8 without a load. Triton compiles a
    kernel per pointer type, so the symmetric one needs no flag of its own."""
    if ptrs.dtype.element_ty.is_int():
        return tl.full(ptrs.shape, 8.0, tl.float32)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _f16(x):
    """float32 rounded to fp16 and back (emulation of an fp16 result)."""
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def _nibble_pair(word, j: tl.constexpr):
    """:func:`_nibble_pairs`' register h<j> in Triton operations (int32 bits of two fp16)."""
    src = word if j < 2 else (word >> 8) & 0xFFFFFF  # shr.u32: no sign bits shifted in
    mask = 0x000F000F if j % 2 == 0 else 0x00F000F0
    return (src & mask) | 0x64006400


@triton.jit
def _word_values_emulated(word, z_lo, z_hi):
    """:data:`_WORD_VALUES` in Triton operations, step by step: the eight (q - z) in fp16,
    nibble order (what the PTX leaves in $0..$7)."""
    h0, h1, h2, h3 = _nibble_pair(word, 0), _nibble_pair(word, 1), _nibble_pair(word, 2), _nibble_pair(word, 3)
    v0 = (half_of(h0, False) - half_of(z_lo, False)).to(tl.float16)  # sub.f16x2: exact
    v4 = (half_of(h0, True) - half_of(z_lo, True)).to(tl.float16)
    v1 = (half_of(h1, False) * 0.0625 + half_of(z_hi, False)).to(tl.float16)  # fma by 1/16: exact
    v5 = (half_of(h1, True) * 0.0625 + half_of(z_hi, True)).to(tl.float16)
    v2 = (half_of(h2, False) - half_of(z_lo, False)).to(tl.float16)
    v6 = (half_of(h2, True) - half_of(z_lo, True)).to(tl.float16)
    v3 = (half_of(h3, False) * 0.0625 + half_of(z_hi, False)).to(tl.float16)
    v7 = (half_of(h3, True) * 0.0625 + half_of(z_hi, True)).to(tl.float16)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _word_dot_emulated(word, xa, xb, xc, xd, z_lo, z_hi):
    """:data:`_WORD_DOT` in Triton operations: the same pairs and fp16 roundings."""
    pairs_x = (xa, xb, xc, xd)
    half_sums_lo = tl.zeros(word.shape, dtype=tl.float32)
    half_sums_hi = tl.zeros(word.shape, dtype=tl.float32)
    for j in tl.static_range(4):
        h = _nibble_pair(word, j)
        xs = pairs_x[j]
        for high in tl.static_range(2):
            v = half_of(h, high)
            if j % 2 == 0:
                q = _f16(v * (1.0 / 64.0) + half_of(z_lo, high))
            else:
                q = _f16(v * (1.0 / 1024.0) + half_of(z_hi, high))
            prod = q * half_of(xs, high)
            if high:
                half_sums_hi = _f16(half_sums_hi + prod) if j else _f16(prod)
            else:
                half_sums_lo = _f16(half_sums_lo + prod) if j else _f16(prod)
    return half_sums_lo + half_sums_hi


@triton.jit
def int4_fp16_tile(words, z, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    """fp16 [BLOCK_N, BLOCK_K]: the values (q - z) of int32 ``words`` [BLOCK_N, BLOCK_K // 8]
    (column ``8w + j`` in nibble ``j``) with float32 zero points ``z`` [BLOCK_N, 1]."""
    z_lo = _pair(1024.0 + z, 1024.0 + z, EMULATE)
    z_hi = _pair(-64.0 - z, -64.0 - z, EMULATE)
    if EMULATE:
        v0, v1, v2, v3, v4, v5, v6, v7 = _word_values_emulated(words, z_lo, z_hi)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _WORD_VALUES, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, z_lo, z_hi],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    # each join adds a last dimension, so the first join picks bit 2 of j and the last bit 0:
    # [BLOCK_N, words, 2, 2, 2] holds nibble j = 4a + 2b + c at [.., a, b, c], column 8w + j
    values = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(values, [BLOCK_N, BLOCK_K])


@triton.jit
def _step_x(x_pairs, k0, k_end, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """x's columns of the K step at ``k0`` as raw pairs: int32 [WORDS, 4], word ``w``'s
    columns 8w .. 8w + 7 in its row (one 16-byte load a word)."""
    # k0 is k_begin plus whole steps, and the caller's splits are whole steps: aligned
    offs_w = tl.multiple_of(k0 // 8 + tl.arange(0, WORDS), WORDS)
    w_ok = (offs_w < k_end // 8) | EVEN_K
    return tl.load(x_pairs + offs_w[:, None] * 4 + tl.arange(0, 4)[None, :], mask=w_ok[:, None], other=0)


@triton.jit
def _x_pairs(raw, WORDS: tl.constexpr, X_BF16: tl.constexpr, EMULATE: tl.constexpr):
    """x's columns 8w .. 8w + 7 (``raw``, four raw pairs a word) as the fp16 pairs
    (x_j, x_{j+4}), j = 0..3: four int32 [1, WORDS]."""
    # tl.split takes the last dimension: pair c = 2a + b at [a, b]
    r02, r13 = tl.split(tl.reshape(raw, [WORDS, 2, 2]))
    r0, r2 = tl.split(r02)
    r1, r3 = tl.split(r13)
    r0, r1, r2, r3 = r0[None, :], r1[None, :], r2[None, :], r3[None, :]
    return (_x_pair(r0, r2, False, X_BF16, EMULATE), _x_pair(r0, r2, True, X_BF16, EMULATE),
            _x_pair(r1, r3, False, X_BF16, EMULATE), _x_pair(r1, r3, True, X_BF16, EMULATE))


@triton.jit
def _step_group(s_rows, z_rows, k0, group_k, stride_sk, stride_zk, EMULATE: tl.constexpr):
    """The scale and zero point (float32, [BLOCK_N, 1] in the weight tile's layout) of the
    K step at ``k0``, ``s_rows``/``z_rows`` pointing at each row's first group (rows past N
    at row 0's: no masks)."""
    g = k0 // group_k
    s = row_values(s_rows + g * stride_sk, not EMULATE)
    if z_rows.dtype.element_ty.is_int():  # symmetric (see group_zeros)
        return s, tl.full(s.shape, 8.0, tl.float32)
    return s, row_values(z_rows + g * stride_zk, not EMULATE)


@triton.jit
def int4_gemv_row(x_row, w_ptr, s_ptr, z_ptr, offs_n, n_ok, k_begin, k_end, stride_wn, stride_wk,
                  stride_sn, stride_sk, stride_zn, stride_zk, group_k,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_BF16: tl.constexpr, EVEN_K: tl.constexpr,
                  EMULATE: tl.constexpr, AHEAD: tl.constexpr = False, UNROLL: tl.constexpr = 1,
                  VEC: tl.constexpr = 4, STAGED: tl.constexpr = 0):
    """float32 [1, BLOCK_N]: the row of x at ``x_row`` times ``W[offs_n, k_begin:k_end]^T``
    for int4 words holding column ``8w + j`` in nibble ``j``, one scale and zero point per
    row and ``group_k`` columns (``BLOCK_K`` divides ``group_k``). ``EVEN_K``: every step
    is whole (K a multiple of ``BLOCK_K``), so only rows are masked.

    At one row this step waits on memory more than it computes (session 24's Nsight
    counters: issue slots 43-60% busy, half the cycles between issues waiting on loads),
    so no load is left where the whole program must wait for it:

    * the weight words are loaded two steps ahead (see .gemv_words);
    * each row's scale and zero point are read in the weight tile's own layout
      (:func:`.gemv_words.row_values`): no barrier in the loop, where a layout change
      through shared memory made all the program's warps wait for the slowest twice a step;
    * with ``AHEAD`` the group's scale and zero point are loaded one step ahead, and x's
      columns too, already made into fp16 pairs (carrying the raw tile instead sent it
      through shared memory, with barriers). A table entry's ``ahead`` turns it on where
      it measured faster (``scripts/gpu_int4_ahead_ab.py``).

    With ``STAGED`` the words travel through shared memory instead, ``STAGED - 1`` steps
    ahead (:mod:`.fp8_gemv` says how); ``AHEAD`` and ``UNROLL`` are then unused.

    Each gives the same sums bit for bit (tests/test_packed_gemv.py)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    x_pairs = x_row.to(tl.pointer_type(tl.int32), bitcast=True)  # columns (2i, 2i + 1) in word i
    safe_n = tl.where(n_ok, offs_n, 0)[:, None]  # rows past N read row 0, never stored: no masks
    w_rows = w_ptr + safe_n.to(tl.int64) * stride_wn
    s_rows = s_ptr + safe_n * stride_sn
    z_rows = z_ptr + safe_n * stride_zn
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    if STAGED > 0:
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGED):
            words = step_words(w_rows, None, k0, k_end, stride_wk, 8, WORDS, EVEN_K, VEC)
            s, z = _step_group(s_rows, z_rows, k0, group_k, stride_sk, stride_zk, EMULATE)
            x0, x1, x2, x3 = _x_pairs(_step_x(x_pairs, k0, k_end, WORDS, EVEN_K), WORDS, X_BF16, EMULATE)
            acc += _scaled_words(words, s, z, x0, x1, x2, x3, EMULATE)
        return tl.sum(acc, 1)[None, :] * _WEIGHT_DIVISOR
    following = step_words(w_rows, None, k_begin, k_end, stride_wk, 8, WORDS, EVEN_K, VEC)
    after = step_words(w_rows, None, k_begin + BLOCK_K, k_end, stride_wk, 8, WORDS, EVEN_K, VEC)
    if AHEAD:
        next_s, next_z = _step_group(s_rows, z_rows, k_begin, group_k, stride_sk, stride_zk, EMULATE)
        n0, n1, n2, n3 = _x_pairs(_step_x(x_pairs, k_begin, k_end, WORDS, EVEN_K), WORDS, X_BF16, EMULATE)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, loop_unroll_factor=UNROLL):
        words = following
        following = after
        after = step_words(w_rows, None, k0 + 2 * BLOCK_K, k_end, stride_wk, 8, WORDS, EVEN_K, VEC)
        if AHEAD:
            s, z, x0, x1, x2, x3 = next_s, next_z, n0, n1, n2, n3
            # the next step's; after the last, the last group and (whole steps) the last
            # columns again: no masks
            next_s, next_z = _step_group(s_rows, z_rows, tl.minimum(k0 + BLOCK_K, k_end - 1), group_k, stride_sk,
                                         stride_zk, EMULATE)
            k_next = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K) if EVEN_K else k0 + BLOCK_K
            n0, n1, n2, n3 = _x_pairs(_step_x(x_pairs, k_next, k_end, WORDS, EVEN_K), WORDS, X_BF16, EMULATE)
        else:
            s, z = _step_group(s_rows, z_rows, k0, group_k, stride_sk, stride_zk, EMULATE)
            x0, x1, x2, x3 = _x_pairs(_step_x(x_pairs, k0, k_end, WORDS, EVEN_K), WORDS, X_BF16, EMULATE)
        acc += _scaled_words(words, s, z, x0, x1, x2, x3, EMULATE)
    # the weights' 1/64 made up once, not per row and step: a power of two, so the same sums
    return tl.sum(acc, 1)[None, :] * _WEIGHT_DIVISOR


@triton.jit
def _scaled_words(words, s, z, x0, x1, x2, x3, EMULATE: tl.constexpr):
    """float32 [BLOCK_N, WORDS]: each word's eight products with x, less its zero point,
    times its group's scale (in 1/64ths: :data:`_WEIGHT_DIVISOR`)."""
    z_lo = _pair(-(1024.0 + z) / _WEIGHT_DIVISOR, -(1024.0 + z) / _WEIGHT_DIVISOR, EMULATE)
    z_hi = _pair(-(64.0 + z) / _WEIGHT_DIVISOR, -(64.0 + z) / _WEIGHT_DIVISOR, EMULATE)
    if EMULATE:
        part = _word_dot_emulated(words, x0, x1, x2, x3, z_lo, z_hi)
    else:
        part = tl.inline_asm_elementwise(_WORD_DOT, "=r,r,r,r,r,r,r,r", [words, x0, x1, x2, x3, z_lo, z_hi],
                                         dtype=tl.int32, is_pure=True, pack=1)
        part = part.to(tl.float32, bitcast=True)
    return part * s
