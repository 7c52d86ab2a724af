"""The inner loops of the quantized-weight GEMMs, shared by :mod:`.quant_gemm` and :mod:`.quant_moe`.

:func:`quant_tile` is one program's ``[BLOCK_M, BLOCK_N]`` float32 accumulator of
``x @ W[offs_n, k_begin:k_end]^T`` for a weight in one of the layouts of
:mod:`ninfer_kernels.quant_formats`, its K loop walking ``BLOCK_K`` columns a step:

* ``FP8`` (weight only): the e4m3 tile converts exactly to x's dtype, ``tl.dot`` with x,
  and the block scale (one per column within a step, since ``BLOCK_K`` divides the
  block's ``bk``) multiplies the step's partial product, not every weight.
* ``FP8_ACT`` (tensor-core FP8): x was quantized per token per 128 columns
  (:func:`quantize_activations`); e4m3 x e4m3 ``tl.dot``, then both scales per step.
* ``FP8_ACT_INLINE``: the same products, x quantized inside the step (each step is one
  128-column group) instead of by a kernel before. For decode rows: no extra launch, and
  no e4m3 -> bf16 conversion of the weight, which bounds the weight-only path there.
* ``INT4``: a step's int32 words hold 8 columns each, column ``8w + j`` in nibble ``j``.
  The tile is loaded with each word at the 8 rows of its columns and each row shifts out
  its own nibble, so one ``tl.dot`` takes the whole step against contiguous x. The nibble
  becomes ``OFFSET + q`` in x's dtype by OR-ing it into the mantissa of
  ``OFFSET`` (128 for bf16, 1024 for fp16): two integer ops, no int->float convert; the
  ``OFFSET + zero`` is taken off once per step as ``rowsum(x) * (OFFSET + zero)``, then
  the group's scale. With groups narrower than a step (G < 128) each weight is
  dequantized in full instead (``SCALE_PER_ELEMENT``).
* ``NVFP4``: a byte's low nibble is column ``2i``, its high one ``2i + 1``: two dots, on
  x's even and odd columns (split from one contiguous load). The e2m1 code becomes its
  exact value by moving bits (:func:`.rounding.e2m1_half`) and each element takes its
  16-group's e4m3 scale, loaded once per group and spread in registers; ``alpha`` is the
  caller's.

In Triton's interpreter (CPU tensors) ``UPCAST`` multiplies in float32: it would take
bf16 dot operands as raw bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton.gemv_words import row_values, step_words
from ninfer_kernels.triton.int4_fp16 import group_zeros, int4_fp16_tile
from ninfer_kernels.triton.rounding import e2m1_half, round_e4m3

#: kernel format ids (constexpr)
FP8, FP8_ACT, INT4, NVFP4, FP8_ACT_INLINE = 0, 1, 2, 3, 4
#: columns of x sharing one activation scale on the FP8 tensor-core path
ACT_GROUP = 128
_ACT_GROUP = tl.constexpr(ACT_GROUP)  # what a kernel may read
#: int4 nibble -> x's dtype by OR-ing into this number's mantissa: (bits, value)
INT4_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}
#: FP8 weight-only and NVFP4 tiles multiply in fp16 when x is bf16 on CUDA (quant_tile's ``HALF``)
HALF_PRODUCTS = True


def half_products(x: torch.Tensor) -> bool:
    """Whether FP8 weight-only and NVFP4 tiles over ``x`` (or a tensor of x's dtype and
    device) take :func:`quant_tile`'s ``HALF``."""
    return HALF_PRODUCTS and x.dtype == torch.bfloat16 and x.device.type == "cuda"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _load_x(a_rows, row_ok, cols, col_ok, stride_ak):
    return tl.load(a_rows[:, None] + cols[None, :] * stride_ak, mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _block_scales(s_ptr, offs_n, n_ok, k0, stride_sn, stride_sk, group_n, group_k, ASM: tl.constexpr):
    """float32 [BLOCK_N]: the block scale of each of rows ``offs_n`` at the K step ``k0``, in
    the layout the product needs (:func:`.gemv_words.row_values`; rows past N read row 0's)."""
    # one block of rows (tiles start at multiples of their size): one number
    if tl.constexpr(group_n) % offs_n.shape[0] == 0:
        s = tl.load(s_ptr + (tl.min(offs_n, 0) // group_n) * stride_sn + (k0 // group_k) * stride_sk)
        return tl.full(offs_n.shape, 0.0, tl.float32) + s
    rows = tl.where(n_ok, offs_n, 0)
    return row_values(s_ptr + (rows // group_n) * stride_sn + (k0 // group_k) * stride_sk, ASM)


@triton.jit
def _fp8_step(a_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
              stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k,
              BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, HALF: tl.constexpr = False):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < k_end
    a = _load_x(a_rows, row_ok, offs_k, k_ok, stride_ak)
    w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk,
                mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    s = _block_scales(s_ptr, offs_n, n_ok, k0, stride_sn, stride_sk, group_n, group_k, not UPCAST)
    if HALF:  # see quant_tile
        a = _saturate_f16(a.to(tl.float32), not UPCAST)
    return _dot(a, w.to(a.dtype), UPCAST) * s[None, :]


@triton.jit
def _fp8_step_swapped(a_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
                      stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k,
                      BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, HALF: tl.constexpr):
    """:func:`_fp8_step` transposed, ``[BLOCK_N, BLOCK_M]``: the converted weight tile is
    the first operand (see :func:`quant_tile`'s ``SWAP``)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < k_end
    a = _load_x(a_rows, row_ok, offs_k, k_ok, stride_ak)
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk,
                mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    s = _block_scales(s_ptr, offs_n, n_ok, k0, stride_sn, stride_sk, group_n, group_k, not UPCAST)
    if HALF:
        a = _saturate_f16(a.to(tl.float32), not UPCAST)
    return _dot(w.to(a.dtype), tl.trans(a), UPCAST) * s[:, None]


@triton.jit
def _saturate_f16(x, ASM: tl.constexpr):
    """float32 ``x`` to fp16, rounded to nearest, beyond the largest finite fp16 value
    (65504) that value instead of inf. ``ASM``: two values per saturating conversion
    instruction; else the clamp written out (Triton's interpreter runs no PTX)."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rn.satfinite.f16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                         dtype=tl.float16, is_pure=True, pack=2)
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _quantize_group(x, ROUND: tl.constexpr):
    """float32 rows ``x`` [M, ACT_GROUP] of one group -> (e4m3 codes, float32 scales [M]),
    as :func:`_act_quant_kernel` computes them."""
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 448.0
    q = x / scale[:, None]
    if ROUND:  # the interpreter's fp32 -> fp8 cast rounds wrongly: round by hand
        q = round_e4m3(q)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _fp8_act_step(a_rows, as_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
                  stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k,
                  BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, FORMAT: tl.constexpr, QROUND: tl.constexpr,
                  SWAP: tl.constexpr = False):
    """FP8_ACT (x quantized before, its scales at ``as_rows``) or FP8_ACT_INLINE (x
    quantized here: BLOCK_K == ACT_GROUP, so the step is one group). ``SWAP``: the
    transposed product, ``[BLOCK_N, BLOCK_M]`` (see :func:`quant_tile`)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < k_end
    if FORMAT == 4:
        a, a_s = _quantize_group(_load_x(a_rows, row_ok, offs_k, k_ok, stride_ak).to(tl.float32), QROUND)
    else:
        a = _load_x(a_rows, row_ok, offs_k, k_ok, stride_ak)
        a_s = tl.load(as_rows + k0 // _ACT_GROUP, mask=row_ok, other=0.0)
    s = _block_scales(s_ptr, offs_n, n_ok, k0, stride_sn, stride_sk, group_n, group_k, not UPCAST)
    if SWAP:  # the weight tile as stored (K contiguous), the first operand
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk,
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        part = _dot(w, tl.trans(a), UPCAST) * s[:, None] * a_s[None, :]
    else:
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        part = _dot(a, w, UPCAST) * a_s[:, None] * s[None, :]
    return part


@triton.jit
def _int4_step(a_rows, row_ok, stride_ak, w_ptr, s_ptr, z_ptr, offs_n, n_ok, k0, k_end,
               stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_k,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               MAGIC: tl.constexpr, OFFSET: tl.constexpr, SCALE_PER_ELEMENT: tl.constexpr, UPCAST: tl.constexpr,
               PAIRS: tl.constexpr = False):
    if PAIRS:  # the words in fp16 pairs (.int4_fp16), x in fp16: one dot, the scale after
        words = step_words(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn, n_ok, k0, k_end, stride_wk, 8,
                           BLOCK_K // 8, False)
        g = k0 // group_k
        s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sk, mask=n_ok, other=0.0).to(tl.float32)
        z = group_zeros(z_ptr + offs_n * stride_zn + g * stride_zk, n_ok)
        w = int4_fp16_tile(words, z[:, None], BLOCK_N, BLOCK_K, UPCAST)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _saturate_f16(_load_x(a_rows, row_ok, offs_k, offs_k < k_end, stride_ak).to(tl.float32), not UPCAST)
        return _dot(a, tl.trans(w), UPCAST) * s[None, :]
    if SCALE_PER_ELEMENT:  # groups narrower than the step: dequantize each weight
        WORDS: tl.constexpr = BLOCK_K // 8
        offs_w = k0 // 8 + tl.arange(0, WORDS)
        w_ok = offs_w < k_end // 8
        words = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_w[:, None] * stride_wk,
                        mask=w_ok[:, None] & n_ok[None, :], other=0)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(8):
            cols = offs_w * 8 + j
            a = _load_x(a_rows, row_ok, cols, w_ok, stride_ak)
            g = (cols // group_k)[:, None]
            # columns past K have no group: reading one would fetch whatever lies beyond
            # (NaN reaches every output through 0 * NaN)
            sz_ok = w_ok[:, None] & n_ok[None, :]
            s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g * stride_sk, mask=sz_ok, other=0.0)
            z = group_zeros(z_ptr + offs_n[None, :] * stride_zn + g * stride_zk, sz_ok)
            q = ((words >> (4 * j)) & 0xF).to(tl.float32)
            part += _dot(a, ((q - z) * s.to(tl.float32)).to(a.dtype), UPCAST)
        return part
    # One dot over the whole step: each word is loaded once per nibble (the 8 loads of one
    # address come from L1), so the tile's rows are the step's columns in order and x is
    # read contiguously. Eight 16-deep dots over strided x columns did before; with them
    # the best int4 shapes streamed 16-24% of copy bandwidth at one to four rows (session 12).
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < k_end
    spread = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (offs_k // 8)[:, None] * stride_wk,
                     mask=k_ok[:, None] & n_ok[None, :], other=0)
    a = _load_x(a_rows, row_ok, offs_k, k_ok, stride_ak)
    q = (((spread >> ((offs_k % 8) * 4)[:, None]) & 0xF) | MAGIC).to(tl.int16).to(a.dtype, bitcast=True)
    part = _dot(a, q, UPCAST)  # sum of x * (OFFSET + q), exact products
    row_sum = tl.sum(a.to(tl.float32), 1)
    g = k0 // group_k
    s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sk, mask=n_ok, other=0.0).to(tl.float32)
    z = group_zeros(z_ptr + offs_n * stride_zn + g * stride_zk, n_ok)
    return (part - row_sum[:, None] * (OFFSET + z)[None, :]) * s[None, :]


@triton.jit
def _nvfp4_step(a_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
                stride_wn, stride_wk, stride_sn, stride_sk,
                BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, HALF: tl.constexpr = False):
    BYTES: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 16
    offs_b = k0 // 2 + tl.arange(0, BYTES)
    b_ok = offs_b < k_end // 2
    packed = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_b[:, None] * stride_wk,
                     mask=b_ok[:, None] & n_ok[None, :], other=0).to(tl.int32)
    # the step's 16-group scales loaded compact, [groups, N], and spread over their 8 bytes
    # in registers (a scale gathered per byte was a one-byte load the pipeline cannot copy)
    offs_g = k0 // 16 + tl.arange(0, GROUPS)
    g_ok = offs_g < tl.cdiv(k_end, 16)
    sc = tl.load(s_ptr + offs_n[None, :] * stride_sn + offs_g[:, None] * stride_sk,
                 mask=g_ok[:, None] & n_ok[None, :], other=0.0)
    s = tl.reshape(tl.broadcast_to(sc[:, None, :], [GROUPS, 8, sc.shape[1]]), [BYTES, sc.shape[1]])
    # x's even and odd columns from one contiguous load of the step's columns
    cols = offs_b[:, None] * 2 + tl.arange(0, 2)[None, :]
    pairs = tl.load(a_rows[:, None, None] + cols[None, :, :] * stride_ak,
                    mask=row_ok[:, None, None] & b_ok[None, :, None], other=0.0)
    a_even, a_odd = tl.split(pairs)
    if HALF:  # see quant_tile; e2m1 x e4m3 has 6 significant bits, exact in fp16
        s16 = s.to(tl.float16)
        lo = e2m1_half(packed & 0xF) * s16
        hi = e2m1_half(packed >> 4) * s16
        a_even = _saturate_f16(a_even.to(tl.float32), not UPCAST)
        a_odd = _saturate_f16(a_odd.to(tl.float32), not UPCAST)
    else:
        s = s.to(tl.float32)
        lo = (e2m1_half(packed & 0xF) * s).to(a_even.dtype)  # exact in bf16 too
        hi = (e2m1_half(packed >> 4) * s).to(a_even.dtype)
    return _dot(a_even, lo, UPCAST) + _dot(a_odd, hi, UPCAST)


@triton.jit
def quant_tile(a_rows, as_rows, row_ok, stride_ak, w_ptr, s_ptr, z_ptr, offs_n, n_ok, k_begin, k_end,
               stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_n, group_k,
               FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               MAGIC: tl.constexpr, OFFSET: tl.constexpr, SCALE_PER_ELEMENT: tl.constexpr, UPCAST: tl.constexpr,
               QROUND: tl.constexpr = False, SWAP: tl.constexpr = False, HALF: tl.constexpr = False,
               PAIRS: tl.constexpr = False):
    """float32 [BLOCK_M, BLOCK_N]: rows ``a_rows`` of x (pointers to column 0; ``as_rows``
    to their activation scales for FP8_ACT) times weight rows ``offs_n`` over columns
    ``k_begin`` (a multiple of BLOCK_K) to ``k_end``. ``w_ptr``/``s_ptr``/``z_ptr`` are
    one matrix's data, scales and zeros; strides in their own elements. ``QROUND``: round
    to e4m3 by hand (the interpreter's cast does not; FP8_ACT_INLINE).

    ``SWAP`` (FP8): compute ``W x^T`` and transpose once at the end. Hopper's warpgroup
    MMA wants 64 rows on the first operand; with a few x rows first, a decode product runs
    on the older 16-row MMA instead. Swapped, the weight tile is that first operand and the
    x rows fill the narrow side. On the tensor-core path it is fed from shared memory as
    loaded (both e4m3 operands K-major, as the FP8 MMA requires); weight-only, the
    converted tile is a register operand (sm_90 code: ``HGMMA.64x16x16`` with a register
    operand, where unswapped the tile feeds the 16-row ``HMMA``).

    ``HALF`` (FP8 weight-only or NVFP4, bf16 x): multiply in fp16, where the weight tile
    is cheaper to make than in bf16. Hopper converts e4m3 to fp16 in one instruction per
    pair but to bf16 only through fp16 (a second conversion per element), and an e2m1 code
    times its e4m3 scale is exact in fp16 without a float32 step. At 16-row tiles Triton
    runs an e4m3 x e4m3 product as fp16 products too, so quantizing x would buy nothing
    there but its rounding error. bf16 x converts to fp16 exactly (8 bits of mantissa into
    11) down to 2**-14, below which it loses bits as a subnormal, and saturates at 65504.

    ``PAIRS`` (int4 with groups of whole steps): the weight tile is made in fp16 pairs by
    :func:`.int4_fp16.int4_fp16_tile` and x converted to fp16 as for ``HALF``."""
    if SWAP:
        return _quant_tile_swapped(a_rows, as_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k_begin, k_end,
                                   stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k, FORMAT, BLOCK_M,
                                   BLOCK_N, BLOCK_K, UPCAST, QROUND, HALF)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if FORMAT == 0:
            acc += _fp8_step(a_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
                             stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k, BLOCK_K, UPCAST, HALF)
        elif FORMAT == 1 or FORMAT == 4:
            acc += _fp8_act_step(a_rows, as_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
                                 stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k, BLOCK_K, UPCAST,
                                 FORMAT, QROUND)
        elif FORMAT == 2:
            acc += _int4_step(a_rows, row_ok, stride_ak, w_ptr, s_ptr, z_ptr, offs_n, n_ok, k0, k_end,
                              stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_k,
                              BLOCK_M, BLOCK_N, BLOCK_K, MAGIC, OFFSET, SCALE_PER_ELEMENT, UPCAST, PAIRS)
        else:
            acc += _nvfp4_step(a_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
                               stride_wn, stride_wk, stride_sn, stride_sk, BLOCK_K, UPCAST, HALF)
    return acc


@triton.jit
def _quant_tile_swapped(a_rows, as_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k_begin, k_end,
                        stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k, FORMAT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                        QROUND: tl.constexpr, HALF: tl.constexpr):
    """:func:`quant_tile`'s ``SWAP``: accumulate ``[BLOCK_N, BLOCK_M]``, transpose once."""
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if FORMAT == 0:
            acc_t += _fp8_step_swapped(a_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
                                       stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k, BLOCK_K, UPCAST,
                                       HALF)
        else:
            acc_t += _fp8_act_step(a_rows, as_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
                                   stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k, BLOCK_K, UPCAST,
                                   FORMAT, QROUND, True)
    return tl.trans(acc_t)


# -- few-row products without tl.dot ------------------------------------------------------------
@triton.jit
def _fp8_gemv_step(a_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
                   stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k, BLOCK_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < k_end
    a = _load_x(a_rows, row_ok, offs_k, k_ok, stride_ak).to(tl.float32)  # [ROWS, BLOCK_K]
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk,
                mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K], K contiguous
    s = _block_scales(s_ptr, offs_n, n_ok, k0, stride_sn, stride_sk, group_n, group_k, False)
    return (w.to(tl.float32) * s[:, None])[None, :, :] * a[:, None, :]


@triton.jit
def _int4_gemv_step(a_rows, row_ok, stride_ak, w_ptr, s_ptr, z_ptr, offs_n, n_ok, k0, k_end,
                    stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_k,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_w = k0 // 8 + tl.arange(0, WORDS)
    w_ok = offs_w < k_end // 8
    words = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_w[None, :] * stride_wk,
                    mask=n_ok[:, None] & w_ok[None, :], other=0)  # [BLOCK_N, WORDS], words contiguous
    dots = tl.zeros([BLOCK_M, BLOCK_N, WORDS], dtype=tl.float32)
    sums = tl.zeros([BLOCK_M, WORDS], dtype=tl.float32)
    for j in tl.static_range(8):
        a = _load_x(a_rows, row_ok, offs_w * 8 + j, w_ok, stride_ak).to(tl.float32)
        # the nibble as float32 without an int->float convert (a quarter-rate instruction on
        # Hopper): OR-ed into the mantissa of 2**23, it is 2**23 + q exactly; take 2**23 off
        q = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        dots += q[None, :, :] * a[:, None, :]
        sums += a
    g = k0 // group_k
    s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sk, mask=n_ok, other=0.0).to(tl.float32)
    z = group_zeros(z_ptr + offs_n * stride_zn + g * stride_zk, n_ok)
    return (dots - z[None, :, None] * sums[:, None, :]) * s[None, :, None]


@triton.jit
def quant_gemv_tile(a_rows, row_ok, stride_ak, w_ptr, s_ptr, z_ptr, offs_n, n_ok, k_begin, k_end,
                    stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_n, group_k,
                    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`quant_tile` for FP8 (weight-only) and int4 at a few rows (BLOCK_M may be 1):
    float32 products summed elementwise across the K loop and reduced once at the end.
    No ``tl.dot``, so no 16-row padding and no operand layout shuffles; the weight tile
    stays in the layout it was loaded in (K contiguous per thread)."""
    if FORMAT == 0:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            acc += _fp8_gemv_step(a_rows, row_ok, stride_ak, w_ptr, s_ptr, offs_n, n_ok, k0, k_end,
                                  stride_wn, stride_wk, stride_sn, stride_sk, group_n, group_k, BLOCK_K)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            acc += _int4_gemv_step(a_rows, row_ok, stride_ak, w_ptr, s_ptr, z_ptr, offs_n, n_ok, k0, k_end,
                                   stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_k,
                                   BLOCK_M, BLOCK_N, BLOCK_K)
    return tl.sum(acc, 2)


# -- activations, per token per 128 columns, for the FP8 tensor-core path ------------------------
@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                      GROUP: tl.constexpr, GROUPS: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    q, scale = _quantize_group(x, ROUND)
    tl.store(q_ptr + row * stride_qm + cols, q, mask=ok)
    tl.store(s_ptr + row * stride_sm + g, scale, mask=g * GROUP < K)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (unit column stride) -> (e4m3 [M, K], float32 scales [M, ceil(K/128)]),
    scale = amax / 448 of each token's 128-column group (floored at 1e-12 / 448)."""
    rows, k = x.shape
    groups = triton.cdiv(k, ACT_GROUP)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        per_program = min(8, triton.next_power_of_2(groups))
        _act_quant_kernel[(rows, triton.cdiv(groups, per_program))](
            x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
            GROUP=ACT_GROUP, GROUPS=per_program, ROUND=x.device.type != "cuda")
    return q, s


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`quantize_activations` computes, in torch (for tests)."""
    rows, k = x.shape
    groups = triton.cdiv(k, ACT_GROUP)
    padded = torch.nn.functional.pad(x.float(), (0, groups * ACT_GROUP - k)).view(rows, groups, ACT_GROUP)
    s = padded.abs().amax(-1).clamp_min(1e-12) / 448.0
    q = (padded / s[..., None]).to(torch.float8_e4m3fn).view(rows, -1)[:, :k]
    return q, s
