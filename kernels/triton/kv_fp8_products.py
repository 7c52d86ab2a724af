"""Attention over an fp8 KV cache with the products in e4m3 on the tensor cores.

:mod:`.kv_quant`'s kernel converts every stored code to fp16 before its products. At a
batch of long contexts that conversion, and the 16-row MMA of which a decode step fills 6
rows (one per query head of a KV head), cost more than reading the bytes: the kernel
reached 76% of the H200's copy rate where the bf16 kernel reaches all of it. Here the
codes go from shared memory straight into Hopper's fp8 warpgroup MMA, unconverted:

- each program's queries are quantized to e4m3 once, with one scale per row (its largest
  magnitude maps to 448), and that scale multiplies the scores. The rounding residual is
  quantized too (times 16) and multiplied as a second query: one e4m3 query alone
  doubled the error the fp8 cache itself makes (against unquantized attention, in the
  interpreter test), with the residual the queries' error is under 0.1%;
- products are transposed, keys along the MMA's 64-row side and query rows along its
  narrow side: scores are ``K @ Q^T`` ([keys, rows]) and the output ``V^T @ P^T``
  ([dims, rows]). Both operands are then contiguous along the summed axis as stored:
  keys keep their dims together, and values are paged by dim (``allocate_parts``), which
  fp8 MMAs require of both operands;
- the probabilities, times each key's value scale, are quantized to e4m3 per tile and
  row with their largest at 448; the factor comes back out of the tile's product.

The probabilities lose precision to e4m3's 3-bit mantissa (vLLM's FlashAttention-3 path
for an fp8 cache does the same, and quantizes queries with one static scale, no
residual); docs/kv-formats.md has the measured accuracy. The launch, split merge and tile shapes are
:func:`.kv_quant.paged_attention_quant`'s; it picks this kernel (:func:`applies`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton.rounding import round_e4m3
from ninfer_kernels.triton.paged_attention import _block_rows, _load_queries, _store_rows

#: on: fp8 caches on Hopper or newer multiply in e4m3 (see the module docstring)
FP8_PRODUCTS = True
#: multiply the queries' e4m3 rounding residual too (a second score product; see above)
QUERY_RESIDUAL = True
#: the same for the probabilities (a second value product)
PROB_RESIDUAL = False
#: keys along the MMA's 64-row side (else query rows, padded to 64)
TRANSPOSED = True
#: at most this many query tokens a sequence: decode and speculative verify rows. Prefill
#: chunks keep :mod:`.kv_quant`'s fp16 products (their rows fill the MMA already).
MAX_TOKENS = 8


def applies(q: torch.Tensor, k_name: str, v_name: str, max_query_len: int) -> bool:
    """Whether this kernel serves a launch: fp8 keys and values, 16-bit queries on a GPU
    with fp8 MMAs (compute capability 9.0 or later), few query tokens a sequence."""
    return (FP8_PRODUCTS and k_name == v_name == "fp8" and max_query_len <= MAX_TOKENS
            and q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cuda"
            and torch.cuda.get_device_capability(q.device) >= (9, 0))


def tiles(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M, TOKENS): every query token of a sequence in one program, rounded up to a
    power of two so few variants compile (decode: 1, verify: 2, 4 or 8)."""
    tokens = triton.next_power_of_2(max_query_len)
    return max(16 if TRANSPOSED else 64, triton.next_power_of_2(group * tokens)), tokens


@triton.jit
def _to_e4m3(x, EXACT: tl.constexpr):
    """float32 ``x`` (at most 448 in magnitude) as float8 e4m3, rounded to nearest. ``EXACT``
    rounds first in float32: Triton's interpreter mis-rounds values that carry into the
    next power of two; the GPU's conversion does not."""
    if EXACT:
        x = round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _load_codes(start, hi, table, kd, ks, vd, vs, strides, offs_d, d_ok,
                PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """A tile's stored codes, keys [BLOCK_N, BLOCK_D] and values [BLOCK_D, BLOCK_N], and
    the keys' key and value scales [BLOCK_N] (0 past ``hi``)."""
    s_kdb, s_kds, s_kdd, s_ksb, s_kss, s_vdb, s_vds, s_vdd, s_vsb, s_vss = strides
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    if MASKED:
        page = tl.load(table + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        k_ok = n_ok[:, None] & d_ok[None, :]
        v_ok = d_ok[:, None] & n_ok[None, :]
    else:
        page = tl.load(table + offs_n // PAGE).to(tl.int64)
        k_ok = (offs_n >= 0)[:, None] & d_ok[None, :]
        v_ok = d_ok[:, None] & (offs_n >= 0)[None, :]
    slot = offs_n % PAGE
    k = tl.load(kd + (page * s_kdb + slot * s_kds)[:, None] + offs_d[None, :] * s_kdd, mask=k_ok, other=0.0)
    v = tl.load(vd + (page * s_vdb + slot * s_vds)[None, :] + offs_d[:, None] * s_vdd, mask=v_ok, other=0.0)
    k_scale = tl.load(ks + page * s_ksb + slot * s_kss, mask=n_ok, other=0.0)
    v_scale = tl.load(vs + page * s_vsb + slot * s_vss, mask=n_ok, other=0.0)
    return k, v, k_scale, v_scale


@triton.jit
def _fold_codes(acc, m_i, l_i, q8, q8_low, row_scale, k, v, k_scale, v_scale, start, hi, pos,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EXACT: tl.constexpr, RESIDUAL: tl.constexpr,
                P_RESIDUAL: tl.constexpr):
    """:func:`.paged_attention._fold_kv_tile`, transposed (scores [keys, rows], ``acc``
    [dims, rows]) and in e4m3: ``q8`` [BLOCK_D, BLOCK_M] are the quantized queries,
    ``q8_low`` their residual times 16 (with ``RESIDUAL``), and ``row_scale`` their scales
    times the softmax scale (log2 units)."""
    s = tl.dot(k, q8)
    if RESIDUAL:
        s += tl.dot(k, q8_low) * (1.0 / 16.0)
    s = s * k_scale[:, None] * row_scale[None, :]
    if MASKED:
        offs_n = start + tl.arange(0, BLOCK_N)
        s = tl.where((offs_n[:, None] < hi) & (offs_n[:, None] <= pos[None, :]), s, float("-inf"))
    tile_max = tl.max(s, 0)
    m_new = tl.maximum(m_i, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    # A bound on each row's largest probability times value scale, mapped to e4m3's top (448):
    # the row's largest probability in this tile times the tile's largest value scale.
    top = tl.exp2(tile_max - m_safe) * tl.max(v_scale, 0)
    top = tl.where(top > 0, top, 1.0)
    w = tl.minimum(p * v_scale[:, None] * (448.0 / top)[None, :], 448.0)
    p8 = _to_e4m3(w, EXACT)
    pv = tl.dot(v, p8)
    if P_RESIDUAL:
        pv += tl.dot(v, _to_e4m3((w - p8.to(tl.float32)) * 16.0, EXACT)) * (1.0 / 16.0)
    acc = acc * alpha[None, :] + pv * (top * (1.0 / 448.0))[None, :]
    return acc, m_new, l_i


@triton.jit
def _fold_codes_rows(acc, m_i, l_i, q8, q8_low, row_scale, k, v, k_scale, v_scale, start, hi, pos,
                     BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EXACT: tl.constexpr, RESIDUAL: tl.constexpr,
                     P_RESIDUAL: tl.constexpr):
    """:func:`_fold_codes` with query rows along the MMA's 64-row side (scores [rows, keys],
    ``acc`` [rows, dims], ``q8`` [BLOCK_M, BLOCK_D]): padding rows, but the softmax's sums
    run along a warp's own columns."""
    kt = tl.trans(k)
    s = tl.dot(q8, kt)
    if RESIDUAL:
        s += tl.dot(q8_low, kt) * (1.0 / 16.0)
    s = s * row_scale[:, None] * k_scale[None, :]
    if MASKED:
        offs_n = start + tl.arange(0, BLOCK_N)
        s = tl.where((offs_n[None, :] < hi) & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
    tile_max = tl.max(s, 1)
    m_new = tl.maximum(m_i, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    top = tl.exp2(tile_max - m_safe) * tl.max(v_scale, 0)
    top = tl.where(top > 0, top, 1.0)
    w = tl.minimum(p * v_scale[None, :] * (448.0 / top)[:, None], 448.0)
    p8 = _to_e4m3(w, EXACT)
    vt = tl.trans(v)
    pv = tl.dot(p8, vt)
    if P_RESIDUAL:
        pv += tl.dot(_to_e4m3((w - p8.to(tl.float32)) * 16.0, EXACT), vt) * (1.0 / 16.0)
    acc = acc * alpha[:, None] + pv * (top * (1.0 / 448.0))[:, None]
    return acc, m_new, l_i


@triton.jit
def _attend_fp8_kernel(
    q_ptr, kd, ks, vd, vs, out_ptr, part_o_ptr, part_lse_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, s_kdb, s_kds, s_kdh, s_kdd, s_ksb, s_kss, s_ksh,
    s_vdb, s_vds, s_vdh, s_vdd, s_vsb, s_vss, s_vsh,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_bt,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, PAGE: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    EXACT: tl.constexpr, RESIDUAL: tl.constexpr, P_RESIDUAL: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    """Same grid and outputs as :func:`.kv_quant._attend_quant_kernel` (fp8 keys and values)."""
    block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    t0 = block * TOKENS
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    head, row_ok, pos, q_rows, lo, hi = _block_rows(q_begin, q_len, t0, seq_len, kv_head, split, num_splits,
                                                    GROUP, TOKENS, BLOCK_M, BLOCK_N, SPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    if SPLIT:
        if lo >= hi:
            tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, float("-inf"), mask=row_ok)
            return
    q = _load_queries(q_ptr, q_rows, head, offs_d, row_ok, d_ok, stride_qt, stride_qh, False).to(tl.float32)
    amax = tl.max(tl.abs(q), 1)
    q_scale = tl.where(amax > 0, amax * (1.0 / 448.0), 1.0)
    u = tl.minimum(tl.maximum(q / q_scale[:, None], -448.0), 448.0)
    high = _to_e4m3(u, EXACT)
    low = _to_e4m3((u - high.to(tl.float32)) * 16.0, EXACT)  # at most 16 * 16
    row_scale = q_scale * qk_scale
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if TRANSPOSED:
        q8, q8_low = tl.trans(high), tl.trans(low)
        acc = tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32)
    else:
        q8, q8_low = high, low
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    strides = (s_kdb, s_kds, s_kdd, s_ksb, s_kss, s_vdb, s_vds, s_vdd, s_vsb, s_vss)
    kd, ks = kd + kv_head * s_kdh, ks + kv_head * s_ksh
    vd, vs = vd + kv_head * s_vdh, vs + kv_head * s_vsh
    first_pos = seq_len - q_len + t0
    mid = lo + tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, mid, BLOCK_N):
        k, v, k_scale, v_scale = _load_codes(start, hi, table, kd, ks, vd, vs, strides, offs_d, d_ok,
                                             PAGE, BLOCK_N, False)
        if TRANSPOSED:
            acc, m_i, l_i = _fold_codes(acc, m_i, l_i, q8, q8_low, row_scale, k, v, k_scale, v_scale, start, hi,
                                        pos, BLOCK_N, False, EXACT, RESIDUAL, P_RESIDUAL)
        else:
            acc, m_i, l_i = _fold_codes_rows(acc, m_i, l_i, q8, q8_low, row_scale, k, v, k_scale, v_scale, start,
                                             hi, pos, BLOCK_N, False, EXACT, RESIDUAL, P_RESIDUAL)
    for start in range(mid, hi, BLOCK_N):
        k, v, k_scale, v_scale = _load_codes(start, hi, table, kd, ks, vd, vs, strides, offs_d, d_ok,
                                             PAGE, BLOCK_N, True)
        if TRANSPOSED:
            acc, m_i, l_i = _fold_codes(acc, m_i, l_i, q8, q8_low, row_scale, k, v, k_scale, v_scale, start, hi,
                                        pos, BLOCK_N, True, EXACT, RESIDUAL, P_RESIDUAL)
        else:
            acc, m_i, l_i = _fold_codes_rows(acc, m_i, l_i, q8, q8_low, row_scale, k, v, k_scale, v_scale, start,
                                             hi, pos, BLOCK_N, True, EXACT, RESIDUAL, P_RESIDUAL)
    if TRANSPOSED:
        acc = tl.trans(acc)
    _store_rows(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, q_rows, head, offs_d, row_ok, d_ok,
                split, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, SPLIT)
