"""Quantized K/V tiles: read in their stored form, dequantized in registers, folded in.

One concept shared by the attention kernel (:mod:`.kv_quant`) and the one-launch decode
(:mod:`.kv_quant_decode`): :func:`_attend_pages` walks a program's keys a tile at a time,
:func:`_load_tile` gathers a tile's keys and values through the block table as stored
(one byte an element for int8 and fp8, half a byte for nvfp4) and turns them into the
query's product dtype, and :func:`.paged_attention._fold_kv_tile` folds each tile into the
running softmax. Whatever scale can wait is applied to the [rows, keys] scores or the
probabilities instead of the [keys, dims] tile (:func:`_key_scale`). The key and value
formats are separate compile-time choices (``k8v4`` mixes them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ninfer_kernels.triton.paged_attention import _fold_kv_tile
from ninfer_kernels.triton.rounding import e2m1_half


@triton.jit
def _load_part(data_base, scale_base, page, slot, stride_db, stride_ds, stride_dd, stride_sb, stride_ss, dims, ok,
               tok_ok, FMT: tl.constexpr, GROUP: tl.constexpr, DT: tl.constexpr, KEYS: tl.constexpr,
               HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASK_SCALES: tl.constexpr):
    """A tile of dequantized values rounded to ``DT``, before any per-key or per-tensor scale
    (:func:`_key_scale`). ``page``/``slot`` index the tokens and ``dims`` the head dims; they
    broadcast to the tile's shape (``KEYS``: [dims, tokens], else [tokens, dims]); ``ok``
    masks the tile, ``tok_ok`` its tokens alone (and with ``MASK_SCALES`` the group scales).
    One-byte codes lie ``stride_dd`` apart along the dims."""
    row = page * stride_db + slot * stride_ds
    srow = page * stride_sb + slot * stride_ss
    if FMT == 1:
        raw = tl.load(data_base + row + dims * stride_dd, mask=ok, other=0).to(tl.float32)
        scales = _group_scales(scale_base + srow, tok_ok, MASK_SCALES, KEYS, GROUP, HEAD_D, BLOCK_D, BLOCK_N)
        return (raw * scales).to(DT)
    elif FMT == 2:  # codes only, exact in bf16: the per-key scale applies in the fold (_key_scale)
        return tl.load(data_base + row + dims * stride_dd, mask=ok, other=0.0).to(DT)
    else:
        codes = _nvfp4_codes(data_base + row, tok_ok, KEYS, HEAD_D, BLOCK_D)
        block = _group_scales(scale_base + srow, tok_ok, MASK_SCALES, KEYS, 16, HEAD_D, BLOCK_D, BLOCK_N)
        if DT == tl.float16:  # e2m1 x e4m3 has 6 significant bits: exact in fp16 (and in bf16)
            return e2m1_half(codes) * block.to(tl.float16)
        return (e2m1_half(codes).to(tl.float32) * block.to(tl.float32)).to(DT)


@triton.jit
def _nvfp4_codes(rows, tok_ok, KEYS: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """int32 e2m1 codes of a tile ([dims, tokens] for ``KEYS``, else [tokens, dims]) from its
    packed bytes, each token's read whole (two codes a byte, the even dim in the low nibble):
    a byte loaded per code made every load a one-byte gather the pipeline could not copy."""
    pairs = tl.arange(0, BLOCK_D // 2)
    ok = pairs < HEAD_D // 2
    if KEYS:
        packed = tl.load(rows + pairs[:, None], mask=ok[:, None] & tok_ok, other=0).to(tl.int32)
        both = tl.permute(tl.join(packed & 15, packed >> 4), (0, 2, 1))  # [pairs, 2, tokens]
        codes = tl.reshape(both, [BLOCK_D, packed.shape[1]])
    else:
        packed = tl.load(rows + pairs[None, :], mask=tok_ok & ok[None, :], other=0).to(tl.int32)
        codes = tl.interleave(packed & 15, packed >> 4)
    return codes


@triton.jit
def _group_scales(scale_rows, tok_ok, MASKED: tl.constexpr, KEYS: tl.constexpr, GROUP: tl.constexpr,
                  HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scales of GROUP dims each (int8's float32 per 64, nvfp4's e4m3 per 16) spread over a
    tile, from a compact [groups, tokens] load: gathering one per element made int8's
    pipeline copy four scale bytes for every code byte into shared memory (5% of copy
    bandwidth at 8 x 128k).
    ``scale_rows`` points at each token's scales ([1, BLOCK_N] for keys, else [BLOCK_N, 1]);
    tokens past a masked tile's end point into page 0 or past the end of their own page;
    with ``MASKED``, ``tok_ok`` (shaped like ``scale_rows``) zeroes the values' scales there."""
    g = tl.arange(0, BLOCK_D // GROUP)
    g_ok = g < HEAD_D // GROUP
    if KEYS:
        sc = tl.load(scale_rows + g[:, None], mask=g_ok[:, None], other=0.0)
        return tl.reshape(tl.broadcast_to(sc[:, None, :], [BLOCK_D // GROUP, GROUP, BLOCK_N]), [BLOCK_D, BLOCK_N])
    else:
        ok = g_ok[None, :] & tok_ok if MASKED else g_ok[None, :]
        sc = tl.load(scale_rows + g[None, :], mask=ok, other=0.0)
        return tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, BLOCK_D // GROUP, GROUP]), [BLOCK_N, BLOCK_D])


@triton.jit
def _key_scale(scale_base, page, slot, stride_sb, stride_ss, n_ok, gscale, FMT: tl.constexpr):
    """The scale a tile from :func:`_load_part` still needs, applied to the scores or the
    probabilities rather than to every element: per key ``[1, BLOCK_N]`` for fp8 (one scale
    per key and head), nvfp4's per-tensor ``gscale``, 1.0 for int8 (its scales vary along
    the head dims and apply in :func:`_load_part`)."""
    if FMT == 2:
        return tl.load(scale_base + page * stride_sb + slot * stride_ss, mask=n_ok, other=0.0)[None, :]
    elif FMT == 3:
        return gscale
    else:
        return 1.0


@triton.jit
def _load_tile(start, hi, table, kd, ks, vd, vs, strides, offs_d, offs_dv, d_ok, dv_ok, k_gscale, v_gscale,
               PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, KFMT: tl.constexpr,
               VFMT: tl.constexpr, GROUP: tl.constexpr, DT: tl.constexpr, HEAD_D: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Keys [BLOCK_D, BLOCK_N] and values [BLOCK_N, BLOCK_DV], dequantized (see
    :func:`ninfer_kernels.triton.paged_attention._load_kv_tile`), and the per-key key and
    value scales still to apply (see :func:`_key_scale`)."""
    s_kdb, s_kds, s_kdd, s_ksb, s_kss, s_vdb, s_vds, s_vdd, s_vsb, s_vss = strides
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    slot = offs_n % PAGE
    if MASKED:
        # Masked by page, not by token: a mask by token hides from Triton that a page's
        # tokens share one page id, and one-byte value codes, which lie by dim (a page's keys
        # contiguous, allocate_parts), then load a byte at a time (sm_90, triton 3.6, the
        # 27B's batch-8 fp8 shape: a masked tile took 4,014 instructions a warp against
        # 1,378 unmasked; 1,579 now; 2,108 and 1,029 at batch 1's shape). So a masked tile
        # loads keys and one-byte values whole: past the end, scores become -inf whatever
        # the codes (paged_attention._fold_kv_tile), and value codes meet zero
        # probabilities (every writer stores finite codes, kv_quant.py); int8's value
        # scales, which may not be finite, load by token. nvfp4 values lie by token, so
        # their mask costs nothing.
        page = tl.load(table + offs_n // PAGE, mask=offs_n // PAGE * PAGE < hi, other=0).to(tl.int64)
        tok_ok = n_ok
        k_ok = d_ok[:, None]
        v_ok = dv_ok[None, :] if VFMT != 3 else tok_ok[:, None] & dv_ok[None, :]
    else:
        page = tl.load(table + offs_n // PAGE).to(tl.int64)
        tok_ok = offs_n >= 0
        k_ok = d_ok[:, None] & tok_ok[None, :]
        v_ok = tok_ok[:, None] & dv_ok[None, :]
    k = _load_part(kd, ks, page[None, :], slot[None, :], s_kdb, s_kds, s_kdd, s_ksb, s_kss, offs_d[:, None], k_ok,
                   tok_ok[None, :], KFMT, GROUP, DT, True, HEAD_D, BLOCK_D, BLOCK_N, False)
    v = _load_part(vd, vs, page[:, None], slot[:, None], s_vdb, s_vds, s_vdd, s_vsb, s_vss, offs_dv[None, :], v_ok,
                   tok_ok[:, None], VFMT, GROUP, DT, False, HEAD_D, BLOCK_D, BLOCK_N, MASKED)
    k_scale = _key_scale(ks, page, slot, s_ksb, s_kss, n_ok, k_gscale, KFMT)
    v_scale = _key_scale(vs, page, slot, s_vsb, s_vss, n_ok, v_gscale, VFMT)
    return k, v, k_scale, v_scale


@triton.jit
def _attend_pages(acc, m_i, l_i, q, qk_scale, lo, mid, hi, pos, table, kd, ks, vd, vs, strides, offs_d, d_ok,
                  k_gscale, v_gscale, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, KFMT: tl.constexpr,
                  VFMT: tl.constexpr, QGROUP: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
                  UPCAST: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """:func:`.paged_attention._attend_range` over quantized pages (``kd``/``ks``/``vd``/``vs``
    at the program's KV head): keys ``lo..hi``, unmasked tiles below ``mid``."""
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, qk_scale, start, hi, pos, table, kd, ks, vd, vs, strides,
                                     offs_d, d_ok, k_gscale, v_gscale, PAGE, BLOCK_N, False, KFMT, VFMT, QGROUP, DT,
                                     IEEE, UPCAST, HEAD_D, BLOCK_D)
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, qk_scale, start, hi, pos, table, kd, ks, vd, vs, strides,
                                     offs_d, d_ok, k_gscale, v_gscale, PAGE, BLOCK_N, True, KFMT, VFMT, QGROUP, DT,
                                     IEEE, UPCAST, HEAD_D, BLOCK_D)
    return acc, m_i, l_i


@triton.jit
def _attend_tile(acc, m_i, l_i, q, qk_scale, start, hi, pos, table, kd, ks, vd, vs, strides, offs_d, d_ok,
                 k_gscale, v_gscale, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 KFMT: tl.constexpr, VFMT: tl.constexpr, QGROUP: tl.constexpr, DT: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """One tile of quantized pages loaded and folded in (``MASKED``: the bounds and causal masks)."""
    k, v, k_scale, v_scale = _load_tile(start, hi, table, kd, ks, vd, vs, strides, offs_d, offs_d, d_ok, d_ok,
                                        k_gscale, v_gscale, PAGE, BLOCK_N, MASKED, KFMT, VFMT, QGROUP, DT,
                                        HEAD_D, BLOCK_D)
    return _fold_kv_tile(acc, m_i, l_i, q, k, v, qk_scale * k_scale, v_scale, start, hi, pos, BLOCK_N, MASKED,
                         IEEE, UPCAST)
